"""fp8linear as a transformers quantization method (``quant_method: "fp8linear"``).

``AutoModelForCausalLM.from_pretrained(bf16_path, quantization_config=Fp8LinearConfig())``
builds the model on the meta device with fp8linear modules in place of its linear layers and
fused experts, and quantizes each weight as transformers streams it from the checkpoint onto
its device (peak memory about the FP8 size plus one high-precision tensor). The loaded model's
``config.quantization_config`` is the checkpoint format's ``quant_method: "fp8"`` dict, so
``model.save_pretrained`` writes what ``fp8linear quantize`` writes; reload it with
:func:`fp8linear.integrations.transformers.from_pretrained`.

Saving: every model holding fp8linear modules (quantized by :func:`quantize_model_`, by this
quantizer, or loaded by :func:`from_pretrained`) carries an :class:`Fp8LinearHfQuantizer` as
``model.hf_quantizer``, so transformers' own ``model.save_pretrained`` asks it for the state dict
(``get_state_dict_and_metadata``): FP8 weights with their scales, MoE experts per expert
(official DeepSeek-V3 layout) where that layout holds them exactly, fused otherwise. Anything
that cannot be written raises ValueError before a file is written.

Works with transformers 5.x (the ``HfQuantizer`` hooks used here -- ``param_needs_quantization``,
``get_quantize_ops`` and the ``ConversionOps.convert`` signature -- are the same in 5.17 and 5.23;
the save hooks ``is_serializable`` and ``get_state_dict_and_metadata`` are tested with 5.24). Under
``tp_plan="auto"`` transformers 5.24 hands the quantizer its TP plan (``update_parallel_plan``); 5.17
has no such hook, and the quantizer marks and checks the planned modules before loading instead.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checkpoint_format import SCALE_SUFFIX, checkpoint_quantization_config
from ..formats import check_granularity, is_fp8_dtype, parse_fp8_dtype, resolve_fp8_dtype
from ..functional import quantize_weight
from ..module import Fp8BlockLinear
from ..norm import fuse_rms_norms_
from .replace import experts_api, keep_experts_fused_on_save, quantize_model_

from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

__all__ = [
    "EXPERTS_LAYOUTS",
    "QUANT_METHOD",
    "Fp8LinearConfig",
    "Fp8LinearHfQuantizer",
    "Fp8QuantizeOp",
    "attach_save_hook",
    "fp8_state_dict",
    "plan_experts_layout",
    "register",
]

# Our name in transformers' quantizer registry (distinct from transformers' own "fp8").
QUANT_METHOD = "fp8linear"

# How FP8 experts are written: per expert where exact else fused ("auto"), always per expert
# (ValueError naming the modules it cannot hold), or always fused (P + P_scale_inv).
EXPERTS_LAYOUTS = ("auto", "per_expert", "fused")


@dataclass
class Fp8LinearConfig(QuantizationConfigMixin):
    """Quantize a model to FP8 with fp8linear while transformers loads it.

    Args:
        granularity: ``"block"`` (128x128, DeepSeek-V3), ``"row"`` (1x128) or ``"tensor"``.
        fp8_dtype: ``"e4m3fn"`` / ``"e4m3fnuz"``; ``None`` picks the device's (fnuz on MI300).
        ignore: regexes of module names to keep in high precision (on top of the output head
            and MoE routers, which are always kept).
        backend: force ``"triton"`` or ``"reference"`` in the FP8 modules; ``None`` = auto.
        fuse_norms: after loading, swap the RMSNorm modules for one-launch
            :class:`fp8linear.norm.FusedRMSNorm` (same weights and formula; see ``quantize_model_``).
    """

    granularity: str = "block"
    fp8_dtype: str | None = None
    ignore: list[str] = field(default_factory=list)
    backend: str | None = None
    fuse_norms: bool = True
    quant_method: str = QUANT_METHOD

    def __post_init__(self) -> None:
        check_granularity(self.granularity)
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
        if not isinstance(self.fuse_norms, bool):
            raise TypeError(f"fuse_norms must be a bool, got {type(self.fuse_norms).__name__}")
        if self.quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r}, got {self.quant_method!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": self.quant_method,
            "granularity": self.granularity,
            "fp8_dtype": self.fp8_dtype,
            "ignore": list(self.ignore),
            "backend": self.backend,
            "fuse_norms": self.fuse_norms,
        }


# transformers 5.24 hands a quantizer the model's TP plan (`update_parallel_plan`); 5.17 has only a
# config hook, and its TP styles read `_hf_quantized_needs_local_tp` from the modules when they run.
_HAS_PARALLEL_PLAN_HOOK = hasattr(HfQuantizer, "update_parallel_plan")


def _requested_tp_size(model: Any) -> int:
    """The tensor-parallel size from_pretrained was asked for: transformers 5.17 sets
    ``config.distributed_config`` before it builds the model (1 where it has none)."""
    return getattr(getattr(model.config, "distributed_config", None), "tp_size", None) or 1


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
        self.experts_layout = "auto"  # how save writes FP8 experts (EXPERTS_LAYOUTS)
        self._model_ref: weakref.ref | None = None  # the model this quantizer saves (is_serializable checks it)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_model_ref"] = None  # weak references do not pickle; set again when the model saves
        return state

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
        tp = _requested_tp_size(model)
        if not _HAS_PARALLEL_PLAN_HOOK and tp > 1:
            # transformers without update_parallel_plan (5.17) shards the model next: mark the modules
            # to run its styles on local tensors and check them (per-tensor scales refused, 128
            # boundaries) before any weight is read, as update_parallel_plan does on newer versions.
            from .tensor_parallel import extend_hf_tp_plan

            extend_hf_tp_plan(model, dict(model.tp_plan), tp)
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
        self._model_ref = weakref.ref(model)
        for module in model.modules():
            if isinstance(module, Fp8BlockLinear):
                module.init_split_k_counters()  # on the device its weight was loaded to
        if self.quantization_config.fuse_norms:
            fuse_rms_norms_(model)
        return model

    def update_parallel_plan(self, model: Any, plan: dict[str, str]) -> None:
        # tp_plan="auto": scales follow their weights, modules run transformers' styles on local tensors.
        super().update_parallel_plan(model, plan)
        from .tensor_parallel import extend_hf_tp_plan

        extend_hf_tp_plan(model, plan)

    # -- saving (transformers' save_pretrained calls these two before it writes anything) -------
    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None and getattr(model, "hf_quantizer", None) is self:
            _check_savable(model, self.experts_layout)  # ValueError before save_pretrained creates the folder
        return True

    def get_state_dict_and_metadata(self, model: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The state dict transformers writes: FP8 weights + scales, experts in ``self.experts_layout``."""
        self._model_ref = weakref.ref(model)
        state = fp8_state_dict(model, self.experts_layout)
        _ensure_checkpoint_config(model)
        # transformers reverts the model's weight conversions after this hook: keep the key
        # renamings only, the experts' layout is already the one to write.
        keep_experts_fused_on_save(model)
        return state, {}

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


