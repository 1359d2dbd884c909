"""fp8linear as a transformers quantization method (``quant_method: "fp8linear"``).

``AutoModelForCausalLM.from_pretrained(bf16_path, quantization_config=Fp8LinearConfig())``
builds the model on the meta device with fp8linear modules in place of its linear layers and
fused experts, and quantizes each weight as transformers streams it from the checkpoint onto
its device (peak memory about the FP8 size plus one high-precision tensor). The loaded model's
``config.quantization_config`` is the checkpoint format's ``quant_method: "fp8"`` dict, so
``model.save_pretrained`` writes what ``fp8linear quantize`` writes; reload it with
:func:`fp8linear.integrations.transformers.from_pretrained`.

Works with transformers 5.x (the ``HfQuantizer`` hooks used here -- ``param_needs_quantization``,
``get_quantize_ops`` and the ``ConversionOps.convert`` signature -- are the same in 5.17 and 5.23).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..formats import is_fp8_dtype, parse_fp8_dtype, resolve_fp8_dtype
from ..functional import quantize_weight
from ..module import Fp8BlockLinear
from ..reference import GRANULARITIES
from .replace import checkpoint_quantization_config, experts_api, keep_experts_fused_on_save, quantize_model_
from ..quantize.naming import SCALE_SUFFIX

from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

__all__ = ["QUANT_METHOD", "Fp8LinearConfig", "Fp8LinearHfQuantizer", "Fp8QuantizeOp", "register"]

# Our name in transformers' quantizer registry (distinct from transformers' own "fp8").
QUANT_METHOD = "fp8linear"


@dataclass
class Fp8LinearConfig(QuantizationConfigMixin):
    """Quantize a model to FP8 with fp8linear while transformers loads it.

    Args:
        granularity: ``"block"`` (128x128, DeepSeek-V3), ``"row"`` (1x128) or ``"tensor"``.
        fp8_dtype: ``"e4m3fn"`` / ``"e4m3fnuz"``; ``None`` picks the device's (fnuz on MI300).
        ignore: regexes of module names to keep in high precision (on top of the output head
            and MoE routers, which are always kept).
        backend: force ``"triton"`` or ``"reference"`` in the FP8 modules; ``None`` = auto.
    """

    granularity: str = "block"
    fp8_dtype: str | None = None
    ignore: list[str] = field(default_factory=list)
    backend: str | None = None
    quant_method: str = QUANT_METHOD

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if isinstance(self.fp8_dtype, torch.dtype):
            self.fp8_dtype = str(self.fp8_dtype).removeprefix("torch.float8_")
        if self.fp8_dtype is not None:
            parse_fp8_dtype(self.fp8_dtype)  # ValueError/TypeError on unknown names
        if isinstance(self.ignore, str):
            self.ignore = [self.ignore]
        if not all(isinstance(p, str) for p in self.ignore):
            raise TypeError(f"ignore must be a list of regex strings, got {self.ignore!r}")
        self.ignore = list(self.ignore)
        if self.backend not in (None, "auto", "triton", "reference"):
            raise ValueError(f"backend must be None, 'auto', 'triton' or 'reference', got {self.backend!r}")
        if self.quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r}, got {self.quant_method!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "granularity": self.granularity,
            "fp8_dtype": self.fp8_dtype,
            "ignore": list(self.ignore),
            "backend": self.backend,
        }


class Fp8QuantizeOp(ConversionOps):
    """transformers weight-conversion op: one high-precision tensor -> FP8 tensor + ``_scale_inv``."""

    def __init__(self, granularity: str, fp8_dtype: torch.dtype) -> None:
        self.granularity = granularity
        self.fp8_dtype = fp8_dtype

    def convert(self, input_dict: dict[str, Any], source_patterns: Any = None, target_patterns: Any = None, **kwargs: Any):
        out: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            q, s = quantize_weight(tensor, self.granularity, self.fp8_dtype)
            out[key] = q
            out[key + SCALE_SUFFIX] = s
        return out


class Fp8LinearHfQuantizer(HfQuantizer):
    """Quantizes BF16/FP16/FP32 checkpoints to fp8linear modules while transformers loads them."""

    requires_calibration = False
    quantization_config: Fp8LinearConfig

    def __init__(self, quantization_config: Fp8LinearConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._fp8_dtype: torch.dtype | None = None
        self._kept: list[str] = []

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        if self.pre_quantized:
            raise ValueError(
                "Fp8LinearConfig quantizes a high-precision checkpoint while loading; this checkpoint is already "
                "quantized. Load FP8 checkpoints with fp8linear.integrations.transformers.from_pretrained(path)."
            )

    def _fp8(self) -> torch.dtype:
        if self._fp8_dtype is None:
            fp8 = self.quantization_config.fp8_dtype
            device = "cuda" if torch.cuda.is_available() else None
            self._fp8_dtype = resolve_fp8_dtype(fp8, device)
        return self._fp8_dtype

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        cfg = self.quantization_config
        high = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
        report = quantize_model_(
            model, granularity=cfg.granularity, ignore=cfg.ignore, fp8_dtype=self._fp8(),
            backend=cfg.backend, set_config=False,
        )
        self._kept = report.kept
        # The weights to quantize get high-precision placeholders: transformers 5.17 casts each
        # checkpoint tensor to its placeholder's dtype before the quantize op (5.23 does not).
        for name in self._weights_to_quantize(model):
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            shape = module._parameters[attr].shape
            module._parameters[attr] = nn.Parameter(torch.empty(shape, dtype=high, device="meta"), requires_grad=False)
        return model

    def _weights_to_quantize(self, model: Any) -> list[str]:
        try:
            fp8_experts_cls = experts_api()[0]
        except ImportError:
            fp8_experts_cls = None
        names = []
        for name, module in model.named_modules():
            if isinstance(module, Fp8BlockLinear):
                names.append(f"{name}.weight")
            elif fp8_experts_cls is not None and isinstance(module, fp8_experts_cls):
                names += [f"{name}.{module.up_name}", f"{name}.down_proj"]
        return names

    def param_needs_quantization(self, model: Any, param_name: str, **kwargs: Any) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        if isinstance(module, Fp8BlockLinear):
            return tensor_name == "weight"
        try:
            fp8_experts_cls, _ = experts_api()
        except ImportError:
            return False
        return isinstance(module, fp8_experts_cls) and tensor_name in ("gate_up_proj", "up_proj", "down_proj")

    def get_quantize_ops(self) -> Fp8QuantizeOp:
        return Fp8QuantizeOp(self.quantization_config.granularity, self._fp8())

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        not_quantized = []
        for name in self._weights_to_quantize(model):
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            param = module._parameters[attr]
            if not is_fp8_dtype(param.dtype):
                not_quantized.append(name)
            else:
                param.requires_grad_(False)
                module._parameters[attr + SCALE_SUFFIX].requires_grad_(False)
        if not_quantized:
            raise ValueError(
                f"{len(not_quantized)} weights were not quantized while loading (missing from the checkpoint?): "
                f"{', '.join(not_quantized[:5])}"
            )
        # Saved models carry the shared checkpoint format's config (quant_method "fp8"), not ours.
        model.config.quantization_config = checkpoint_quantization_config(
            self.quantization_config.granularity, self._kept, self._fp8()
        )
        keep_experts_fused_on_save(model)
        for module in model.modules():
            if isinstance(module, Fp8BlockLinear):
                module.init_workspace()  # on the device its weight was loaded to
        return model

    def update_parallel_plan(self, model: Any, plan: dict[str, str]) -> None:
        # tp_plan="auto": scales follow their weights, modules run transformers' styles on local tensors.
        super().update_parallel_plan(model, plan)
        from .tensor_parallel import extend_hf_tp_plan

        extend_hf_tp_plan(model, plan)

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def quantized_element_size(self) -> float:
        # Bytes per element of a quantized weight (transformers 5.23 sizes its memory warm-up with it).
        return 1

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Register ``quant_method: "fp8linear"`` with transformers (idempotent)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not Fp8LinearConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(Fp8LinearConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not Fp8LinearHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(Fp8LinearHfQuantizer)


register()
