"""Swap a model's linear layers and fused MoE experts for FP8 modules, generically.

One walk over ``model.named_modules()``; no per-architecture code. What is replaced:

- every ``nn.Linear`` -> :class:`fp8linear.Fp8BlockLinear`, except the output head
  (``lm_head`` / ``model.get_output_embeddings()``), MoE routers and gates (a module named
  ``gate`` or ``router``, anything inside one, ``shared_expert_gate``), modules named like
  embeddings or norms (the skip list the checkpoint converter uses,
  :data:`fp8linear.checkpoint_format.DEFAULT_SKIP_PATTERNS`) and names matching an ``ignore`` regex;
- every fused experts module (3-D ``gate_up_proj`` / ``down_proj`` parameters, as transformers
  5.x stores MoE experts) -> :class:`fp8linear.integrations.experts.Fp8Experts`.

Works on materialised models (weights are quantized on their own device) and on models
built on the meta device (empty FP8 modules of the right shapes are created, to be filled
by a loader).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..checkpoint_format import DEFAULT_SKIP_PATTERNS, checkpoint_quantization_config, compile_patterns
from ..formats import check_granularity, is_fp8_dtype, resolve_fp8_dtype
from ..gptq import GPTQConfig
from ..module import Fp8BlockLinear, share_input_quantization
from ..norm import fuse_rms_norms_
from .calibration import check_calibration_data, gptq_replace_linears_, set_submodule

__all__ = [
    "QuantizeReport",
    "quantize_model_",
    "module_state_bytes",
    "experts_api",
    "keep_experts_fused_on_save",
]

def experts_api() -> tuple[type[nn.Module], Callable[[nn.Module], bool]]:
    """(Fp8Experts, is_fused_experts_module) from the experts module (imported lazily)."""
    from .experts import Fp8Experts, is_fused_experts_module

    return Fp8Experts, is_fused_experts_module


def module_state_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers (meta tensors count at their dtype's size)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


@dataclass
class QuantizeReport:
    """What :func:`quantize_model_` did.

    ``replaced`` counts replaced modules by kind (the original class name), ``kept`` lists
    the linear / experts modules left in high precision, bytes are over all parameters and
    buffers of the model (before and after), ``quantized_bytes_*`` only over replaced modules.
    """

    granularity: str
    fp8_dtype: torch.dtype
    replaced: dict[str, int] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    quantized_bytes_before: int = 0
    quantized_bytes_after: int = 0
    gptq_layers: int = 0  # linear layers rounded with GPTQ (calibration_data given)
    fused_norms: int = 0  # RMSNorm modules swapped for one-launch FusedRMSNorm (fuse_norms)

    def __post_init__(self) -> None:
        check_granularity(self.granularity)
        if not is_fp8_dtype(self.fp8_dtype):
            raise TypeError(f"fp8_dtype must be an FP8 dtype, got {self.fp8_dtype}")

    @property
    def num_replaced(self) -> int:
        return sum(self.replaced.values())

    @property
    def ratio(self) -> float:
        return self.bytes_after / self.bytes_before if self.bytes_before else 1.0

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.replaced.items())) or "nothing"
        dtype = str(self.fp8_dtype).removeprefix("torch.")
        rounding = f"; {self.gptq_layers} linear layers GPTQ-rounded" if self.gptq_layers else ""
        rounding += f"; {self.fused_norms} RMSNorm modules fused" if self.fused_norms else ""
        lines = [
            f"FP8 quantization ({self.granularity}, {dtype}): replaced {self.num_replaced} modules ({kinds}){rounding}",
            f"  kept in high precision: {len(self.kept)} modules"
            + (f" ({', '.join(self.kept[:4])}{', ...' if len(self.kept) > 4 else ''})" if self.kept else ""),
            f"  replaced modules: {_fmt_bytes(self.quantized_bytes_before)} -> {_fmt_bytes(self.quantized_bytes_after)}",
            f"  whole model:      {_fmt_bytes(self.bytes_before)} -> {_fmt_bytes(self.bytes_after)}"
            f" ({self.ratio:.3f}x)",
        ]
        return "\n".join(lines)


def _empty_fp8_linear(linear: nn.Linear, granularity: str, fp8_dtype: torch.dtype, backend: str | None) -> Fp8BlockLinear:
    bias_dtype = linear.bias.dtype if linear.bias is not None else torch.bfloat16
    return Fp8BlockLinear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, granularity=granularity,
        device="meta", fp8_dtype=fp8_dtype, dtype=bias_dtype, backend=backend,
    )


def _output_head_ids(model: nn.Module) -> set[int]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {id(head)} if isinstance(head, nn.Module) else set()


def quantize_model_(
    model: nn.Module,
    granularity: str = "block",
    ignore: Iterable[str] | str = (),
    fp8_dtype: torch.dtype | str | None = None,
    backend: str | None = None,
    *,
    skip_defaults: bool = True,
    experts: bool = True,
    set_config: bool = True,
    calibration_data: Sequence[Any] | None = None,
    gptq: GPTQConfig | None = None,
    share_inputs: bool = True,
    fuse_norms: bool = True,
) -> QuantizeReport:
    """Replace eligible linear layers and fused experts of `model` with FP8 modules, in place.

    Args:
        model: any ``nn.Module`` (typically a transformers ``PreTrainedModel``).
        granularity: weight scaling, ``"block"`` (128x128), ``"row"`` (1x128) or ``"tensor"``.
        ignore: regexes (``re.search`` on the module's qualified name) of modules to keep.
        fp8_dtype: FP8 dtype; default: the one of each module's device (e4m3fnuz on MI300).
        backend: forced backend for the new modules (``"triton"``/``"reference"``), default auto.
        skip_defaults: also keep the output head, MoE routers/gates and linear layers named like
            embeddings or norms (:data:`fp8linear.checkpoint_format.DEFAULT_SKIP_PATTERNS`).
        experts: also replace fused MoE experts modules.
        set_config: set ``model.config.quantization_config`` to the checkpoint format's dict; the
            public :func:`fp8linear.integrations.transformers.quantize_model_` then also gives a
            transformers model the quantizer whose save hook ``model.save_pretrained`` calls, so
            it writes a complete checkpoint that :func:`from_pretrained` reloads.
        calibration_data: a list of batches (LongTensor input_ids ``[B, T]`` or dicts of model
            keyword arguments). Given, the linear layers are rounded with GPTQ, block by block
            (:mod:`fp8linear.integrations.calibration`): same format and kernels, lower output
            error. Fused experts are rounded to nearest (first, so the calibration sees them).
        gptq: GPTQ settings (:class:`fp8linear.gptq.GPTQConfig`); used with `calibration_data`.
        share_inputs: group the new linears that take one input tensor (q / k / v, gate / up) so
            that eager GPU calls quantize it once (:func:`fp8linear.share_input_quantization`).
        fuse_norms: swap the model's RMSNorm modules for :class:`fp8linear.norm.FusedRMSNorm` (one
            launch on GPUs instead of eight; the same weights and formula), where a probe shows it
            computes what they do (:func:`fp8linear.norm.fuse_rms_norms_`). Needs loaded weights:
            modules on the meta device are left alone.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_granularity(granularity)
    if gptq is not None and not isinstance(gptq, GPTQConfig):
        raise TypeError(f"gptq must be a fp8linear.gptq.GPTQConfig, got {type(gptq).__name__}")
    if gptq is not None and calibration_data is None:
        raise ValueError("gptq settings were given without calibration_data; GPTQ needs calibration batches")
    if not isinstance(share_inputs, bool):
        raise TypeError(f"share_inputs must be a bool, got {type(share_inputs).__name__}")
    if not isinstance(fuse_norms, bool):
        raise TypeError(f"fuse_norms must be a bool, got {type(fuse_norms).__name__}")
    if calibration_data is not None:
        check_calibration_data(calibration_data)  # before anything is replaced
    patterns = compile_patterns(ignore, "ignore")
    skip = compile_patterns(DEFAULT_SKIP_PATTERNS) if skip_defaults else ()
    head_ids = _output_head_ids(model) if skip_defaults else set()
    is_experts: Callable[[nn.Module], bool] = lambda m: False  # noqa: E731
    fp8_experts_cls = None
    if experts:
        fp8_experts_cls, is_experts = experts_api()

    bytes_before = module_state_bytes(model)
    plan: list[tuple[str, nn.Module, str]] = []  # (name, module, kind)
    kept: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            kind = "linear"
        elif experts and is_experts(module):
            kind = "experts"
        else:
            continue
        if any(p.search(name) for p in patterns) or (
            kind == "linear" and (id(module) in head_ids or any(p.search(name) for p in skip))
        ):
            kept.append(name)
            continue
        plan.append((name, module, kind))

    replaced: Counter[str] = Counter()
    chosen_dtype: torch.dtype | None = None
    q_before = sum(module_state_bytes(module) for _, module, _ in plan)
    dtypes: list[torch.dtype] = []
    for _, module, kind in plan:
        w = module.weight if kind == "linear" else next(module.parameters())
        dtypes.append(resolve_fp8_dtype(fp8_dtype, w.device if w.device.type != "meta" else None))
    chosen_dtype = dtypes[0] if dtypes else None
    calibrate = calibration_data is not None
    if calibrate:  # refuse before anything is replaced
        on_meta = [name for name, module, kind in plan if kind == "linear" and module.weight.device.type == "meta"]
        if on_meta:
            raise ValueError(f"{on_meta[0]}: calibration needs materialised weights, got the meta device")
    # Experts first: with calibration, the linear layers' GPTQ passes then run through FP8 experts.
    order = sorted(range(len(plan)), key=lambda i: plan[i][2] != "experts")
    for i in order:
        name, module, kind = plan[i]
        if kind == "linear" and calibrate:
            continue
        w = module.weight if kind == "linear" else next(module.parameters())
        if kind == "linear":
            if w.device.type == "meta":
                new = _empty_fp8_linear(module, granularity, dtypes[i], backend)
            else:
                new = Fp8BlockLinear.from_linear(module, granularity=granularity, fp8_dtype=dtypes[i], backend=backend)
                new.train(module.training)
        else:
            new = fp8_experts_cls.from_experts(module, granularity=granularity, fp8_dtype=dtypes[i], backend=backend)
        set_submodule(model, name, new)
        replaced[type(module).__name__] += 1
    gptq_layers = 0
    if calibrate:
        targets = [(name, module, dtypes[i]) for i, (name, module, kind) in enumerate(plan) if kind == "linear"]
        gptq_layers = gptq_replace_linears_(model, targets, calibration_data, granularity, backend, gptq)
        for _, module, _ in targets:
            replaced[type(module).__name__] += 1
    q_after = sum(module_state_bytes(model.get_submodule(name)) for name, _, _ in plan)
    if share_inputs and plan:
        share_input_quantization(model)
    fused_norms = fuse_rms_norms_(model) if fuse_norms and plan else 0

    chosen_dtype = chosen_dtype or resolve_fp8_dtype(fp8_dtype, None)
    report = QuantizeReport(
        granularity=granularity,
        fp8_dtype=chosen_dtype,
        replaced=dict(replaced),
        kept=kept,
        bytes_before=bytes_before,
        bytes_after=module_state_bytes(model),
        quantized_bytes_before=q_before,
        quantized_bytes_after=q_after,
        gptq_layers=gptq_layers,
        fused_norms=fused_norms,
    )
    config = getattr(model, "config", None)
    if set_config and config is not None and plan:
        config.quantization_config = checkpoint_quantization_config(granularity, kept, chosen_dtype)
    return report


def keep_experts_fused_on_save(model: nn.Module) -> None:
    """Keep only the key renamings among the model's weight conversions for saving.

    transformers 5.x reverts the model's weight conversions on the state dict it saves: it
    un-fuses ``experts.gate_up_proj`` into per-expert tensors (the reverse of its load-time
    merge) and collects ``experts.gate_up_proj_scale_inv`` into the same reverse converter,
    which drops it. The quantizer's save hook (:func:`.hf_quantizer.fp8_state_dict`) writes the
    experts' layout itself, so only the renamings (e.g. Mixtral's ``mlp`` -> ``block_sparse_moe``)
    may run after it.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # transformers < 5 never un-fuses
        return
    current = getattr(model, "_weight_conversions", None)
    if current is None:
        current = get_model_conversion_mapping(model, add_legacy=False)
    model._weight_conversions = [t for t in current if isinstance(t, WeightRenaming)]
