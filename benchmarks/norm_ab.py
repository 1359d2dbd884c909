"""transformers' RMSNorm against fp8linear's FusedRMSNorm (one launch): eager wall time per call
(calls back to back, one synchronisation at the end, the two modules interleaved over rounds) and
GPU time (``triton.testing.do_bench``), bf16, DeepSeek-V3 widths.

    python benchmarks/norm_ab.py [--n 7168 1536 512] [--m 1 8 512 2048 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

from fp8linear.norm import FusedRMSNorm

CALLS = 200  # per timed burst
ROUNDS = 7


def wall_us(module, x) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(CALLS):
        module(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / CALLS * 1e6


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", nargs="+", type=int, default=[7168, 1536, 512])
    p.add_argument("--m", nargs="+", type=int, default=[1, 8, 512, 2048, 8192])
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'N':>6s}{'M':>6s}{'hf wall us':>12s}{'fused wall':>12s}{'ratio':>8s}{'hf gpu us':>11s}{'fused gpu':>11s}")
    for n in a.n:
        for m in a.m:
            hf = DeepseekV3RMSNorm(n, 1e-6).cuda().to(torch.bfloat16)
            hf.weight.uniform_(0.5, 1.5)
            fused = FusedRMSNorm.from_module(hf, 1e-6)
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            for mod in (hf, fused):  # first calls: compile, plan
                for _ in range(5):
                    mod(x)
            walls = {"hf": [], "fused": []}
            for _ in range(ROUNDS):
                walls["hf"].append(wall_us(hf, x))
                walls["fused"].append(wall_us(fused, x))
            gpu = [triton.testing.do_bench(lambda mod=mod: mod(x), warmup=20, rep=100) * 1e3 for mod in (hf, fused)]
            w = [statistics.median(walls[k]) for k in ("hf", "fused")]
            print(f"{n:6d}{m:6d}{w[0]:12.1f}{w[1]:12.1f}{w[1] / w[0]:8.2f}{gpu[0]:11.1f}{gpu[1]:11.1f}")


if __name__ == "__main__":
    main()
