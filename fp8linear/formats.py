"""FP8 formats: which dtype a device uses, its largest value, and format conversion.

This is the one place that knows about ``float8_e4m3fn`` (NVIDIA, OCP) and
``float8_e4m3fnuz`` (AMD MI300X / gfx942).
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_DTYPES",
    "GROUP_SIZE",
    "SCALE_DTYPE",
    "fp8_max",
    "activation_max",
    "fp8_min_exponent",
    "default_fp8_dtype",
    "resolve_fp8_dtype",
    "is_fp8_dtype",
    "e4m3fn_to_e4m3fnuz",
    "parse_fp8_dtype",
    "GRANULARITIES",
    "check_granularity",
]

# Width of one quantization group along K (DeepSeek-V3 / HF `quant_method: "fp8"`).
GROUP_SIZE = 128
# Scales (dequant multipliers) are always stored in float32.
SCALE_DTYPE = torch.float32
# Weight scale granularities: one scale per 128x128 block, per 1x128 row group, or per tensor.
GRANULARITIES: tuple[str, ...] = ("block", "row", "tensor")


def check_granularity(granularity: object) -> str:
    """`granularity` if it is one of :data:`GRANULARITIES`, else a ValueError naming the choices."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}: granularity must be one of {GRANULARITIES}")
    return granularity

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

_FP8_MAX = {
    torch.float8_e4m3fn: 448.0,  # torch.finfo(torch.float8_e4m3fn).max
    torch.float8_e4m3fnuz: 240.0,  # torch.finfo(torch.float8_e4m3fnuz).max
}
# Dynamically quantized activations in fnuz clamp to 224, as vLLM/SGLang do on ROCm:
# the top binade of fnuz is coarse, and 224 measured better accuracy there.
_ACT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}

_NAMES = {
    "e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _check(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _FP8_MAX:
        raise TypeError(
            f"expected an FP8 dtype (torch.float8_e4m3fn or torch.float8_e4m3fnuz), got {dtype}"
        )
    return dtype


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 240 for e4m3fnuz)."""
    return _FP8_MAX[_check(dtype)]


def activation_max(dtype: torch.dtype) -> float:
    """Clamp value for dynamically quantized activations (448 for e4m3fn, 224 for e4m3fnuz)."""
    return _ACT_MAX[_check(dtype)]


def fp8_min_exponent(dtype: torch.dtype) -> int:
    """Exponent of the smallest normal value: 2**-6 for e4m3fn (bias 7), 2**-7 for e4m3fnuz (bias 8)."""
    return -6 if _check(dtype) == torch.float8_e4m3fn else -7


def parse_fp8_dtype(name: str | torch.dtype) -> torch.dtype:
    """Accept 'e4m3fn', 'e4m3fnuz', 'float8_e4m3fn', ... or a torch dtype."""
    if isinstance(name, torch.dtype):
        return _check(name)
    key = str(name).lower().removeprefix("torch.")
    if key not in _NAMES:
        raise ValueError(f"unknown FP8 dtype {name!r}; expected one of 'e4m3fn', 'e4m3fnuz'")
    return _NAMES[key]


def default_fp8_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The FP8 dtype a device computes in: e4m3fnuz on AMD gfx94x (MI300), else e4m3fn."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return torch.float8_e4m3fn
    if torch.version.hip is not None and torch.cuda.is_available():
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        arch = torch.cuda.get_device_properties(index).gcnArchName
        if arch.startswith("gfx94"):  # MI300X/MI325X: fnuz; gfx950 (MI355) uses OCP e4m3fn
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def resolve_fp8_dtype(fp8_dtype: torch.dtype | str | None, device: torch.device | str | None) -> torch.dtype:
    return default_fp8_dtype(device) if fp8_dtype is None else parse_fp8_dtype(fp8_dtype)


def e4m3fn_to_e4m3fnuz(weight: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert an e4m3fn weight and its dequant scales to e4m3fnuz without a round trip.

    The same bit pattern is worth half as much in fnuz (exponent bias 8, not 7), so the
    scales double. Byte 0x80 is -0.0 in e4m3fn but NaN in fnuz, so it becomes 0x00.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected a torch.float8_e4m3fn weight, got {weight.dtype}")
    if scale_inv.dtype != SCALE_DTYPE:
        raise TypeError(f"expected float32 scales, got {scale_inv.dtype}")
    bits = weight.view(torch.int8).clone()
    bits[bits == -128] = 0  # 0x80 as int8
    return bits.view(torch.float8_e4m3fnuz), scale_inv * 2.0
