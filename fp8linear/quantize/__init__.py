"""Offline checkpoint tool: stream a safetensors checkpoint to FP8 (and back), and inspect one.

Command line: ``fp8linear quantize|dequantize|inspect`` (or ``python -m fp8linear.quantize``
for ``quantize``). Python API::

    from fp8linear.quantize import quantize_checkpoint, dequantize_checkpoint, inspect_checkpoint
    quantize_checkpoint("Llama-3-8B", "Llama-3-8B-FP8", granularity="block")

The output is the DeepSeek-V3 / Hugging Face ``quant_method: "fp8"`` format, defined in
:mod:`fp8linear.checkpoint_format`; its naming rules and ``quantization_config`` writer are
re-exported here (:func:`default_should_quantize`, :func:`scale_name`,
:func:`fp8_quantization_config`). This package never imports transformers (lint-imports checks it).
"""

from .checkpoint import Checkpoint, CheckpointError, TensorInfo, open_checkpoint
from .convert import (
    ConversionSummary,
    DequantizeOptions,
    QuantizeOptions,
    dequantize_checkpoint,
    quantize_checkpoint,
)
from .inspection import CheckpointReport, LayerError, inspect_checkpoint, quantization_error
from ..checkpoint_format import (
    DEFAULT_SKIP_PATTERNS,
    FP8_QUANTIZATION_CONFIG,
    SCALE_SUFFIX,
    WEIGHT_BLOCK_SIZE,
    default_should_quantize,
    fp8_quantization_config,
    granularity_from_config,
    is_scale_name,
    module_name,
    scale_name,
    weight_name_for_scale,
)

__all__ = [
    "quantize_checkpoint",
    "dequantize_checkpoint",
    "inspect_checkpoint",
    "quantization_error",
    "QuantizeOptions",
    "DequantizeOptions",
    "ConversionSummary",
    "CheckpointReport",
    "LayerError",
    "Checkpoint",
    "CheckpointError",
    "TensorInfo",
    "open_checkpoint",
    "default_should_quantize",
    "fp8_quantization_config",
    "granularity_from_config",
    "scale_name",
    "weight_name_for_scale",
    "is_scale_name",
    "module_name",
    "DEFAULT_SKIP_PATTERNS",
    "FP8_QUANTIZATION_CONFIG",
    "SCALE_SUFFIX",
    "WEIGHT_BLOCK_SIZE",
]
