"""The FP8 checkpoint format (DeepSeek-V3 / Hugging Face ``quant_method: "fp8"``): the one definition.

* a 2-D linear weight ``X.weight`` becomes ``X.weight`` (FP8) + ``X.weight_scale_inv`` (fp32);
* a fused 3-D expert parameter ``P`` ([E, out, in], e.g. ``mlp.experts.gate_up_proj``) becomes
  ``P`` (FP8, same shape) + ``P_scale_inv`` (fp32, one scale grid per expert);
* ``config.json`` gets ``quantization_config`` (see :func:`fp8_quantization_config`);
* what stays in high precision by default (:data:`DEFAULT_SKIP_PATTERNS`), for the offline
  converter (:mod:`fp8linear.quantize`) and for in-memory replacement
  (:func:`fp8linear.integrations.transformers.quantize_model_`) alike;
* file names inside a checkpoint folder never leave it (:func:`path_in_checkpoint`).

These functions work on names, shapes and dtypes only (no tensor data), so they can plan a
conversion from safetensors headers alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from types import MappingProxyType

import torch

from .formats import check_granularity, parse_fp8_dtype

__all__ = [
    "SCALE_SUFFIX",
    "LINEAR_SKIP_PATTERNS",
    "NOT_LINEAR_PATTERNS",
    "DEFAULT_SKIP_PATTERNS",
    "HIGH_PRECISION_DTYPES",
    "FP8_SAFETENSORS_DTYPES",
    "WEIGHT_BLOCK_SIZE",
    "FP8_QUANTIZATION_CONFIG",
    "scale_name",
    "weight_name_for_scale",
    "is_scale_name",
    "module_name",
    "default_should_quantize",
    "compile_patterns",
    "fp8_quantization_config",
    "checkpoint_quantization_config",
    "path_in_checkpoint",
    "granularity_from_config",
    "safetensors_dtype",
    "torch_dtype_from_safetensors",
    "IN_OUT_EXPERT_MODEL_TYPES",
    "fused_experts_are_in_out",
]

# transformers model types whose fused expert parameters are [E, in, out] (x @ W), not the
# [E, out, in] the FP8 format stores: their 3-D experts are left in high precision.
IN_OUT_EXPERT_MODEL_TYPES: tuple[str, ...] = ("aria", "gpt_oss", "llama4", "llama4_text", "openai_privacy_filter")

# Suffix of the dequant-scale tensor that sits next to each quantized weight (DeepSeek-V3 naming).
SCALE_SUFFIX = "_scale_inv"

# Linear layers kept in high precision by default, matched (re.search) against the module name
# (the tensor name without ``.weight``): the output head, MoE routers / gates (``mlp.gate``,
# ``router``, anything inside one, e.g. ``e_score_correction_bias``) and Qwen-MoE's 1-wide
# ``shared_expert_gate``.
LINEAR_SKIP_PATTERNS: tuple[str, ...] = (
    r"(^|\.)lm_head$",
    r"(^|\.)(gate|router)(\.|$)",
    r"(^|\.)shared_expert_gate$",
)
# Modules that are not linear layers, told apart by name where only tensor names are known (a
# checkpoint's headers): embeddings (``embed_tokens``, GPT-2's ``wte`` / ``wpe``) and norms.
NOT_LINEAR_PATTERNS: tuple[str, ...] = (
    r"(^|\.)[^.]*embed[^.]*($|\.)",
    r"(^|\.)(wte|wpe)$",
    r"(^|\.)[^.]*norm[^.]*$",
)
# Everything kept in high precision by default, by the checkpoint converter and by in-memory
# replacement alike.
DEFAULT_SKIP_PATTERNS: tuple[str, ...] = LINEAR_SKIP_PATTERNS + NOT_LINEAR_PATTERNS

# safetensors dtype strings of the floating formats that get quantized.
HIGH_PRECISION_DTYPES: tuple[str, ...] = ("BF16", "F16", "F32")

# safetensors dtype strings of the two FP8 weight formats.
FP8_SAFETENSORS_DTYPES: Mapping[torch.dtype, str] = MappingProxyType({
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
})

# safetensors dtype string -> torch dtype (read-only).
_SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
})

# `weight_block_size` of `quantization_config` for each granularity (HF "fp8" format).
WEIGHT_BLOCK_SIZE: Mapping[str, tuple[int, int] | None] = MappingProxyType(
    {"block": (128, 128), "row": (1, 128), "tensor": None}
)

# The fixed part of `quantization_config` (128x128 blocks, e4m3fn); see fp8_quantization_config.
FP8_QUANTIZATION_CONFIG: Mapping[str, object] = MappingProxyType({
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": (128, 128),
})


def scale_name(name: str) -> str:
    """Name of the scale tensor of weight `name`: ``X.weight`` -> ``X.weight_scale_inv``, ``P`` -> ``P_scale_inv``."""
    return name + SCALE_SUFFIX


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def weight_name_for_scale(name: str) -> str:
    """Inverse of :func:`scale_name`."""
    if not is_scale_name(name):
        raise ValueError(f"{name!r} is not a scale tensor name (no {SCALE_SUFFIX!r} suffix)")
    return name[: -len(SCALE_SUFFIX)]


def module_name(name: str) -> str:
    """Module path of a parameter: ``a.b.weight`` -> ``a.b``; a fused expert parameter keeps its name."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def compile_patterns(patterns: Iterable[str] | str | None, what: str = "pattern") -> tuple[re.Pattern[str], ...]:
    """Compile regexes; a single string counts as one pattern. TypeError for a non-string, ValueError
    (naming it) for a bad regex."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        patterns = (patterns,)
    compiled = []
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"{what} patterns must be strings (regexes), got {type(p).__name__}: {p!r}")
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ValueError(f"invalid {what} regex {p!r}: {exc}") from None
    return tuple(compiled)


_DEFAULT_SKIP = compile_patterns(DEFAULT_SKIP_PATTERNS)


def safetensors_dtype(dtype: torch.dtype | str) -> str:
    """safetensors' dtype string ('BF16', 'F8_E4M3', ...) of a torch dtype (strings pass through)."""
    if isinstance(dtype, str):
        return dtype
    for key, value in _SAFETENSORS_DTYPES.items():
        if value == dtype:
            return key
    raise ValueError(f"dtype {dtype} has no safetensors name")


