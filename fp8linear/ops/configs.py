"""Launch configurations for the blockwise FP8 GEMM: a dataclass and the heuristics that pick one.

NVIDIA GPUs use :func:`heuristic_config`; AMD Instinct GPUs (ROCm builds of torch, arch names
``gfx9xx``) use :func:`amd_heuristic_config`, whose configs carry the AMD compiler options
(``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``). :func:`launch_options` turns a config into
the extra launch keywords for the running platform (none on NVIDIA, where Triton rejects them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..formats import GROUP_SIZE

__all__ = [
    "SMALL_M_MAX",
    "AMD_OPTION_FIELDS",
    "AMD_CU_COUNT",
    "GemmConfig",
    "heuristic_config",
    "amd_heuristic_config",
    "amd_gemm_config",
    "amd_grouped_config",
    "amd_grouped_config_here",
    "amd_splitk_options",
    "splitk_num_stages",
    "moe_align_num_warps",
    "is_amd_arch",
    "hip_arch",
    "device_arch",
    "amd_launch_options",
    "launch_options",
]

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
    # AMD (HIP backend) compiler options; the defaults are Triton's (the compiler chooses) and
    # are never passed on NVIDIA (see launch_options).
    waves_per_eu: int = 0
    matrix_instr_nonkdim: int = 0
    kpack: int = 1

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
        _check_amd_options(self.waves_per_eu, self.matrix_instr_nonkdim, self.kpack, "GemmConfig")

    def amd_options(self) -> dict[str, int]:
        """The AMD compiler options of this config (launch keywords on ROCm)."""
        return {f: getattr(self, f) for f in AMD_OPTION_FIELDS}


# Field names of the AMD compiler options (HIPOptions) a config may carry.
AMD_OPTION_FIELDS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# Compute units per arch, for tile-count decisions when no device is at hand (MI300X / MI325X
# have 304 CUs; MI355X, gfx950, 256).
AMD_CU_COUNT = {"gfx942": 304, "gfx950": 256}
_DEFAULT_CU_COUNT = 304


def _check_amd_options(waves_per_eu: int, nonkdim: int, kpack: int, owner: str) -> None:
    if not 0 <= waves_per_eu <= 8:
        raise ValueError(f"{owner}.waves_per_eu must be in [0, 8] (0: compiler's choice), got {waves_per_eu}")
    if nonkdim not in (0, 16, 32):
        raise ValueError(f"{owner}.matrix_instr_nonkdim must be 0, 16 or 32, got {nonkdim}")
    if kpack not in (1, 2):
        raise ValueError(f"{owner}.kpack must be 1 or 2, got {kpack}")


def is_amd_arch(arch: str | None) -> bool:
    """Whether a device/arch name is an AMD GPU arch ('gfx942', 'gfx950', ...), as tables are keyed on ROCm."""
    return isinstance(arch, str) and arch.startswith("gfx") and arch[3:4].isdigit()


def hip_arch(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' (torch's gcnArchName) -> 'gfx942'."""
    arch = gcn_arch_name.split(":", 1)[0].strip()
    if not is_amd_arch(arch):
        raise ValueError(f"not an AMD GPU arch name: {gcn_arch_name!r}")
    return arch


@lru_cache(maxsize=16)
def _device_arch(index: int) -> str:
    return hip_arch(torch.cuda.get_device_properties(index).gcnArchName)


def device_arch(device: torch.device | None = None) -> str | None:
    """The AMD arch ('gfx942') of a ROCm device, None on NVIDIA, CPU or without a GPU."""
    if torch.version.hip is None or not torch.cuda.is_available():
        return None
    if device is not None and device.type != "cuda":
        return None
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _device_arch(index)


def heuristic_config(m: int, n: int, k: int) -> GemmConfig:
    """A good tiled-kernel config without tuning (H100 sweep, benchmarks/kernel_sweep.py, 2026-11-22)."""
    if m <= SMALL_M_MAX:
        # Decode shapes split-K does not take. What H100 `fp8linear tune` picked under CUDA graphs
        # (8 shapes x M 1..64): one tile of 16/32/64 rows covering M, 64 columns up to
        # M=8 and 32 above, 4 warps, 3-6 stages (18432x7168 M=64: 64x64 54 us where 16x64 with
        # 6 stages, one tile for every M, took 91 us).
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        return GemmConfig(block_m=block_m, block_n=64 if m <= 8 else 32, block_k=128, num_warps=4, num_stages=4)
    if m <= 256 or k <= 256:  # short K or few rows: more CTAs (64x128 best for K=256: 47.5 us)
        return GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    # prefill: 128x128, 8 warps (two consumer warpgroups), 4 stages: 871 TF/s at 4096x18432x7168
    return GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)


