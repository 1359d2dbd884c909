"""The warp-specialized Gluon GEMM (fp8linear/ops/ws_gemm.py) against the other kernels, Hopper.

Per (N, K, M), in one run of interleaved CUDA-graph replays over operands rotated past L2, 128x128
weights, bf16 output: BF16 ``x @ w.T``, per-tensor cuBLAS FP8, the router's choice (``auto``),
our Triton kernels alone (``triton``: what backend="triton" runs), the tiled kernel on 128x128 tiles
(``tiled``), and the warp-specialized kernel on 128- and 256-column tiles with 3 and 4 ring slots
(``ws128s3`` ...), persistent (one program per SM) with 3, 4 and 6 slots (``wsp128s3`` ...) and on
256-column tiles with 3 and 4 slots (``wsp256s3``, ``wsp256s4``, ``wsp256s4t4`` with the split tail), on
192-column tiles with 4 and 5 slots (``wsp192s4``, ``wsp192s5``, ``wsp192s4t4``), and
persistent with the last wave's tiles split along K into up to 4, 8 or 16 pieces (``wsp128s4t4``
...). It checks the configs that split nothing here against the tiled kernel bit for bit first, and
the others against it within the kernels' error bound. Prints per-M geometric means of each
method's speedup over BF16.

    python benchmarks/ws_gemm_ab.py [--m 1000 2048 4096 8192] [--shapes 18432x7168 ...]
        [--granularity block|row|tensor] [--configs ws128s3 ...] [--single-release] [--json F]

``--single-release`` adds each config releasing its ring slots after every K group (``NAME-r1``,
``ws_fp8_gemm(release_every=1)``) against the default pairs, after checking both give the same bits.
``--store-ab`` adds each config storing its whole tiles through shared memory by TMA (``NAME-tma``,
``ws_fp8_gemm(tma_store=True)``, where :func:`~fp8linear.ops.ws_gemm.tma_store_ok` allows it) and
from the consumers' registers (``NAME-regs``, ``tma_store=False``) beside the default (``NAME``: the
TMA store where :func:`~fp8linear.ops.ws_gemm.tma_store_pays` too), after checking all give the
same bits.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from fp8linear import block_fp8_matmul, quantize_activation, quantize_weight
from fp8linear.ops.configs import GemmConfig
from fp8linear.ops.gemm import block_fp8_gemm
from fp8linear.ops.configs import sm_count
from fp8linear.ops.ws_gemm import WsConfig, tma_store_ok, ws_accepts, ws_fp8_gemm, ws_plan
from fp8linear.ops.router import route_gemm, tma_ok
from fp8linear.tools.bench import _routed_to_cublas
from fp8linear.tools.grid import grid_shapes
from fp8linear.tools.shapes import parse_shape
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

WS_CONFIGS = {"ws128s3": WsConfig(128, 3), "ws128s4": WsConfig(128, 4), "ws256s3": WsConfig(256, 3),
              "ws256s4": WsConfig(256, 4), "wsp128s3": WsConfig(128, 3, persistent=True),
              "wsp128s4": WsConfig(128, 4, persistent=True), "wsp128s6": WsConfig(128, 6, persistent=True),
              "wsp256s3": WsConfig(256, 3, persistent=True), "wsp256s4": WsConfig(256, 4, persistent=True),
              "wsp256s4t4": WsConfig(256, 4, persistent=True, tail_split=4),
              "wsp192s4": WsConfig(192, 4, persistent=True), "wsp192s5": WsConfig(192, 5, persistent=True),
              "wsp192s4t4": WsConfig(192, 4, persistent=True, tail_split=4),
              "wsp128s4t4": WsConfig(128, 4, persistent=True, tail_split=4),
              "wsp128s4t8": WsConfig(128, 4, persistent=True, tail_split=8),
              "wsp128s4t16": WsConfig(128, 4, persistent=True, tail_split=16)}
# Split-tail configs against the tiled kernel: the split tiles' fp32 sums round differently into
# bf16 (one bf16 rounding, the tests' GEMM bound).
SPLIT_TOL = 3e-3
TILED = GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)


def _bytes(args: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))


def _tma_ok(m: int, n: int, k: int, cfg: WsConfig, dev: torch.device) -> bool:
    """Whether `cfg` can store a bf16 (m, n) output's tiles by TMA on `dev` (its split as planned)."""
    split = ws_plan(m, n, k, cfg, sm_count(dev))[2]
    return tma_store_ok(torch.empty(m, n, dtype=torch.bfloat16, device=dev), cfg, split)