def torch_dtype_from_safetensors(dtype: str) -> torch.dtype:
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {dtype!r}")
    return _SAFETENSORS_DTYPES[dtype]


def _is_fused_expert(name: str) -> bool:
    return "experts" in name.split(".") and not name.endswith("bias")


def default_should_quantize(
    name: str, shape: Sequence[int] | torch.Tensor, dtype: torch.dtype | str | None = None
) -> bool:
    """True if a tensor is a linear weight the FP8 format quantizes by default.

    Quantized: BF16/FP16/FP32 ``*.weight`` tensors of 2 dims (``nn.Linear``), and 3-D fused
    expert parameters ``...experts.P`` ([E, out, in]). Kept: embeddings, ``lm_head``, norms,
    biases, MoE routers (``mlp.gate``, ``e_score_correction_bias``), scales, anything else.
    `shape` may be a tensor, whose shape and dtype are then used.
    """
    if isinstance(shape, torch.Tensor):
        dtype = shape.dtype if dtype is None else dtype
        shape = tuple(shape.shape)
    if dtype is None:
        raise TypeError("default_should_quantize needs a dtype when given a shape")
    if safetensors_dtype(dtype) not in HIGH_PRECISION_DTYPES or is_scale_name(name):
        return False
    ndim = len(shape)
    if ndim == 2:
        if not name.endswith(".weight"):
            return False
    elif ndim == 3:
        if not _is_fused_expert(name):
            return False
    else:
        return False
    if any(d == 0 for d in shape):
        return False
    module = module_name(name)
    return not any(p.search(module) for p in _DEFAULT_SKIP)


def fp8_quantization_config(
    granularity: str = "block",
    fp8_dtype: torch.dtype | str = "e4m3fn",
    modules_to_not_convert: Iterable[str] = (),
) -> dict[str, object]:
    """The ``quantization_config`` written to config.json.

    ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
    [128, 128] | [1, 128] | None, "modules_to_not_convert": [...]}``, plus ``"fp8_dtype": "e4m3fnuz"``
    when the weights are fnuz (``fmt`` stays ``e4m3``).
    """
    check_granularity(granularity)
    cfg: dict[str, object] = dict(FP8_QUANTIZATION_CONFIG)
    block = WEIGHT_BLOCK_SIZE[granularity]
    cfg["weight_block_size"] = list(block) if block is not None else None
    cfg["modules_to_not_convert"] = sorted(set(modules_to_not_convert))
    if parse_fp8_dtype(fp8_dtype) == torch.float8_e4m3fnuz:
        cfg["fp8_dtype"] = "e4m3fnuz"
    return cfg


def checkpoint_quantization_config(
    granularity: str, modules_to_not_convert: Iterable[str] = (), fp8_dtype: torch.dtype | str = torch.float8_e4m3fn
) -> dict[str, object]:
    """:func:`fp8_quantization_config` with the argument order of :mod:`fp8linear.integrations.transformers`."""
    return fp8_quantization_config(granularity, fp8_dtype, modules_to_not_convert)


def granularity_from_config(qcfg: dict) -> str:
    """Granularity of a ``quantization_config`` from its ``weight_block_size``."""
    block = qcfg.get("weight_block_size")
    if block is None:
        return "tensor"
    for gran, size in WEIGHT_BLOCK_SIZE.items():
        if size is not None and list(block) == list(size):
            return gran
    raise ValueError(f"unsupported weight_block_size {block!r}; expected [128, 128], [1, 128] or null")


def fused_experts_are_in_out(config: dict | None) -> bool:
    """True if config.json's model (or its text model) stores fused experts as [E, in, out]."""
    if not config:
        return False
    types = {config.get("model_type")}
    text = config.get("text_config")
    if isinstance(text, dict):
        types.add(text.get("model_type"))
    return any(t in IN_OUT_EXPERT_MODEL_TYPES for t in types)


def path_in_checkpoint(root: Path, rel: str, what: str = "path", *, resolve_links: bool = False) -> Path:
    """``root / rel`` for a file name read from a checkpoint (an index's shard name, an output name).

    Refuses (ValueError) anything that could leave the folder: an empty or non-string name, a
    backslash or NUL, an absolute path, ``~`` or a ``..`` component. With `resolve_links` (the
    loader, which opens what it finds), the resolved path must also stay under the resolved
    `root`, so a symlink pointing out of the folder is refused too; the converter leaves links
    unresolved (Hugging Face's cache links snapshot files to its blob store).
    """
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        raise ValueError(f"{what}: {rel!r} is not a valid relative path")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or rel.startswith("~"):
        raise ValueError(f"{what}: {rel!r} points outside the checkpoint folder {root}; refusing to use it")
    path = root.joinpath(*p.parts)
    if resolve_links:
        path = path.resolve()
        if not path.is_relative_to(root.resolve()):
            raise ValueError(f"{what}: {rel!r} points outside the checkpoint folder {root}; refusing to read it")
    return path
