"""Sibling FP8 linears quantizing their common input once, against the same layers ungrouped.

Eager wall time of a group's calls on one input (q / k / v or gate / up of a model's widths), the
grouped and the ungrouped layers built from the same weights, timed in alternating rounds of
`--calls` calls each with one synchronisation per round; prints the median per call and the ratio.

    python benchmarks/share_ab.py --ms 512 2048 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fp8linear import Fp8BlockLinear, share_input_quantization

# (name, input width, output widths of the group's members)
GROUPS = (
    ("Llama-3-8B q/k/v", 4096, (4096, 1024, 1024)),
    ("Llama-3-8B gate/up", 4096, (14336, 14336)),
    ("DeepSeek-V3 q_a/kv_a", 7168, (1536, 576)),
    ("Qwen2.5-7B q/k/v", 3584, (3584, 512, 512)),
)


def group(k: int, widths: tuple[int, ...], seed: int, device: str) -> nn.Module:
    torch.manual_seed(seed)
    parent = nn.Module()
    for i, n in enumerate(widths):
        lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        setattr(parent, f"l{i}", Fp8BlockLinear.from_linear(lin))
    return parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("share_ab.py times eager GPU calls: it needs a CUDA GPU")
    for name, k, widths in GROUPS:
        for m in args.ms:
            alone, grouped = group(k, widths, 0, "cuda"), group(k, widths, 0, "cuda")
            share_input_quantization(grouped)
            layers = {"alone": list(alone.children()), "grouped": list(grouped.children())}
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for members in layers.values():
                for _ in range(3):  # routed, then planned
                    [layer(x) for layer in members]
            torch.cuda.synchronize()
            times: dict[str, list[float]] = {"alone": [], "grouped": []}
            for r in range(args.rounds):
                order = ("alone", "grouped") if r % 2 else ("grouped", "alone")
                for label in order:
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        [layer(x) for layer in layers[label]]
                    torch.cuda.synchronize()
                    times[label].append((time.perf_counter() - t0) / args.calls * 1e6)
            a, g = statistics.median(times["alone"]), statistics.median(times["grouped"])
            print(f"{name:22s} M={m:<5d} alone {a:8.1f} us  grouped {g:8.1f} us  ({g / a:.3f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