def measure(n: int, k: int, m: int, gen: torch.Generator, gran: str, configs: dict[str, WsConfig],
            single_release: bool = False, store_ab: bool = False) -> dict[str, float] | None:
    dev = torch.device("cuda")
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    w_q, w_s = quantize_weight(w, gran)
    w_qt, w_st = quantize_weight(w, "tensor")
    x_q, x_s = quantize_activation(x, fp8_dtype=w_q.dtype, backend="triton")
    x_s = x_s.contiguous()
    if not ws_accepts(x_q, w_q, torch.bfloat16):
        return None
    tiled = block_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.bfloat16, None, TILED)
    same, split_err = True, 0.0
    # the stores each config is timed and checked with beside its default (--store-ab)
    arms = {name: [False] + ([True] if _tma_ok(m, n, k, cfg, dev) else []) if store_ab else []
            for name, cfg in configs.items()}
    for name, cfg in configs.items():
        y = ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.bfloat16, None, cfg)
        if single_release and not torch.equal(
                y.view(torch.int16), ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.bfloat16, None, cfg,
                                                 release_every=1).view(torch.int16)):
            raise AssertionError(f"{n}x{k} M={m} {cfg}: releasing ring slots per group changed the bits")
        for forced in arms[name]:
            if not torch.equal(y.view(torch.int16), ws_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.bfloat16, None, cfg,
                                                                tma_store=forced).view(torch.int16)):
                raise AssertionError(f"{n}x{k} M={m} {cfg}: tma_store={forced} changed the bits")
        if ws_plan(m, n, k, cfg, sm_count(dev))[2] == 1:  # as ws_fp8_gemm plans it
            same = same and torch.equal(y.view(torch.int16), tiled.view(torch.int16))
        else:
            split_err = max(split_err, float((y.double() - tiled.double()).norm() / tiled.double().norm()))
    xs_auto = x_s.t().contiguous().t() if _routed_to_cublas(x_q, w_q, gran, True) else x_s
    one = torch.ones((), device=dev)
    methods = {
        "bf16": (lambda a, b: a @ b.t(), (x, w)),
        "tensor": (lambda a, b, sa, sb: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16),
                   (x_q, w_qt, one, w_st)),
        "auto": (lambda a, sa, b, sb: block_fp8_matmul(a, sa, b, sb, torch.bfloat16), (x_q, xs_auto, w_q, w_s)),
        # (the per-tensor and BF16 bars are the same for every weight granularity)
        "triton": (lambda a, sa, b, sb: block_fp8_matmul(a, sa, b, sb, torch.bfloat16, backend="triton"),
                   (x_q, x_s, w_q, w_s)),
        "tiled": (lambda a, sa, b, sb: block_fp8_gemm(a, sa, b, sb, gran, torch.bfloat16, None, TILED),
                  (x_q, x_s, w_q, w_s)),
    }
    for name, cfg in configs.items():
        methods[name] = (lambda a, sa, b, sb, cfg=cfg: ws_fp8_gemm(a, sa, b, sb, gran, torch.bfloat16, None, cfg),
                         (x_q, x_s, w_q, w_s))
        if single_release:  # the same config releasing its ring slots after every K group
            methods[name + "-r1"] = (lambda a, sa, b, sb, cfg=cfg: ws_fp8_gemm(
                a, sa, b, sb, gran, torch.bfloat16, None, cfg, release_every=1), (x_q, x_s, w_q, w_s))
        for forced in arms[name]:  # the same config storing its tiles by TMA or from the consumers' registers
            methods[name + ("-tma" if forced else "-regs")] = (lambda a, sa, b, sb, cfg=cfg, forced=forced: ws_fp8_gemm(
                a, sa, b, sb, gran, torch.bfloat16, None, cfg, tma_store=forced), (x_q, x_s, w_q, w_s))
    rounds = {}
    for name, (fn, args) in methods.items():
        rounds[name], _ = prepare_cuda(fn, rotation_sets(args, _bytes(args), dev), 3, graph_timer=True)
    t = time_rounds(rounds, 5)
    t["same_bits"] = float(same)
    t["split_rel_err"] = split_err
    if split_err > SPLIT_TOL:
        raise AssertionError(f"{n}x{k} M={m}: a split-tail config is {split_err:.2e} from the tiled kernel")
    route = route_gemm(dev, m, n, k, gran, w_q.dtype, torch.bfloat16, None, False, tma_ok(x_q) and tma_ok(w_q), True)
    cfg = route.config
    t["triton_route"] = route.kernel + (f" {cfg.block_m}x{cfg.block_n}" if hasattr(cfg, "block_m") else "")
    return t


