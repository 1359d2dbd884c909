"""CPU time of an MoE experts layer: transformers' own BF16 experts module vs Fp8Experts.

The BF16 side is transformers' ``Qwen3MoeExperts`` with the experts implementation ``--impl``
(``eager``, its loop over the hit experts, or ``grouped_mm``); the FP8 side is ``Fp8Experts.from_experts`` of that module (128x128 weights), which on
CPU tensors runs each hit expert's rows through the CPU FP8 linear. Rounds interleave the two;
medians of per-round times and ratios are printed. Routing is a softmax top-k of random logits.

    python benchmarks/cpu_moe.py [--threads 2] [--hidden 2048] [--inter 768] [--experts 32]
                                 [--top-k 8] [--tokens 1,8,64] [--rounds 3]

The defaults are Qwen3-30B-A3B's widths (hidden 2048, expert width 768, top-8) with 32 of its 128
experts: a token's cost depends on the top-k experts it meets, not on how many exist. The column
``fp8 1by1`` times the FP8 path with its hit experts run one after the other (each linear's rows
split over the threads) instead of side by side (``router.cpu_experts_in_parallel``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

from fp8linear.ops import router


def build(hidden: int, inter: int, experts: int, top_k: int, impl: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8linear.integrations.experts import Fp8Experts

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=top_k)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    bf16 = Qwen3MoeExperts(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        bf16.gate_up_proj.normal_(0, 0.02)
        bf16.down_proj.normal_(0, 0.02)
    return bf16, Fp8Experts.from_experts(bf16, granularity="block").eval()


def per_call_ms(fn: Callable[[], object], budget_s: float) -> float:
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - t0 < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cpu_moe.py", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impl", default="eager", help="transformers' experts implementation for the BF16 side "
                    "(eager: its loop over hit experts; grouped_mm: torch._grouped_mm)")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of calls per method and round")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bf16, fp8 = build(args.hidden, args.inter, args.experts, args.top_k, args.impl)
    print(f"torch {torch.__version__}, {args.threads} threads; hidden {args.hidden}, expert width {args.inter}, "
          f"{args.experts} experts, top-{args.top_k}; BF16 experts implementation {args.impl!r}")
    print(f"{'tokens':>6} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8/bf16':>9} {'fp8 1by1':>9} {'1by1/bf16':>9} {'rel diff':>9}")
    for t in (int(v) for v in args.tokens.split(",")):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, args.hidden, generator=g).to(torch.bfloat16)
        w, idx = torch.topk(torch.randn(t, args.experts, generator=g).softmax(-1), args.top_k, dim=-1)
        w = w.to(torch.bfloat16)
        times: dict[str, list[float]] = {"bf16": [], "fp8": [], "fp8_1by1": []}
        one_by_one = mock.patch.object(router, "cpu_experts_in_parallel", lambda *args: False)
        with torch.no_grad():
            y_bf, y_fp = bf16(x, idx, w).float(), fp8(x, idx, w).float()
            for _ in range(args.rounds):
                times["bf16"].append(per_call_ms(lambda: bf16(x, idx, w), args.budget))
                times["fp8"].append(per_call_ms(lambda: fp8(x, idx, w), args.budget))
                with one_by_one:
                    times["fp8_1by1"].append(per_call_ms(lambda: fp8(x, idx, w), args.budget))
        ratio = statistics.median(f / b for b, f in zip(times["bf16"], times["fp8"]))
        ratio_1 = statistics.median(f / b for b, f in zip(times["bf16"], times["fp8_1by1"]))
        diff = ((y_fp - y_bf).norm() / y_bf.norm()).item()
        print(f"{t:>6} {statistics.median(times['bf16']):>9.2f} {statistics.median(times['fp8']):>9.2f} "
              f"{ratio:>9.2f} {statistics.median(times['fp8_1by1']):>9.2f} {ratio_1:>9.2f} {diff:>9.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
