"""fp8linear for Hugging Face transformers: quantize in place, load and save FP8 checkpoints.

- :func:`quantize_model_` -- swap a loaded model's linear layers and fused MoE experts for FP8.
- :func:`from_pretrained` -- load an FP8 checkpoint folder (``fp8linear quantize`` output, our
  :func:`save_pretrained`, official DeepSeek-V3 FP8) offline, straight to FP8 on its devices.
- :class:`Fp8LinearConfig` -- ``AutoModelForCausalLM.from_pretrained(path,
  quantization_config=Fp8LinearConfig())`` quantizes a BF16 checkpoint while loading.
- :func:`save_pretrained` -- write a quantized model in the shared checkpoint format.

See docs/transformers.md.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from .hf_quantizer import QUANT_METHOD, Fp8LinearConfig, Fp8LinearHfQuantizer, register
from .loading import from_pretrained, index_checkpoint
from .replace import (
    DEFAULT_SKIP_PATTERNS,
    QuantizeReport,
    checkpoint_quantization_config,
    keep_experts_fused_on_save,
    quantize_model_,
)

__all__ = [
    "DEFAULT_SKIP_PATTERNS",
    "QUANT_METHOD",
    "Fp8LinearConfig",
    "Fp8LinearHfQuantizer",
    "QuantizeReport",
    "checkpoint_quantization_config",
    "from_pretrained",
    "index_checkpoint",
    "quantize_model_",
    "register",
    "save_pretrained",
]


def save_pretrained(model: nn.Module, path: str | os.PathLike, **kwargs: Any) -> None:
    """Save a model quantized by :func:`quantize_model_` / :class:`Fp8LinearConfig` in the checkpoint format.

    Same as ``model.save_pretrained(path, **kwargs)`` once the model carries the format's
    ``quantization_config`` (both quantization paths set it): FP8 ``weight`` +
    ``weight_scale_inv`` per linear layer, fused experts as ``P`` + ``P_scale_inv``.
    """
    config = getattr(model, "config", None)
    qcfg = getattr(config, "quantization_config", None)
    qdict = qcfg if isinstance(qcfg, dict) or qcfg is None else qcfg.to_dict()
    if not qdict or qdict.get("quant_method") != "fp8":
        raise ValueError(
            "model is not quantized by fp8linear (config.quantization_config.quant_method != 'fp8'); "
            "call quantize_model_(model) first"
        )
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    keep_experts_fused_on_save(model)
    model.save_pretrained(path, **kwargs)
