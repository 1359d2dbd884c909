"""The warp-specialized Gluon GEMM under forced tail plans, Hopper: what a split tile costs.

`ws_fp8_gemm` cuts the tiles of a partly filled last wave along K (`ws_gemm.tail_plan`: whole
tiles, pieces per tail tile, K groups per piece). Here that plan is replaced per method: ``unsplit``
(every tile whole), ``shipped`` (the kernel's own plan, printed) and each ``--plans W,S,G`` (W whole
tiles, then every other tile in S pieces of G K groups; ``0,4,8`` cuts every tile of K = 4096 in 4).
``--sum-widths`` also times each split plan with the split sum unrolled to each given width (a
power of two, at least the plan's split; `ws_gemm.sum_width` picks the split rounded up to one).
Per (N, K, M), in one run of interleaved CUDA-graph replays over operands rotated past L2, 128x128
weights, bf16 output, the router's config of `--block-n` columns (`WS_CONFIGS_BY_WIDTH`); each plan's
output is checked against the unsplit one (the pieces' fp32 sums round once more into bf16), and
each forced width's output is bit for bit its plan's.

    python benchmarks/ws_tail_plans.py [--shapes 4096x4096 ...] [--m 512 640] [--plans 0,4,8 0,2,16]
                                       [--sum-widths 2 4] [--block-n 128]
"""

from __future__ import annotations

import argparse

import torch

import fp8linear.ops.ws_gemm as ws_gemm
from fp8linear.ops import router
from fp8linear import quantize_activation, quantize_weight
from fp8linear.ops.configs import sm_count
from fp8linear.tools.shapes import parse_shape
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

# Warm-up calls before capture and interleaved timing rounds: the defaults of `fp8linear bench`.
WARMUP, ROUNDS = 3, 7
# A split plan's output against the unsplit one: the kernels' bf16 rounding of a differently summed fp32.
SPLIT_TOL = 3e-3


def _plan(text: str) -> tuple[int, int, int]:
    try:
        whole, split, groups = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a plan is WHOLE,SPLITS,GROUPS (three integers), got {text!r}") from None
    if whole < 0 or split < 1 or groups < 1:
        raise argparse.ArgumentTypeError(f"a plan needs WHOLE >= 0, SPLITS >= 1, GROUPS >= 1, got {text!r}")
    return whole, split, groups


def _width(text: str) -> int:
    try:
        width = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a sum width is an integer, got {text!r}") from None
    if width < 1 or width & (width - 1) or width > ws_gemm.TAIL_MAX_SPLIT:
        raise argparse.ArgumentTypeError(f"a sum width is a power of two up to {ws_gemm.TAIL_MAX_SPLIT}, "
                                         f"got {width}")
    return width


def measure(n: int, k: int, m: int, plans: list[tuple[int, int, int]], widths: list[int], block_n: int,
            gen: torch.Generator) -> dict[str, float]:
    """Times of each forced (plan, sum width) at this shape, in µs, keyed by their names."""
    dev = torch.device("cuda")
    config = router.WS_CONFIGS_BY_WIDTH[block_n]  # the shipped persistent config with a split tail
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.05).to(torch.bfloat16)  # a trained layer's spread
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    w_q, w_s = quantize_weight(w, "block")
    x_q, x_s = quantize_activation(x, fp8_dtype=w_q.dtype, backend="triton")
    args = (x_q, x_s.contiguous(), w_q, w_s)
    nbytes = sum(t.numel() * t.element_size() for t in args)
    tiles, *shipped = ws_gemm.ws_plan(m, n, k, config, sm_count(dev))
    shipped, groups = tuple(shipped), -(-k // 128)
    forced = {"unsplit": (tiles, 1, groups), f"shipped{shipped}": shipped}
    for whole, split, per in plans:
        if whole > tiles or (whole < tiles and split * per < groups):
            raise SystemExit(f"{n}x{k} M={m}: plan {whole},{split},{per} does not cover {tiles} tiles of "
                             f"{groups} K groups")
        forced[f"w{whole}s{split}g{per}"] = (whole, split, per)
    runs = {}  # name -> (plan, sum width or None for sum_width's own)
    for name, plan in forced.items():
        runs[name] = (plan, None)
        for width in widths:
            if plan[1] > 1 and width >= plan[1]:
                runs[f"{name}/sum{width}"] = (plan, width)
    real_plan, real_width = ws_gemm.tail_plan, ws_gemm.sum_width
    rounds, ref, own = {}, None, {}
    try:
        for name, (plan, width) in runs.items():
            ws_gemm.tail_plan = lambda *_, p=plan: p  # both read by ws_fp8_gemm at each call (and capture)
            ws_gemm.sum_width = real_width if width is None else (lambda _, w=width: w)

            def fn(a, sa, b, sb):
                return ws_gemm.ws_fp8_gemm(a, sa, b, sb, "block", torch.bfloat16, None, config)

            y = fn(*args)
            if width is None:
                own[plan] = y
            elif not torch.equal(y.view(torch.int16), own[plan].view(torch.int16)):
                raise AssertionError(f"{n}x{k} M={m} {name}: not the bits of the plan at its own sum width")
            ref = y.double() if ref is None else ref
            err = float((y.double() - ref).norm() / ref.norm())
            if err > SPLIT_TOL:
                raise AssertionError(f"{n}x{k} M={m} {name}: {err:.2e} from the unsplit output")
            rounds[name], _ = prepare_cuda(fn, rotation_sets(args, nbytes, dev), WARMUP, graph_timer=True)
    finally:
        ws_gemm.tail_plan, ws_gemm.sum_width = real_plan, real_width
    return time_rounds(rounds, ROUNDS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "576x7168"], help="N,K or NxK")
    ap.add_argument("--m", nargs="+", type=int, default=[512, 640, 4096])
    ap.add_argument("--plans", nargs="*", type=_plan, default=[], help="WHOLE,SPLITS,GROUPS")
    ap.add_argument("--sum-widths", nargs="*", type=_width, default=[],
                    help="also time each split plan with its sum unrolled this wide")
    ap.add_argument("--block-n", type=int, choices=(128, 192, 256), default=128, help="tile width")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and ws_gemm.ws_device_ok(torch.device("cuda"))):
        raise SystemExit("needs a Hopper GPU and a Triton whose Gluon has warp_specialize")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        parsed = parse_shape(shape)
        n, k = parsed.n, parsed.k
        for m in args.m:
            t = measure(n, k, m, args.plans, args.sum_widths, args.block_n, gen)
            print(f"{n}x{k} M={m}: " + "  ".join(f"{name} {us:.1f}" for name, us in t.items()), flush=True)


if __name__ == "__main__":
    main()