# AMD (gfx942) options per tile (block_m, block_n), at block_k=128 and num_stages=2:
# (num_warps, waves_per_eu, matrix_instr_nonkdim, kpack). Chosen from the `fp8linear amd-check`
# compile report of the tiled kernel with the specialization real launches get (16-byte aligned
# operands under 2 GiB: buffer loads; docs/amd.md): no VGPR/SGPR spill and no scratch for block,
# row and per-tensor scales, 16x16x32 FP8 MFMAs and kpack 1 (nonkdim 16 and kpack 1 in every entry
# of vLLM's MI300X tunings; kpack 2 compiles clean too and is left to `fp8linear tune`).
# waves_per_eu stays 0 (the compiler's choice): pinning it to the
# occupancy reached made 128x128 spill 9 VGPRs (waves_per_eu 4). Occupancy in waves per SIMD
# (block scales), LDS-bound where LDS is named. Compile-time facts; speed unmeasured on hardware.
AMD_TILE_OPTIONS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (16, 32): (4, 0, 16, 1),  # 64 VGPRs, occupancy 8
    (16, 64): (4, 0, 16, 1),  # 56 VGPRs, occupancy 6 (LDS)
    (32, 32): (4, 0, 16, 1),  # 54 VGPRs, occupancy 8
    (32, 64): (4, 0, 16, 1),  # 74 VGPRs, occupancy 5 (LDS)
    (64, 16): (4, 0, 16, 1),
    (64, 32): (4, 0, 16, 1),  # 76 VGPRs, occupancy 5 (LDS)
    (64, 64): (4, 0, 16, 1),  # 80 VGPRs, occupancy 4 (LDS)
    (64, 128): (4, 0, 16, 1),  # 124 VGPRs, occupancy 2 (LDS)
    (128, 64): (8, 0, 16, 1),  # 92 VGPRs, occupancy 4 (LDS)
    (128, 128): (8, 0, 16, 1),  # 124 VGPRs, occupancy 4 (4 warps: 256 VGPRs, occupancy 2)
}


def amd_gemm_config(block_m: int, block_n: int, group_m: int = 8) -> GemmConfig:
    """The AMD config of a tile (AMD_TILE_OPTIONS): block_k 128, 2 stages."""
    if (block_m, block_n) not in AMD_TILE_OPTIONS:
        raise ValueError(f"no AMD options for a {block_m}x{block_n} tile; known: {sorted(AMD_TILE_OPTIONS)}")
    warps, wpe, nonkdim, kpack = AMD_TILE_OPTIONS[block_m, block_n]
    return GemmConfig(block_m=block_m, block_n=block_n, block_k=GROUP_SIZE, group_m=group_m, num_warps=warps,
                      num_stages=2, waves_per_eu=wpe, matrix_instr_nonkdim=nonkdim, kpack=kpack)


# Rows up to which AMD decode-sized GEMMs use 32x32 tiles, and up to which 64x64.
AMD_DECODE_MAX_M = 128
AMD_MID_MAX_M = 1024
# Prefill tiles from largest to smallest: the first giving every CU a tile is used.
_AMD_PREFILL_TILES = ((64, 128), (64, 64), (64, 32), (32, 32))


