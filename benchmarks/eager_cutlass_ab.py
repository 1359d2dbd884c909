"""Eager A/B: plans on the CUTLASS kernels against the router's eager choice and cuBLAS blockwise
plans, with BF16 ``nn.Linear`` in the same interleaved bursts: wall and host (enqueue) us per call,
and the GPU time under CUDA graphs, to place the router's eager cut for CUTLASS
(``EAGER_CUTLASS_MIN_MNK``). A data-parallel kernel's plan quantizes its input in the library's
call (``CutlassCall.with_quantization``), allocating its output and scratch in the same C++ call where
the plan-call module is built (``CutlassCall.allocating_call``; the ``ctypes`` column: the router's
choice without it); ``<config>-2`` columns run the same kernel after a separate act_quant launch.
Needs a Hopper GPU and ``fp8linear build-cutlass``.

    python benchmarks/eager_cutlass_ab.py [--m 96 128 256 333 512 1024 2048] [--host]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fp8linear import Fp8BlockLinear
from fp8linear.ops import cutlass_gemm, router
from fp8linear.ops.cutlass_gemm import CUTLASS_CONFIGS, CutlassCall, cutlass_available
from fp8linear.ops.route_table import RouteEntry
from fp8linear.tools.bench_eager import _burst_times, _gpu_us

SHAPES = ((2112, 7168), (24576, 1536), (7168, 2048), (1536, 7168), (7168, 18432), (576, 7168))


def _forced_layer(lin: nn.Linear, x: torch.Tensor, entry: RouteEntry | None,
                  cutlass: bool = True, fused: bool = True, plan_call: bool = True) -> Fp8BlockLinear:
    """An Fp8BlockLinear whose plan for x's shape runs `entry` eagerly (None: the router's own choice;
    `cutlass=False`: the router's choice without the CUTLASS kernels; `fused=False`: a CUTLASS plan
    with a separate act_quant launch; `plan_call=False`: without the plan-call module)."""
    layer = Fp8BlockLinear.from_linear(lin, "block")
    real = (router.lookup_route, router.EAGER_CUTLASS_MIN_MNK, router.EAGER_CUBLAS_MIN_MNK, router.cutlass_available,
            CutlassCall.with_quantization, cutlass_gemm._plan_call)
    if entry is not None:
        router.lookup_route = lambda *a, **k: entry
        router.EAGER_CUTLASS_MIN_MNK = router.EAGER_CUBLAS_MIN_MNK = 0
    if not cutlass:
        router.cutlass_available = lambda device: False
    if not fused:
        CutlassCall.with_quantization = lambda self: None
    if not plan_call:
        cutlass_gemm._plan_call = lambda: None
    try:
        layer(x)
        layer(x)  # a shape's second call makes its plan
    finally:
        (router.lookup_route, router.EAGER_CUTLASS_MIN_MNK, router.EAGER_CUBLAS_MIN_MNK, router.cutlass_available,
         CutlassCall.with_quantization, cutlass_gemm._plan_call) = real
    return layer


def _host_us(call: CutlassCall, args: tuple, calls: int) -> float:
    for _ in range(20):
        call(*args)
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            call(*args)
        samples.append((time.perf_counter() - t0) / (calls // 5) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def host_parts(n: int = 2112, k: int = 7168, m: int = 512, calls: int = 2000) -> None:
    """Host us per call of the CUTLASS call alone (enqueue only, no quantization) per kernel; for the
    data-parallel kernels also with the parameters built per call (the stream-K kernel's way)."""
    dev = torch.device("cuda")
    w_q = torch.randn(n, k, device=dev).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_s = torch.rand(-(-n // 128), -(-k // 128), device=dev) + 0.5
    x_q = torch.randn(m, k, device=dev).clamp(-448, 448).to(torch.float8_e4m3fn)
    x_s = torch.rand(m, -(-k // 128), device=dev) + 0.5
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    for cfg in CUTLASS_CONFIGS:
        call = CutlassCall(w_q, w_s, None, m, cfg)
        ws = torch.empty(max(call.workspace_bytes, 1), dtype=torch.uint8, device=dev)
        args = (x_q.data_ptr(), x_s.data_ptr(), y.data_ptr(), ws.data_ptr() if call.workspace_bytes else None)
        line = f"CutlassCall {cfg.name} {n}x{k} M={m}: host {_host_us(call, args, calls):.2f} us per call"
        if call.prepared:
            per_call = CutlassCall(w_q, w_s, None, m, cfg)
            per_call.release(per_call.prepared)
            per_call.prepared = None
            line += f" prepared, {_host_us(per_call, args, calls):.2f} built per call"
            call(*args)
            first = y.clone()
            per_call(*args)
            line += f" (same bits: {torch.equal(first.view(torch.int16), y.view(torch.int16))})"
        print(line + f" (workspace {call.workspace_bytes} bytes)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", nargs="+", type=int, default=[96, 128, 256, 333, 512, 1024, 2048])
    p.add_argument("--host", action="store_true", help="also time the CUTLASS call's host cost alone")
    args = p.parse_args()
    dev = torch.device("cuda")
    if not cutlass_available(dev):
        raise SystemExit("the CUTLASS kernels are not available here: run `fp8linear build-cutlass` on a Hopper GPU")
    if args.host:
        host_parts()
    forced = {cfg.name: RouteEntry("cutlass", cfg) for cfg in CUTLASS_CONFIGS}
    forced.update({f"{cfg.name}-2": RouteEntry("cutlass", cfg) for cfg in CUTLASS_CONFIGS if not cfg.stream_k})
    forced["cublas"] = RouteEntry("cublas")
    print(f"{torch.cuda.get_device_name()}; per method: eager wall us / host us / GPU us (CUDA graphs)")
    names = ["bf16", "auto", "ctypes", "no-cutlass", *forced]
    print(f"{'shape':>12s} {'M':>5s} " + " ".join(f"{n:>19s}" for n in names)
          + "  best-cutlass/auto  auto/no-cutlass  auto/ctypes  routes (auto, no-cutlass)")
    ratios, gains, plan_calls = [], [], []
    one_call = {cfg.name: ([], []) for cfg in CUTLASS_CONFIGS if not cfg.stream_k}
    for n, k in SHAPES:
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        for m in args.m:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                  for _ in range(max(2, min(16, (100 << 20) // (m * k * 2))))]
            layers = {"auto": _forced_layer(lin, xs[0], None), "ctypes": _forced_layer(lin, xs[0], None, plan_call=False),
                      "no-cutlass": _forced_layer(lin, xs[0], None, False)}
            for name, entry in forced.items():
                layers[name] = _forced_layer(lin, xs[0], entry, fused=not name.endswith("-2"))
            methods = {"bf16": lin, **layers}
            with torch.inference_mode():
                times = _burst_times(methods, xs, dev)
                gpu = {name: _gpu_us(fn, xs) for name, fn in methods.items()}
                ref = layers["cublas"](xs[0]).float()
                for name in forced:
                    err = (layers[name](xs[0]).float() - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item():
                        raise SystemExit(f"{name} at {n}x{k} M={m} differs from cuBLAS by {err}")
            best = min(times[c.name][0] for c in CUTLASS_CONFIGS)
            for name, (wall, host) in one_call.items():
                wall.append(times[name][0] / times[f"{name}-2"][0])
                host.append(times[name][1] / times[f"{name}-2"][1])
            ratios.append(best / times["auto"][0])
            gains.append(times["auto"][0] / times["no-cutlass"][0])
            kinds = [next(iter(layers[nm]._plans.values())).route.kernel for nm in ("auto", "no-cutlass")]
            if kinds[0] == "cutlass":
                plan_calls.append((times["auto"][0] / times["ctypes"][0], times["auto"][1] / times["ctypes"][1]))
            cells = " ".join(f"{times[nm][0]:6.1f}/{times[nm][1]:5.1f}/{gpu[nm] or float('nan'):5.1f}" for nm in names)
            print(f"{n:>5d}x{k:<6d} {m:5d} {cells}  {ratios[-1]:6.3f}  {gains[-1]:6.3f}  "
                  f"{times['auto'][0] / times['ctypes'][0]:6.3f}  {','.join(kinds)}", flush=True)
    print(f"geomean best-cutlass / auto eager wall: {statistics.geometric_mean(ratios):.3f}; "
          f"auto / no-cutlass: {statistics.geometric_mean(gains):.3f}")
    if plan_calls:
        print(f"geomean auto / ctypes where auto is CUTLASS ({len(plan_calls)} cases; with / without the plan-call "
              f"module): eager wall {statistics.geometric_mean(w for w, _ in plan_calls):.3f}, "
              f"host {statistics.geometric_mean(h for _, h in plan_calls):.3f}")
    for name, (wall, host) in one_call.items():
        print(f"geomean {name} / {name}-2 (one host call / two launches): eager wall "
              f"{statistics.geometric_mean(wall):.3f}, host {statistics.geometric_mean(host):.3f}")


if __name__ == "__main__":
    main()
