"""Host (CPU) time per call of the FP8 linear and its parts, against BF16 `F.linear`.

Eager serving and prefill of small models are bound by the time Python spends enqueueing
kernels, not by the GPU. This times, per call, the host side only: a burst of calls is enqueued
without synchronising (few enough that the launch queue never fills) and the wall time of the
burst is divided by its length; then cProfile shows where `fp8_linear`'s host time goes.

    python benchmarks/host_overhead.py [N:K ...] [--m 1,16,2048] [--calls 40] [--profile-top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fp8linear import fp8_linear, quantize_weight

# Calls per timed burst: far below the CUDA launch queue (~1000 entries), so the host never waits.
DEFAULT_CALLS = 40
# Bursts per measurement; the median is reported.
BURSTS = 7


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median host time per call (µs) of `calls` back-to-back enqueues."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(BURSTS):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", default=["2048:2048", "7168:2048"], help="N:K weight shapes")
    p.add_argument("--m", default="1,16,2048", help="comma-separated token counts")
    p.add_argument("--calls", type=int, default=DEFAULT_CALLS)
    p.add_argument("--profile-top", type=int, default=25, help="cProfile rows (0: no profile)")
    p.add_argument("--profile-backend", default="auto", help="backend of the profiled calls")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py needs a CUDA GPU")
    from fp8linear.ops.cublas_gemm import cublas_fp8_gemm
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.ops.quant import act_quant

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("host us/call; fp8_linear under backend auto (cuBLAS where ops/cublas_gemm.py sends it) and triton;")
    print("act_quant and gemm = our launchers alone; cublas = torch._scaled_mm blockwise alone (M % 4 == 0)")
    print(f"{'shape':>12s} {'M':>5s} {'bf16':>7s} {'fp8 auto':>8s} {'fp8 triton':>10s} {'act_quant':>9s} {'gemm':>7s}"
          f" {'cublas':>7s}")
    for spec in args.shapes:
        n, k = map(int, spec.split(":"))
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_q, w_s = quantize_weight(w, "block")
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x_q, x_s = act_quant(x, w_q.dtype)
            t = {
                "bf16": host_us(lambda: F.linear(x, w), args.calls),
                "auto": host_us(lambda: fp8_linear(x, w_q, w_s, backend="auto"), args.calls),
                "triton": host_us(lambda: fp8_linear(x, w_q, w_s, backend="triton"), args.calls),
                "aq": host_us(lambda: act_quant(x, w_q.dtype), args.calls),
                "gemm": host_us(lambda: block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16), args.calls),
                "cublas": float("nan"),
            }
            if m % 4 == 0:
                sa = x_s.t().contiguous().t()
                t["cublas"] = host_us(lambda: cublas_fp8_gemm(x_q, sa, w_q, w_s, "block", None), args.calls)
            print(f"{spec:>12s} {m:5d} {t['bf16']:7.1f} {t['auto']:8.1f} {t['triton']:10.1f} {t['aq']:9.1f}"
                  f" {t['gemm']:7.1f} {t['cublas']:7.1f}")
    if args.profile_top:
        n, k = map(int, args.shapes[0].split(":"))
        m = int(args.m.split(",")[-1])
        w_q, w_s = quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, "block")
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fp8_linear(x, w_q, w_s, backend=args.profile_backend)
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile_top)
        print(f"cProfile of 200 fp8_linear calls (backend {args.profile_backend}), M={m}, {n}x{k}, by own time:")
        print(s.getvalue())


if __name__ == "__main__":
    main()