def amd_heuristic_config(m: int, n: int, k: int, arch: str = "gfx942") -> GemmConfig:
    """A config for AMD Instinct GPUs without tuning; unmeasured on hardware (docs/amd.md).

    The tiles follow vLLM's MI300X block-FP8 tunings (files "N=..,K=..,device_name=
    AMD_Instinct_MI300X,dtype=fp8_w8a8,block_shape=[128,128].json" for N,K = 1536,7168; 576,7168;
    32768,512; 7168,16384; 7168,18432; 7168,2048: 4 warps and nonkdim 16 throughout; 32x32 tiles
    up to M=128-256; 64x64 for M=256-1536; 64x128, GROUP_SIZE_M 32, at M=2048-4096; small N
    64x32 or 64x64), a kernel of the same structure as ours (one scaled dot per 128-wide K group).
    Options per tile: AMD_TILE_OPTIONS. Decode (M <= 128): 32x32. Up to M=1024 or K <= 256:
    64x64. Above: the largest of 64x128, 64x64, 64x32, 32x32 that still gives every CU a tile.
    """
    if m <= AMD_DECODE_MAX_M:
        return amd_gemm_config(32, 32)
    if m <= AMD_MID_MAX_M or k <= 256:
        return amd_gemm_config(64, 64)
    cus = AMD_CU_COUNT.get(arch, _DEFAULT_CU_COUNT)
    for bm, bn in _AMD_PREFILL_TILES:
        if -(-m // bm) * -(-n // bn) >= cus:
            return amd_gemm_config(bm, bn, group_m=32)
    return amd_gemm_config(*_AMD_PREFILL_TILES[-1], group_m=32)


def amd_grouped_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """Grouped MoE GEMM tiles on AMD from the rows per expert, as grouped_config does on NVIDIA,
    with AMD options and 2 stages (NVIDIA's 128x128 / 4 stages needs 96 KiB of LDS; a CU has 64)."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:
        return amd_gemm_config(16, 64, group_m=1)
    if rows_per_expert <= 384:
        return amd_gemm_config(64, 128, group_m=4)
    return amd_gemm_config(128, 128, group_m=8)


def amd_splitk_options(block_m: int, block_n: int, num_warps: int) -> dict[str, int]:
    """AMD options of a split-K tile (its K step is the tiled kernel's at block_k 128): the tile's
    AMD_TILE_OPTIONS where its warp count matches, else nonkdim 16 alone."""
    warps, wpe, nonkdim, kpack = AMD_TILE_OPTIONS.get((block_m, block_n), (num_warps, 0, 16, 1))
    if warps != num_warps:
        wpe, kpack = 0, 1
    return {"waves_per_eu": wpe, "matrix_instr_nonkdim": nonkdim, "kpack": kpack}


def amd_launch_options(config: Any, arch: str = "gfx942") -> dict[str, int]:
    """AMD compiler options for launching `config` on `arch`: a GemmConfig's own, split-K tiles'
    from amd_splitk_options; kpack is 1 off gfx94x (Triton deprecates it on gfx950)."""
    if isinstance(config, GemmConfig):
        opts = config.amd_options()
    elif all(hasattr(config, a) for a in ("block_m", "block_n", "num_warps")):
        opts = amd_splitk_options(config.block_m, config.block_n, config.num_warps)
    else:
        return {}
    if not arch.startswith("gfx94"):
        opts["kpack"] = 1
    return opts


_DETECT = "detect"


def launch_options(config: Any, arch: str | None = _DETECT) -> dict[str, int]:
    """Extra launch keywords for a kernel launched with `config`: the AMD options on a ROCm device,
    {} on NVIDIA (Triton's CUDA backend rejects unknown options). `arch`: the AMD arch, or None for
    not AMD; by default the current device's (:func:`device_arch`)."""
    if arch == _DETECT:
        arch = device_arch()
    return {} if arch is None else amd_launch_options(config, arch)


def amd_grouped_config_here(num_pairs: int, num_experts: int) -> GemmConfig | None:
    """amd_grouped_config on a ROCm device, None elsewhere (grouped_config's NVIDIA rules apply)."""
    return None if device_arch() is None else amd_grouped_config(num_pairs, num_experts)


def splitk_num_stages(default: int, device: torch.device | None = None) -> int:
    """Pipeline depth of the split-K kernel: 2 on AMD (the stream pipeliner's usual depth; at 4,
    64x32 tiles take 36 KiB of LDS and one workgroup per SIMD), `default` elsewhere."""
    return default if device_arch(device) is None else 2


def moe_align_num_warps() -> int:
    """Warps of the one-program MoE alignment kernel: 8 on AMD (with 4 it spills 23 SGPRs on
    gfx942), 4 elsewhere."""
    return 4 if device_arch() is None else 8
