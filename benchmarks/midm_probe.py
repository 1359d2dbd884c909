"""Mid-M (65-1000 rows) probe: our GEMM kernels against BF16 where FP8 loses, and eager host costs.

Parts, each printed as a table (one run, CUDA-graph replays over operand sets rotated past L2):

- ``edge``: one split-K config at M on both sides of a tile boundary (is a partly filled last
  tile slow, and does padding M to a whole tile pay?);
- ``sweep``: every split-K / tiled config in a wide space on the cases where FP8 was slower than
  BF16 in `fp8linear bench --grid`, best first against BF16 and per-tensor cuBLAS;
- ``host``: per-call host cost of the pieces of an eager forward (allocations, launches, lookups);
- ``forward``: where the whole forward's time goes beyond the GEMM's: act_quant alone (both
  layouts), the routed GEMM on quantized inputs, the forward, on the cases where forward - GEMM
  was largest in the grid;
- ``shortk``: 128x128 weights whose K/128 is not a multiple of 4 (K=576, 640, 384, 256) on cuBLAS
  as 1x128 weights with the expanded scale grid held (made once per layer), against our kernel and BF16;
- ``newm``: eager host cost of a layer whose M is new at every call (transformers' DeepSeek
  attention projects the whole cached sequence through kv_b_proj each decode step): the first,
  second and third call of each M against BF16, four layers of the shape meeting each new M in turn
  (as a decode step's kv_b_proj), and a cProfile of first calls.

    python benchmarks/midm_probe.py [--parts edge sweep host forward shortk newm] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from fp8linear.functional import quantize_weight
from fp8linear.ops.configs import GemmConfig
from fp8linear.ops.gemm import block_fp8_gemm
from fp8linear.ops.quant import act_quant
from fp8linear.ops.splitk_gemm import splitk_counters
from fp8linear.ops.configs import SplitKConfig
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

_GRAPH_US = 1500.0
# (N, K, M): the cases where ours was slowest against BF16 in the H100 grid (docs/results/grid).
SWEEP_CASES = [(2112, 7168, 200), (2112, 7168, 77), (2112, 7168, 333), (2048, 7168, 200), (1536, 7168, 320),
               (1536, 7168, 333), (1024, 4096, 333), (1024, 8192, 333), (3584, 3584, 77), (4096, 4096, 77),
               (8192, 29568, 320), (3584, 18944, 640), (576, 7168, 512), (1024, 4096, 160)]
# (N, K, M): forward - GEMM largest against the bytes act_quant moves (H100 grid).
FORWARD_CASES = [(32768, 512, 200), (576, 576, 77), (192, 576, 333), (2112, 7168, 333), (24576, 1536, 512),
                 (7168, 2048, 1024), (7168, 18432, 1024), (512, 3584, 4096), (7168, 16384, 4096)]
EDGE_SHAPES = [(2112, 7168), (1536, 7168)]
EDGE_MS = [128, 136, 192, 200, 208, 240, 256]


def _operands(n: int, k: int, m: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(n * 31 + k * 7 + m)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    w_q, w_s = quantize_weight(w, "block", torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    x_q, x_s = act_quant(x, torch.float8_e4m3fn)
    return w, w_q, w_s, x, x_q, x_s


def _time(fns: dict, device: torch.device) -> dict[str, float]:
    rounds = {}
    for label, (fn, args) in fns.items():
        nbytes = sum(t.numel() * t.element_size() for t in args)
        try:
            rounds[label], _ = prepare_cuda(fn, rotation_sets(args, nbytes, device), 3, True, _GRAPH_US)
        except (RuntimeError, ValueError) as e:
            print(f"  {label}: {str(e).splitlines()[0][:100]}")
    return time_rounds(rounds, 5)


def _ours(cfg, counters):
    return lambda a, sa, b, sb: block_fp8_gemm(a, sa, b, sb, "block", torch.bfloat16, None, config=cfg,
                                               counters=counters)


def _scaled_mm_tensor(w_q):
    one = torch.ones((), device=w_q.device)

    def f(a, b):
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return f


def edge(device: torch.device, out: dict) -> None:
    print("\n== edge: split-K 64x64 at M around tile boundaries (us) ==")
    cfgs = {"sk64x64x2": SplitKConfig(64, 64, 2), "sk64x64x4": SplitKConfig(64, 64, 4),
            "tiled64x64": GemmConfig(64, 64, 128, num_warps=4, num_stages=4)}
    for n, k in EDGE_SHAPES:
        counters = splitk_counters(n, device)
        for m in EDGE_MS:
            w, w_q, w_s, x, x_q, x_s = _operands(n, k, m, device)
            fns = {"bf16": (lambda a, b: a @ b.t(), (x, w))}
            for label, cfg in cfgs.items():
                fns[label] = (_ours(cfg, counters), (x_q, x_s, w_q, w_s))
            us = _time(fns, device)
            out.setdefault("edge", []).append({"n": n, "k": k, "m": m, "us": us})
            print(f"{n}x{k} M={m:4d}  " + "  ".join(f"{lab} {v:6.1f}" for lab, v in us.items()))


def _space(m: int, n: int, k: int) -> dict:
    groups = -(-k // 128)
    out = {}
    for (bm, bn), warps, stages in itertools.product(((64, 64), (64, 128), (128, 64), (128, 128), (32, 64), (64, 32)),
                                                     (4, 8), (3, 4)):
        if bm * bn >= 128 * 128 and warps == 4:
            continue
        if bm * bn <= 64 * 64 and warps == 8:
            continue
        for split in (1, 2, 3, 4, 6, 8):
            if split > groups // 2 and split > 1:
                continue
            cfg = SplitKConfig(bm, bn, split, num_warps=warps, num_stages=stages)
            out[f"sk{bm}x{bn}x{split}w{warps}s{stages}"] = cfg
        out[f"t{bm}x{bn}w{warps}s{stages}"] = GemmConfig(bm, bn, 128, num_warps=warps, num_stages=stages)
    return out


def sweep(device: torch.device, out: dict) -> None:
    print("\n== sweep: best of a wide config space where ours lost to BF16 (us) ==")
    for n, k, m in SWEEP_CASES:
        w, w_q, w_s, x, x_q, x_s = _operands(n, k, m, device)
        counters = splitk_counters(n, device)
        fns = {"bf16": (lambda a, b: a @ b.t(), (x, w))}
        if m % 16 == 0 and k % 16 == 0:
            fns["per_tensor"] = (_scaled_mm_tensor(w_q), (x_q, w_q))
        space = _space(m, n, k)
        for label, cfg in space.items():
            fns[label] = (_ours(cfg, counters), (x_q, x_s, w_q, w_s))
        t0 = time.monotonic()
        us = _time(fns, device)
        ranked = sorted((v, lab) for lab, v in us.items() if lab not in ("bf16", "per_tensor"))
        out.setdefault("sweep", []).append({"n": n, "k": k, "m": m, "us": us})
        pt = us.get("per_tensor", float("nan"))
        print(f"{n}x{k} M={m}: bf16 {us['bf16']:.1f} per-tensor {pt:.1f} ({time.monotonic() - t0:.0f}s, "
              f"{len(ranked)} configs) best: " + ", ".join(f"{lab} {v:.1f}" for v, lab in ranked[:6]))


def forward(device: torch.device, out: dict) -> None:
    from fp8linear.functional import fp8_linear
    from fp8linear.ops.router import route_linear

    print("\n== forward: act_quant, GEMM and forward (us) ==")
    for n, k, m in FORWARD_CASES:
        w, w_q, w_s, x, x_q, x_s = _operands(n, k, m, device)
        xc_q, xc_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
        route = route_linear(device, m, n, k, "block", w_q.dtype, x.dtype, None, True, True)
        counters = splitk_counters(n, device)
        fns = {
            "bf16": (lambda a, b: a @ b.t(), (x, w)),
            "quant": (lambda a: act_quant(a, torch.float8_e4m3fn), (x,)),
            "quant_cublas": (lambda a: act_quant(a, torch.float8_e4m3fn, cublas_layout=True), (x,)),
            "gemm_ours": (lambda a, sa, b, sb: block_fp8_gemm(a, sa, b, sb, "block", torch.bfloat16, None,
                                                              counters=counters), (x_q, x_s, w_q, w_s)),
            "fwd_triton": (lambda a, b, sb: fp8_linear(a, b, sb, backend="triton", counters=counters), (x, w_q, w_s)),
            "fwd": (lambda a, b, sb: fp8_linear(a, b, sb, counters=counters), (x, w_q, w_s)),
        }
        if route.kernel == "cublas":
            fns["gemm_cublas"] = (lambda a, sa, b, sb: block_fp8_gemm(a, sa, b, sb, "block", torch.bfloat16, None,
                                                                      allow_cublas=True), (xc_q, xc_s, w_q, w_s))
        us = _time(fns, device)
        out.setdefault("forward", []).append({"n": n, "k": k, "m": m, "route": route.kernel, "us": us})
        gb = m * k * 3 / 1e3  # act_quant's bytes moved, in kB -> GB/s = kB/us
        print(f"{n}x{k} M={m} ({route.kernel}): " + "  ".join(f"{lab} {v:.1f}" for lab, v in us.items())
              + f"  | quant {gb / us['quant']:.0f} GB/s")


SHORTK_SHAPES = [(1536, 576), (576, 576), (192, 576), (7168, 640), (4096, 384), (7168, 256), (2048, 1408)]
SHORTK_MS = [512, 1024, 2048, 4096, 8192]


def shortk(device: torch.device, out: dict) -> None:
    from fp8linear.ops.cublas_gemm import cublas_weight_scale

    print("\n== shortk: cuBLAS with the expanded 1x128 scale grid held vs ours vs BF16 (us) ==")
    for (n, k), m in itertools.product(SHORTK_SHAPES, SHORTK_MS):
        w, w_q, w_s, x, x_q, x_s = _operands(n, k, m, device)
        xc_q, xc_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
        scale_b = cublas_weight_scale(w_q, w_s, "block", True)  # what torch._scaled_mm reads here: 1x128 scales
        w_t = w_q.t()
        fns = {"bf16": (lambda a, b: a @ b.t(), (x, w)),
               "ours": (lambda a, sa, b, sb: block_fp8_gemm(a, sa, b, sb, "block", torch.bfloat16, None),
                        (x_q, x_s, w_q, w_s)),
               "cublas_held": (lambda a, sa: torch._scaled_mm(a, w_t, scale_a=sa, scale_b=scale_b,
                                                              out_dtype=torch.bfloat16), (xc_q, xc_s))}
        us = _time(fns, device)
        y = torch._scaled_mm(xc_q, w_t, scale_a=xc_s, scale_b=scale_b, out_dtype=torch.bfloat16)
        ref = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16, None)
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        out.setdefault("shortk", []).append({"n": n, "k": k, "m": m, "us": us, "rel_diff": err})
        print(f"{n:5d}x{k:4d} M={m:5d} bf16 {us['bf16']:7.1f} ours {us['ours']:7.1f} cublas_held "
              f"{us['cublas_held']:7.1f}  cublas/ours {us['cublas_held'] / us['ours']:.2f} "
              f"ours/bf16 {us['ours'] / us['bf16']:.2f} cublas/bf16 {us['cublas_held'] / us['bf16']:.2f} "
              f"(rel diff {err:.1e})")


def newm(device: torch.device, out: dict) -> None:
    import cProfile
    import io
    import pstats

    from fp8linear import Fp8BlockLinear

    print("\n== newm: host us per call, a new M each call (kv_b_proj 32768x512, M from 2049) ==")
    lin = torch.nn.Linear(512, 32768, bias=False, device=device, dtype=torch.bfloat16)
    fp8 = Fp8BlockLinear.from_linear(lin)
    ms = list(range(2049, 2049 + 48))
    xs = {m: torch.randn(1, m, 512, device=device, dtype=torch.bfloat16) for m in ms + [m + 100 for m in ms]}
    res = {}
    for fn in (lin, fp8):  # first-ever costs (handles, compilation) out of the way, on other M
        for m in (1500, 1501, 1502, 1500, 1501, 1502):
            fn(torch.randn(1, m, 512, device=device, dtype=torch.bfloat16))
    bf16_ms = [m + 200 for m in ms]
    xs.update({m: torch.randn(1, m, 512, device=device, dtype=torch.bfloat16) for m in bf16_ms})
    for label, fn, seq in (("bf16 F.linear 1st", lin, bf16_ms), ("bf16 F.linear 2nd", lin, bf16_ms),
                           ("fp8 1st call", fp8, ms), ("fp8 2nd call", fp8, ms), ("fp8 3rd call", fp8, ms)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in seq:
            fn(xs[m])
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[label] = (t1 - t0) / len(seq) * 1e6
    # Four layers of the shape, each meeting the step's new M in turn (a decode step's kv_b_proj):
    # the cuBLASLt plan of an M is made by the first layer and shared by the others.
    lins = [torch.nn.Linear(512, 32768, bias=False, device=device, dtype=torch.bfloat16) for _ in range(4)]
    fp8s = [Fp8BlockLinear.from_linear(layer) for layer in lins]
    for layer in lins + fp8s:
        layer(torch.randn(1, 1503, 512, device=device, dtype=torch.bfloat16))
    for label, stack, seq in (("bf16 4 layers", lins, [m + 300 for m in ms]), ("fp8 4 layers", fp8s, [m + 400 for m in ms])):
        xs.update({m: torch.randn(1, m, 512, device=device, dtype=torch.bfloat16) for m in seq})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in seq:
            for layer in stack:
                layer(xs[m])
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[label] = (t1 - t0) / len(seq) / len(stack) * 1e6
    out["newm"] = res
    for label, v in res.items():
        print(f"{label:20s} {v:8.1f}")
    pr = cProfile.Profile()
    pr.enable()
    for m in ms:
        fp8(xs[m + 100])
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    print("\n".join(line[:160] for line in buf.getvalue().splitlines()[:40]))


def _host_us(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def host(device: torch.device, out: dict) -> None:
    from fp8linear import Fp8BlockLinear

    print("\n== host: per-call host cost of eager pieces (us, best of 5 bursts) ==")
    x = torch.randn(8, 7168, device=device, dtype=torch.bfloat16)
    buf = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    plans = {(x.shape, x.dtype, x.device): 1}
    pieces = {
        "torch.empty((8,2112),bf16)": lambda: torch.empty((8, 2112), dtype=torch.bfloat16, device=device),
        "torch.empty 3x": lambda: (torch.empty((8, 7168), dtype=torch.float8_e4m3fn, device=device),
                                  torch.empty((8, 56), dtype=torch.float32, device=device),
                                  torch.empty((8, 2112), dtype=torch.bfloat16, device=device)),
        "buf[:n].view(bf16).view(8,2112)": lambda: buf[:8 * 2112 * 2].view(torch.bfloat16).view(8, 2112),
        "x.data_ptr()": lambda: x.data_ptr(),
        "dict lookup (shape,dtype,device)": lambda: plans.get((x.shape, x.dtype, x.device)),
        "x.is_contiguous()": lambda: x.is_contiguous(),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "torch.compiler.is_compiling": torch.compiler.is_compiling,
        "getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.empty(64 KiB, uint8)": lambda: torch.empty(1 << 16, dtype=torch.uint8, device=device),
        "raw_alloc + raw_delete 64 KiB": lambda: torch._C._cuda_cudaCachingAllocator_raw_delete(
            torch._C._cuda_cudaCachingAllocator_raw_alloc(1 << 16, torch._C._cuda_getCurrentRawStream(0))),
    }
    res = {}
    for label, fn in pieces.items():
        res[label] = _host_us(fn)
    for n, k in ((2112, 7168), (7168, 2048)):
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = Fp8BlockLinear.from_linear(lin)
        for m in (8, 64, 512):
            xm = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            fp8(xm)
            fp8(xm)  # a shape's second call makes its plan
            plan = fp8._plans[(xm.shape, xm.dtype, xm.device)]
            res[f"{n}x{k} M={m} bf16 nn.Linear"] = _host_us(lambda: lin(xm))
            res[f"{n}x{k} M={m} Fp8BlockLinear"] = _host_us(lambda: fp8(xm))
            res[f"{n}x{k} M={m} plan.run ({plan.route.kernel})"] = _host_us(lambda: plan.run(xm))
            for i, call in enumerate(plan.calls):
                tensors = _capture_args(call, plan, xm)
                res[f"{n}x{k} M={m} launch {i} {call.kernel.__name__}"] = _host_us(lambda: call(*tensors))
    out["host"] = res
    for label, v in res.items():
        print(f"{label:55s} {v:7.2f}")


def _capture_args(call, plan, x):
    """The tensors the plan passes to `call` (spied on one run of the plan)."""
    seen = []
    orig = call.__class__.__call__

    def spy(self, *tensors):
        if self is call and not seen:
            seen.append(tensors)
        return orig(self, *tensors)
    call.__class__.__call__ = spy
    try:
        plan.run(x)
    finally:
        call.__class__.__call__ = orig
    return seen[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["edge", "sweep", "host"], choices=["edge", "sweep", "host", "forward", "shortk", "newm"])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), torch.__version__)
    out: dict = {}
    for part in a.parts:
        parts = {"edge": edge, "sweep": sweep, "host": host, "forward": forward, "shortk": shortk, "newm": newm}
        parts[part](device, out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
