"""Launch configurations for the blockwise FP8 GEMM: a dataclass and the heuristic that picks one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import GROUP_SIZE

__all__ = ["SMALL_M_MAX", "GemmConfig", "heuristic_config", "select_config"]

# GEMMs with at most this many rows may take the split-K kernel (ops/splitk_gemm.py), where its
# splitk_config asks for a split (long K, few tiles); everything else runs the tiled kernel
# (ops/gemm.py) with these configs. H100 sweep behind the limit: on the DeepSeek-V3 shapes the
# split-K kernel beat the tuned tiled kernel up to M=64 (geometric mean 21.5 vs 22.8 us at M=64).
SMALL_M_MAX = 64


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int = GROUP_SIZE
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
        if GROUP_SIZE % self.block_k:
            raise ValueError(f"GemmConfig.block_k must divide {GROUP_SIZE}, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"num_stages and group_m must be >= 1, got {self.num_stages}, {self.group_m}")


def heuristic_config(m: int, n: int, k: int) -> GemmConfig:
    """A good tiled-kernel config without tuning (H100 sweep, benchmarks/kernel_sweep.py, 2026-11-22)."""
    if m <= SMALL_M_MAX:
        # Decode shapes split-K does not take. What H100 `fp8linear tune` picked under CUDA graphs
        # (7th session, 8 shapes x M 1..64): one tile of 16/32/64 rows covering M, 64 columns up to
        # M=8 and 32 above, 4 warps, 3-6 stages (18432x7168 M=64: 64x64 54 us where the former
        # heuristic, 16x64 s6 for every M, took 91 us).
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        return GemmConfig(block_m=block_m, block_n=64 if m <= 8 else 32, block_k=128, num_warps=4, num_stages=4)
    if m <= 256 or k <= 256:  # short K or few rows: more CTAs (64x128 best for K=256: 47.5 us)
        return GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    # prefill: 128x128, 8 warps (two consumer warpgroups), 4 stages: 871 TF/s at 4096x18432x7168
    return GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)


def select_config(device: torch.device, m: int, n: int, k: int, granularity: str = "block") -> GemmConfig:
    """Tuned table entry for this GPU and shape if there is one, else the heuristic (never tunes here)."""
    if device.type == "cuda":
        from ..tuning import device_name, lookup_config

        cfg = lookup_config(device_name(device), m, n, k, granularity)
        if cfg is not None:
            return cfg
    return heuristic_config(m, n, k)