# ----------------------------------------------------------------------------- saving
def _fp8_modules(model: nn.Module) -> tuple[dict[str, Fp8BlockLinear], dict[str, nn.Module]]:
    try:
        fp8_experts_cls = experts_api()[0]
    except ImportError:
        fp8_experts_cls = None
    linears, experts = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8BlockLinear):
            linears[name] = module
        elif fp8_experts_cls is not None and isinstance(module, fp8_experts_cls):
            experts[name] = module
    return linears, experts


def _per_expert_names(model: nn.Module, module_name: str, conversions: list[Any] | None = None) -> tuple[str, str, str] | None:
    """(gate, up, down) per-expert names that transformers fuses into ``module_name``'s experts, if any.

    Read from the model's conversion mapping: a converter merging ``experts.*.G.weight`` and
    ``experts.*.U.weight`` into ``experts.gate_up_proj`` (MergeModulelist(0), Concatenate(1)) and
    one merging ``experts.*.D.weight`` into ``experts.down_proj`` (MergeModulelist(0)). None when
    the architecture has no such merge (its checkpoints store the experts fused).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:
        return None
    pat = re.compile(r"experts\.\*\.(\w+)\.weight$")
    gate_up = down = None
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    for conv in conversions:
        if not isinstance(conv, WeightConverter):
            continue
        sources, targets = list(conv._original_source_patterns), list(conv._original_target_patterns)
        if len(targets) != 1 or not all(pat.search(src) for src in sources):
            continue
        target = targets[0]
        ops = list(conv.operations)
        merge_first = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        if target.endswith("experts.gate_up_proj") and f".{module_name}.gate_up_proj".endswith("." + target.lstrip(".")) and (
            len(sources) == 2 and len(ops) == 2 and merge_first
            and isinstance(ops[1], Concatenate) and ops[1].dim == 1
        ):
            gate_up = tuple(pat.search(src).group(1) for src in sources)
        elif target.endswith("experts.down_proj") and f".{module_name}.down_proj".endswith("." + target.lstrip(".")) and (
            len(sources) == 1 and len(ops) == 1 and merge_first
        ):
            down = pat.search(sources[0]).group(1)
    if gate_up is None or down is None:
        return None
    return (gate_up[0], gate_up[1], down)


def plan_experts_layout(model: nn.Module, experts_layout: str = "auto") -> tuple[dict[str, tuple[str, str, str] | None], list[str]]:
    """For each FP8 experts module: per-expert names (gate, up, down) to write it per expert, or None (fused).

    Returns ``(plan, problems)``; `problems` names the tensors that `experts_layout="per_expert"`
    cannot write exactly (empty for "auto" and "fused").
    """
    if experts_layout not in EXPERTS_LAYOUTS:
        raise ValueError(f"experts_layout must be one of {EXPERTS_LAYOUTS}, got {experts_layout!r}")
    plan: dict[str, tuple[str, str, str] | None] = {}
    problems: list[str] = []
    conversions: list[Any] | None = None
    for name, module in _fp8_modules(model)[1].items():
        if experts_layout == "fused":
            plan[name] = None
            continue
        if conversions is None:
            try:
                from transformers.conversion_mapping import get_model_conversion_mapping

                conversions = get_model_conversion_mapping(model, add_legacy=False)
            except ImportError:
                conversions = []
        names = _per_expert_names(model, name, conversions)
        problem = module.per_expert_layout_problem()
        if names is None and problem is None:
            problem = f"the {type(model).__name__} architecture stores its experts fused (no per-expert names)"
        if problem is None:
            plan[name] = names
        else:
            plan[name] = None
            if experts_layout == "per_expert":
                problems.append(f"{name}.{module.up_name} ({problem})")
    return plan, problems


def _check_savable(model: nn.Module, experts_layout: str) -> dict[str, tuple[str, str, str] | None]:
    """ValueError naming every tensor that cannot be written completely; the experts plan otherwise."""
    plan, problems = plan_experts_layout(model, experts_layout)
    linears, experts = _fp8_modules(model)
    for prefix, module in list(linears.items()) + list(experts.items()):
        for attr, t in module._parameters.items():
            if t is None:
                continue
            full = f"{prefix}.{attr}" if prefix else attr
            if t.device.type == "meta":
                problems.append(f"{full} (on the meta device: not loaded, or offloaded)")
            elif not attr.endswith(SCALE_SUFFIX) and is_fp8_dtype(t.dtype) and module._parameters.get(attr + SCALE_SUFFIX) is None:
                problems.append(f"{full} (FP8 without {attr}{SCALE_SUFFIX})")
    owned = {id(t) for m in list(linears.values()) + list(experts.values()) for t in m.parameters(recurse=False)}
    for full, t in model.named_parameters(remove_duplicate=False):
        if is_fp8_dtype(t.dtype) and id(t) not in owned:
            problems.append(f"{full} (FP8 outside an fp8linear module: no scale to write with it)")
    for full, t in model.named_buffers(remove_duplicate=False):
        if is_fp8_dtype(t.dtype):
            problems.append(f"{full} (FP8 buffer outside an fp8linear module: no scale to write with it)")
    if problems:
        more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValueError(
            f"cannot save a complete FP8 checkpoint; nothing was written. {len(problems)} tensors cannot be written: "
            f"{'; '.join(problems[:8])}{more}"
            + ("; save with experts_layout='fused' (or 'auto') to write those experts fused"
               if experts_layout == "per_expert" else "")
        )
    return plan


def fp8_state_dict(model: nn.Module, experts_layout: str = "auto") -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as the checkpoint format writes it (model-side names, before renamings).

    FP8 linear layers: ``X.weight`` + ``X.weight_scale_inv``. FP8 experts: per expert
    (``E.J.gate_proj.weight`` + ``.weight_scale_inv``, ... with the architecture's names) where
    :func:`plan_experts_layout` says so, else fused (``E.gate_up_proj`` + ``E.gate_up_proj_scale_inv``).
    Tensors are views of the model's (no copy). ValueError naming the tensors when the state
    cannot be written completely.
    """
    plan = _check_savable(model, experts_layout)
    state = model.state_dict()
    experts = _fp8_modules(model)[1]
    for name, names in plan.items():
        if names is None:
            continue
        module = experts[name]
        for attr in ("gate_up_proj", "down_proj"):
            for key in (f"{name}.{attr}", f"{name}.{attr}{SCALE_SUFFIX}"):
                if state.pop(key, None) is None:
                    raise ValueError(f"{key} is not in the model's state_dict; cannot write experts {name}")
        for key, t in module.per_expert_state(names).items():
            state[f"{name}.{key}"] = t
    return state


