"""Launch configurations of the FP8 kernels: the dataclasses a route carries, and what turns them into
launch keywords on the running platform.

:class:`GemmConfig` (tiled and grouped kernels), :class:`SplitKConfig` (split-K and one-launch decode)
and :class:`GemvConfig` (fused GEMV) are plain values; which one runs a call, and with which fields,
is decided in :mod:`fp8linear.ops.router` alone. AMD Instinct GPUs (ROCm builds of torch, arch
names ``gfx9xx``) take configs carrying their compiler options (``waves_per_eu``,
``matrix_instr_nonkdim``, ``kpack``, :data:`AMD_TILE_OPTIONS` per tile); :func:`launch_options`
gives them as launch keywords there, and none on NVIDIA, where Triton rejects them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..formats import GROUP_SIZE

__all__ = [
    "AMD_OPTION_FIELDS",
    "AMD_CU_COUNT",
    "AMD_TILE_OPTIONS",
    "DEFAULT_CU_COUNT",
    "GemmConfig",
    "GemvConfig",
    "SplitKConfig",
    "amd_gemm_config",
    "amd_splitk_options",
    "sm_count",
    "is_amd_arch",
    "hip_arch",
    "device_arch",
    "amd_launch_options",
    "launch_options",
]

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


@dataclass(frozen=True)
class SplitKConfig:
    """Launch configuration of the split-K kernel; ``split_k`` programs share each output tile."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v > GROUP_SIZE or v & (v - 1):
                raise ValueError(f"SplitKConfig.{name} must be a power of two in [16, {GROUP_SIZE}], got {v}")
        if self.split_k < 1:
            raise ValueError(f"SplitKConfig.split_k must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"SplitKConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"SplitKConfig.num_stages must be >= 1, got {self.num_stages}")


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of the fused GEMV: BLOCK_N output columns per program, GROUPS_PER_STEP
    128-wide K groups per step."""

    block_n: int
    groups_per_step: int = 4
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, hi in (("block_n", GROUP_SIZE), ("groups_per_step", 8)):
            v = getattr(self, name)
            if v < 1 or v > hi or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two in [1, {hi}], got {v}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"GemvConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")


@lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (4 for the CPU interpreter)."""
    if device.type != "cuda":
        return 4  # the CPU interpreter: a small "GPU" so that tests exercise the split
    return torch.cuda.get_device_properties(device).multi_processor_count


# Field names of the AMD compiler options (HIPOptions) a config may carry.
AMD_OPTION_FIELDS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# Compute units per arch, for tile-count decisions when no device is at hand (MI300X / MI325X
# have 304 CUs; MI355X, gfx950, 256).
AMD_CU_COUNT = {"gfx942": 304, "gfx950": 256}
DEFAULT_CU_COUNT = 304


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
