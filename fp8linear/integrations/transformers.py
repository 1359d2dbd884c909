"""fp8linear for Hugging Face transformers: quantize in place, load and save FP8 checkpoints.

- :func:`quantize_model_` -- swap a loaded model's linear layers and fused MoE experts for FP8.
- :func:`from_pretrained` -- load an FP8 checkpoint folder (``fp8linear quantize`` output, our
  :func:`save_pretrained`, official DeepSeek-V3 FP8) offline, straight to FP8 on its devices.
- :class:`Fp8LinearConfig` -- ``AutoModelForCausalLM.from_pretrained(path,
  quantization_config=Fp8LinearConfig())`` quantizes a BF16 checkpoint while loading.
- :func:`save_pretrained` -- write a quantized model in the shared checkpoint format (so does
  ``model.save_pretrained``: such models carry a quantizer whose save hook writes it).

See docs/transformers.md.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from torch import nn

from .hf_quantizer import (
    EXPERTS_LAYOUTS,
    QUANT_METHOD,
    Fp8LinearConfig,
    Fp8LinearHfQuantizer,
    attach_save_hook,
    fp8_state_dict,
    register,
)
from ..checkpoint_format import DEFAULT_SKIP_PATTERNS, checkpoint_quantization_config
from .loading import from_pretrained, index_checkpoint
from .replace import QuantizeReport
from .replace import quantize_model_ as _replace_modules_
from .save_hook import attach_save_hook_if_transformers

__all__ = [
    "DEFAULT_SKIP_PATTERNS",
    "EXPERTS_LAYOUTS",
    "QUANT_METHOD",
    "Fp8LinearConfig",
    "Fp8LinearHfQuantizer",
    "QuantizeReport",
    "attach_save_hook",
    "checkpoint_quantization_config",
    "fp8_state_dict",
    "from_pretrained",
    "index_checkpoint",
    "quantize_model_",
    "register",
    "save_pretrained",
]


@functools.wraps(_replace_modules_)
def quantize_model_(model: nn.Module, *args: Any, **kwargs: Any) -> QuantizeReport:
    report = _replace_modules_(model, *args, **kwargs)
    if kwargs.get("set_config", True) and report.num_replaced and getattr(model, "config", None) is not None:
        attach_save_hook_if_transformers(model)  # model.save_pretrained writes the checkpoint format
    return report


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, experts_layout: str = "auto", **kwargs: Any) -> None:
    """Save a model holding fp8linear modules in the checkpoint format (docs/transformers.md, "Saving").

    The same as ``model.save_pretrained(path, **kwargs)`` (which every quantized or loaded model
    routes through its :class:`Fp8LinearHfQuantizer`), with a choice of experts layout:

    - ``"auto"``: each FP8 experts module per expert (``experts.J.gate_proj.weight`` +
      ``.weight_scale_inv``, the official DeepSeek-V3 layout, with the architecture's names) when
      that layout holds its bytes and scales exactly, fused (``experts.gate_up_proj`` +
      ``_scale_inv``) otherwise;
    - ``"per_expert"``: per expert, or ValueError naming the experts it cannot hold exactly;
    - ``"fused"``: always fused.

    Raises ValueError before anything is written when the checkpoint could not be complete.
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
    if kwargs.get("safe_serialization", True) is not True:
        raise ValueError("only safetensors checkpoints are written (safe_serialization=True)")
    kwargs.pop("safe_serialization", None)
    if "state_dict" in kwargs:
        raise ValueError("state_dict cannot be given: the checkpoint is written from the model's fp8linear modules")
    previous = getattr(getattr(model, "hf_quantizer", None), "experts_layout", "auto")
    quantizer = attach_save_hook(model, experts_layout)
    try:
        quantizer.is_serializable()  # ValueError naming what cannot be written, before anything is
        model.save_pretrained(path, **kwargs)
    finally:
        quantizer.experts_layout = previous  # the choice is for this call; model.save_pretrained keeps its own