def _ensure_checkpoint_config(model: nn.Module) -> None:
    """Give ``model.config`` the checkpoint format's ``quantization_config`` when it has none."""
    config = getattr(model, "config", None)
    if config is None:
        return
    qcfg = getattr(config, "quantization_config", None)
    qdict = qcfg if isinstance(qcfg, dict) or qcfg is None else qcfg.to_dict()
    if qdict and qdict.get("quant_method") == "fp8":
        return
    if qdict and qdict.get("quant_method") not in (None, QUANT_METHOD):
        raise ValueError(
            f"model.config.quantization_config has quant_method {qdict.get('quant_method')!r}, but the model holds "
            "fp8linear modules (checkpoint format quant_method 'fp8'); refusing to write a mislabelled checkpoint"
        )
    gran, fp8 = _model_granularity(model)
    if gran is not None:
        config.quantization_config = checkpoint_quantization_config(gran, [], fp8)


def _model_granularity(model: nn.Module) -> tuple[str | None, torch.dtype | None]:
    """(granularity, FP8 dtype) of the model's fp8linear modules: row > block > tensor, since a
    grid of one 128x128 block per weight reads as per-tensor on small weights."""
    linears, experts = _fp8_modules(model)
    modules = list(linears.values()) + list(experts.values())
    if not modules:
        return None, None
    found = {m.granularity for m in modules} | {m._up_granularity() for m in experts.values()}
    gran = next(g for g in ("row", "block", "tensor") if g in found)
    return gran, modules[0].fp8_dtype