def _geomeans(rows: list[dict], names: list[str]) -> dict[str, float]:
    """Geomean speedup over BF16 of each method, over the rows that timed it (NAME-tma: where the
    config can store by TMA)."""
    out = {}
    for nm in names:
        have = [r for r in rows if nm in r]
        if have:
            out[nm] = math.exp(sum(math.log(r["bf16"] / r[nm]) for r in have) / len(have))
    return out


def best_ws(t: dict[str, float]) -> float:
    return min(t[name] for name in WS_CONFIGS if name in t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[1000, 2048, 4096, 8192])
    p.add_argument("--shapes", nargs="+")
    p.add_argument("--granularity", default="block", choices=["block", "row", "tensor"])
    p.add_argument("--configs", nargs="+", choices=list(WS_CONFIGS), default=list(WS_CONFIGS))
    p.add_argument("--single-release", action="store_true",
                   help="also time each config releasing its ring slots after every K group (NAME-r1)")
    p.add_argument("--store-ab", action="store_true",
                   help="also time each config storing its tiles by TMA (NAME-tma) and from registers (NAME-regs)")
    p.add_argument("--json")
    a = p.parse_args()
    configs = {name: WS_CONFIGS[name] for name in a.configs}
    shapes = [parse_shape(s) for s in a.shapes] if a.shapes else grid_shapes()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for s in shapes:
        for m in a.m:
            t = measure(s.n, s.k, m, gen, a.granularity, configs, a.single_release, a.store_ab)
            if t is None:
                print(f"{s.n:6}x{s.k:<6} M={m:5} not TMA-addressable: skipped")
                continue
            rows.append({"n": s.n, "k": s.k, "m": m, **t})
            print(f"{s.n:6}x{s.k:<6} M={m:5} " + " ".join(f"{kk}={v:.1f}" if isinstance(v, float) else f"{kk}={v}"
                                                       for kk, v in t.items())
                  + f"  best ws/tiled={best_ws(t) / t['tiled']:.3f} /auto={best_ws(t) / t['auto']:.3f}", flush=True)
    names = ["tensor", "auto", "triton", "tiled", *configs, *(f"{c}-r1" for c in configs if a.single_release),
             *(f"{c}-{arm}" for c in configs for arm in ("tma", "regs") if a.store_ab)]
    for m in a.m:
        sel = [r for r in rows if r["m"] == m]
        if sel:
            gm = _geomeans(sel, names)
            print(f"M={m}: x BF16 geomean over {len(sel)}: " + " ".join(f"{nm} {v:.3f}" for nm, v in gm.items()))
    gm_all = _geomeans(rows, names)
    print("all: x BF16 geomean: " + " ".join(f"{nm} {v:.3f}" for nm, v in gm_all.items()))
    print(f"every unsplit ws config same bits as tiled in {sum(r['same_bits'] for r in rows):.0f} of {len(rows)}; "
          f"split configs' largest relative difference {max((r['split_rel_err'] for r in rows), default=0):.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