def attach_save_hook(model: nn.Module, experts_layout: str = "auto") -> "Fp8LinearHfQuantizer":
    """Make ``model.save_pretrained`` write `model`'s fp8linear modules in the checkpoint format.

    Sets ``model.hf_quantizer`` to an :class:`Fp8LinearHfQuantizer` (keeping one already there)
    whose save hooks transformers calls; returns it.
    """
    if experts_layout not in EXPERTS_LAYOUTS:
        raise ValueError(f"experts_layout must be one of {EXPERTS_LAYOUTS}, got {experts_layout!r}")
    quantizer = getattr(model, "hf_quantizer", None)
    if not isinstance(quantizer, Fp8LinearHfQuantizer):
        gran, fp8_dtype = _model_granularity(model)
        fp8 = str(fp8_dtype).removeprefix("torch.float8_") if fp8_dtype is not None else None
        quantizer = Fp8LinearHfQuantizer(Fp8LinearConfig(granularity=gran or "block", fp8_dtype=fp8), pre_quantized=True)
        model.hf_quantizer = quantizer
    quantizer.experts_layout = experts_layout
    quantizer._model_ref = weakref.ref(model)
    keep_experts_fused_on_save(model)
    return quantizer


def register() -> None:
    """Register ``quant_method: "fp8linear"`` with transformers (idempotent)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not Fp8LinearConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(Fp8LinearConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not Fp8LinearHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(Fp8LinearHfQuantizer)


register()
