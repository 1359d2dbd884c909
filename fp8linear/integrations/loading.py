"""Load FP8 safetensors checkpoints into transformers models with fp8linear modules.

Reads checkpoints written by ``fp8linear quantize``, by :func:`save_pretrained` and official
DeepSeek-V3-format FP8 checkpoints (``quant_method: "fp8"``; ``X.weight`` FP8 + ``X.weight_scale_inv``
fp32; MoE experts stored per expert on disk). The model is built on the meta device, the
modules that have FP8 tensors in the checkpoint are swapped for FP8 modules, and every tensor
is read with ``safetensors.safe_open`` straight onto its device, so peak memory stays about the
FP8 size. Nothing is fetched from a network.

Per-expert tensors are fused the way transformers 5.x fuses them (``experts.J.gate_proj`` and
``experts.J.up_proj`` concatenated along the output dim into ``gate_up_proj[J]``,
``experts.J.down_proj`` into ``down_proj[J]``; Mixtral's ``w1``/``w3``/``w2`` likewise). The
scales follow: row-wise scales and 128x128 grids with the intermediate size a multiple of 128
concatenate exactly. Otherwise (a 128x128 block straddling gate and up, or per-tensor scales
which cannot describe two tensors with one number) the fused expert weight is dequantized and
requantized at the checkpoint's granularity -- that one tensor only, on its device; the values
change by at most FP8 rounding of the requantization.
"""

from __future__ import annotations

import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from ..checkpoint_format import SCALE_SUFFIX, torch_dtype_from_safetensors
from ..formats import GROUP_SIZE, SCALE_DTYPE, e4m3fn_to_e4m3fnuz, is_fp8_dtype, parse_fp8_dtype
from ..functional import dequantize_weight, quantize_weight
from ..module import Fp8BlockLinear, share_input_quantization
from ..norm import fuse_rms_norms_
from ..reference import weight_granularity, weight_scale_shape
from .checkpoint_index import EXPERT_NAME_SETS, CheckpointIndex, TensorInfo, index_checkpoint
from .replace import experts_api
from .save_hook import attach_save_hook_if_transformers

__all__ = [
    "SCALE_SUFFIX",
    "CheckpointIndex",
    "TensorInfo",
    "index_checkpoint",
    "check_fp8_scales",
    "from_pretrained",
    "load_fp8_state_",
]

# ----------------------------------------------------------------------------- renaming
def _transformers_renamings(model: nn.Module) -> list[Any]:
    """transformers' key renamings for this model (WeightRenaming rules only; merges are done here)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # transformers < 5: checkpoint names are the model's names
        return []
    return [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]


def _rename_index(index: CheckpointIndex, model: nn.Module) -> CheckpointIndex:
    rules = _transformers_renamings(model)
    if not rules:
        return index
    out = CheckpointIndex(index.root)
    for name, info in index.tensors.items():
        new = name
        for rule in rules:
            new, _ = rule.rename_source_key(new)
        if new in out.tensors:
            raise ValueError(f"checkpoint tensors {out.tensors[new].name!r} and {name!r} both map to {new!r}")
        out.tensors[new] = info
    return out


def check_fp8_scales(index: CheckpointIndex) -> None:
    """ValueError naming every FP8 tensor of the checkpoint that has no ``*_scale_inv`` next to it."""
    missing = []
    for name, info in index.tensors.items():
        try:
            dt = torch_dtype_from_safetensors(info.dtype)
        except ValueError:
            continue
        if dt is not None and is_fp8_dtype(dt) and not name.endswith(SCALE_SUFFIX) and f"{name}{SCALE_SUFFIX}" not in index:
            missing.append(f"{info.name!r} ({info.dtype}, in {info.file.name})")
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"checkpoint {index.root} has FP8 weights without their scales: {', '.join(sorted(missing)[:5])}{more} "
            f"(each FP8 'X' needs an 'X{SCALE_SUFFIX}'); the checkpoint is incomplete"
        )


# ----------------------------------------------------------------------------- planning
def _expected_shape(model_name: str, info: TensorInfo, expected: tuple[int, ...]) -> None:
    if tuple(info.shape) != tuple(expected):
        raise ValueError(
            f"checkpoint tensor {info.name!r} (in {info.file.name}) has shape {tuple(info.shape)}, "
            f"but the model's {model_name!r} expects {tuple(expected)}; does config.json match the checkpoint?"
        )


def _per_expert_names(index: CheckpointIndex, prefix: str) -> tuple[str, str, str] | None:
    for names in EXPERT_NAME_SETS:
        if f"{prefix}.0.{names[0]}.weight" in index:
            return names
    return None


def _checkpoint_granularity(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
    """Granularity whose scale shape is exactly the checkpoint's: a (1, 1) grid of a 128x128 block
    stays 'block' (its module then has the checkpoint's shapes); (), (1,) and other one-element
    shapes are 'tensor'."""
    for gran in ("block", "row", "tensor"):
        if tuple(weight_scale_shape(weight_shape, gran)) == tuple(scale_shape):
            return gran
    return weight_granularity(weight_shape, scale_shape)


def _checkpoint_fp8_dtype(dtype_str: str, prefix: str) -> torch.dtype:
    try:
        dt = torch_dtype_from_safetensors(dtype_str)
    except ValueError:
        dt = None
    if dt is None or not is_fp8_dtype(dt):
        raise TypeError(f"checkpoint tensor {prefix!r} has a scale but dtype {dtype_str}, expected an FP8 dtype")
    return dt


def _replace_fp8_modules(model: nn.Module, index: CheckpointIndex, backend: str | None) -> dict[str, str]:
    """Swap (meta) modules that have FP8 weights in the checkpoint; returns {module name: kind}."""
    fp8_experts_cls, is_experts = None, None
    kinds: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            scale = index.get(f"{name}.weight{SCALE_SUFFIX}")
            weight = index.get(f"{name}.weight")
            if scale is None or weight is None:
                continue
            _expected_shape(f"{name}.weight", weight, tuple(module.weight.shape))
            gran = _checkpoint_granularity(weight.shape, scale.shape)
            new = Fp8BlockLinear(
                module.in_features, module.out_features, bias=module.bias is not None, granularity=gran,
                device="meta", fp8_dtype=_checkpoint_fp8_dtype(weight.dtype, weight.name),
                dtype=module.bias.dtype if module.bias is not None else torch.bfloat16, backend=backend,
            )
            kinds[name] = "linear"
        else:
            if is_experts is None:
                try:
                    fp8_experts_cls, is_experts = experts_api()
                except ImportError:
                    fp8_experts_cls, is_experts = None, (lambda m: False)
            if not is_experts(module):
                continue
            down = module.down_proj
            fused_scale = index.get(f"{name}.down_proj{SCALE_SUFFIX}")
            names = _per_expert_names(index, name)
            if fused_scale is not None:
                gran = _checkpoint_granularity(down.shape, fused_scale.shape)
                dt = _checkpoint_fp8_dtype(index.tensors[f"{name}.down_proj"].dtype, f"{name}.down_proj")
            elif names is not None and f"{name}.0.{names[2]}.weight{SCALE_SUFFIX}" in index:
                w = index.tensors[f"{name}.0.{names[2]}.weight"]
                s = index.tensors[f"{name}.0.{names[2]}.weight{SCALE_SUFFIX}"]
                gran = _checkpoint_granularity(w.shape, s.shape)
                dt = _checkpoint_fp8_dtype(w.dtype, w.name)
            else:
                continue
            new = fp8_experts_cls.from_experts(module, granularity=gran, fp8_dtype=dt, backend=backend)
            kinds[name] = "experts"
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return kinds


# ----------------------------------------------------------------------------- devices
def _normalize_device_map(model: nn.Module, device_map: Any, dtype: torch.dtype) -> dict[str, torch.device]:
    if device_map is None:
        return {"": torch.device("cpu")}
    if isinstance(device_map, (torch.device, int)):
        return {"": torch.device(device_map)}
    if isinstance(device_map, str):
        if device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
            from accelerate import infer_auto_device_map
            from accelerate.utils import get_balanced_memory

            no_split = list(getattr(model, "_no_split_modules", None) or [])
            max_memory = None
            if device_map != "sequential":
                max_memory = get_balanced_memory(
                    model, dtype=dtype, low_zero=device_map == "balanced_low_0", no_split_module_classes=no_split
                )
            dm = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
            return _normalize_device_map(model, dm, dtype)
        return {"": torch.device(device_map)}
    if isinstance(device_map, dict):
        out = {}
        for k, v in device_map.items():
            if not isinstance(k, str):
                raise TypeError(f"device_map keys must be module names (str), got {k!r}")
            if v == "disk":
                raise ValueError(f"device_map: disk offload is not supported (module {k!r})")
            out[k] = torch.device(v) if not isinstance(v, int) else torch.device("cuda", v)
        return out
    raise TypeError(
        f"device_map must be None, a device, 'auto'/'balanced'/'sequential' or a dict {{module: device}}, "
        f"got {type(device_map).__name__}"
    )


def _device_for(name: str, dmap: dict[str, torch.device]) -> torch.device:
    best, best_len = None, -1
    for prefix, dev in dmap.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = dev, len(prefix)
    if best is None:
        raise ValueError(f"device_map does not place {name!r}; add it or a parent module (or '' for all)")
    return best


# ----------------------------------------------------------------------------- loading
class _Reader:
    """Opens each shard at most once per device and reads single tensors from it."""

    def __init__(self, stack: ExitStack, tp_load: Any = None) -> None:
        self._stack = stack
        self._handles: dict[tuple[Path, str], Any] = {}
        self._tp_load = tp_load  # tensor_parallel.TpLoad: reads this rank's slices only

    def read(self, info: TensorInfo, device: torch.device) -> torch.Tensor:
        from safetensors import safe_open

        dev = str(device)
        key = (info.file, dev)
        if key not in self._handles:
            self._handles[key] = self._stack.enter_context(safe_open(str(info.file), framework="pt", device=dev))
        if self._tp_load is not None:
            return self._tp_load.read(info, self._handles[key])
        return self._handles[key].get_tensor(info.name)


def _assign(module: nn.Module, attr: str, tensor: torch.Tensor, is_buffer: bool) -> None:
    if is_buffer:
        module._buffers[attr] = tensor
    else:
        old = module._parameters[attr]
        requires_grad = bool(old.requires_grad) and tensor.is_floating_point() and not is_fp8_dtype(tensor.dtype)
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=requires_grad)


def _cast(t: torch.Tensor, target: torch.Tensor, keep_fp32: bool = False) -> torch.Tensor:
    if is_fp8_dtype(t.dtype) or is_fp8_dtype(target.dtype) or not t.is_floating_point():
        return t
    dtype = torch.float32 if keep_fp32 else target.dtype
    return t if t.dtype == dtype else t.to(dtype)


def _fp32_patterns(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Module-name fragments transformers keeps in float32 (``_keep_in_fp32_modules[_strict]``)."""
    names = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:  # the non-strict list only applies to fp16, as in transformers
        names += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return names


def _fp8_pair(w: torch.Tensor, s: torch.Tensor, fp8_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    s = s.to(SCALE_DTYPE)
    if fp8_dtype is not None and fp8_dtype != w.dtype:
        if w.dtype == torch.float8_e4m3fn and fp8_dtype == torch.float8_e4m3fnuz:
            return e4m3fn_to_e4m3fnuz(w, s)
        raise ValueError(f"cannot convert checkpoint FP8 weights from {w.dtype} to {fp8_dtype}")
    return w, s


def _load_fused_experts(
    name: str, module: nn.Module, index: CheckpointIndex, reader: _Reader, device: torch.device,
    fp8_dtype: torch.dtype | None, used: set[str],
) -> None:
    """Fill an Fp8Experts module from fused (`P`, `P_scale_inv`) or per-expert checkpoint tensors."""
    fused_params = [a for a, t in module._parameters.items() if t is not None]
    if index.get(f"{name}.down_proj") is not None:
        weights = [a for a in fused_params if is_fp8_dtype(module._parameters[a].dtype)]
        for attr in fused_params:
            if attr.endswith(SCALE_SUFFIX):
                continue
            info = index.get(f"{name}.{attr}")
            if info is None:
                raise ValueError(f"checkpoint has {name}.down_proj but lacks {name}.{attr} (fused experts {name})")
            target = module._parameters[attr]
            _expected_shape(f"{name}.{attr}", info, tuple(target.shape))
            t = _cast(reader.read(info, device), target)
            used.add(f"{name}.{attr}")  # index keys (after renaming)
            if attr in weights:
                s_info = index.get(f"{name}.{attr}{SCALE_SUFFIX}")
                if s_info is None:
                    raise ValueError(f"checkpoint lacks {name}.{attr}{SCALE_SUFFIX}, the scales of FP8 {info.name!r}")
                _expected_shape(f"{name}.{attr}{SCALE_SUFFIX}", s_info, tuple(module._parameters[attr + SCALE_SUFFIX].shape))
                t, s = _fp8_pair(t, reader.read(s_info, device), fp8_dtype)
                used.add(f"{name}.{attr}{SCALE_SUFFIX}")
                _assign(module, attr + SCALE_SUFFIX, s, False)
            _assign(module, attr, t, False)
        return

    if not getattr(module, "has_gate", True) or getattr(module, "has_bias", False):
        raise ValueError(
            f"per-expert checkpoint tensors for {name} are only supported for experts with a gate and no bias"
        )
    names = _per_expert_names(index, name)
    assert names is not None  # _replace_fp8_modules only swaps modules that have one of the layouts
    gate_n, up_n, down_n = names
    gu_w, gu_s = module.gate_up_proj, module.gate_up_proj_scale_inv
    dn_w, dn_s = module.down_proj, module.down_proj_scale_inv
    num_experts, two_i, hidden = gu_w.shape
    inter = two_i // 2
    out_dtype = fp8_dtype or gu_w.dtype
    gran = weight_granularity(gu_w.shape, gu_s.shape)
    # Concatenating scale grids is exact for row-wise scales and for 128x128 blocks when the
    # gate/up boundary falls on a block edge, and per-tensor scales when gate and up share theirs
    # (as fp8linear writes them); otherwise the fused tensor is requantized.
    exact_concat = gran == "row" or (gran == "block" and inter % GROUP_SIZE == 0)
    buffers = {
        "gate_up_proj": torch.empty(gu_w.shape, dtype=out_dtype, device=device),
        "gate_up_proj_scale_inv": torch.empty(gu_s.shape, dtype=SCALE_DTYPE, device=device),
        "down_proj": torch.empty(dn_w.shape, dtype=out_dtype, device=device),
        "down_proj_scale_inv": torch.empty(dn_s.shape, dtype=SCALE_DTYPE, device=device),
    }

    def read_pair(j: int, proj: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        w_name, s_name = f"{name}.{j}.{proj}.weight", f"{name}.{j}.{proj}.weight{SCALE_SUFFIX}"
        w_info, s_info = index.get(w_name), index.get(s_name)
        if w_info is None or s_info is None:
            missing = w_name if w_info is None else s_name
            raise ValueError(f"checkpoint is missing {missing!r} (expert {j} of {num_experts} in {name})")
        _expected_shape(f"{name}.{proj}[{j}]", w_info, shape)
        used.update((w_name, s_name))
        w, s = _fp8_pair(reader.read(w_info, device), reader.read(s_info, device), fp8_dtype)
        weight_granularity(w.shape, s.shape)  # validates the scale's shape
        return w, s

    for j in range(num_experts):
        gw, gs = read_pair(j, gate_n, (inter, hidden))
        uw, us = read_pair(j, up_n, (inter, hidden))
        dw, ds = read_pair(j, down_n, (hidden, inter))
        pair_gran = weight_granularity(gw.shape, gs.shape)
        if exact_concat and pair_gran == gran:
            buffers["gate_up_proj"][j].copy_(torch.cat([gw, uw], dim=0))
            buffers["gate_up_proj_scale_inv"][j].copy_(torch.cat([gs, us], dim=0))
        elif gran == "tensor" and pair_gran == "tensor" and torch.equal(gs.view(torch.int32), us.view(torch.int32)):
            buffers["gate_up_proj"][j].copy_(torch.cat([gw, uw], dim=0))
            buffers["gate_up_proj_scale_inv"][j].copy_(gs)
        else:
            full = torch.cat([dequantize_weight(gw, gs), dequantize_weight(uw, us)], dim=0)
            q, s = quantize_weight(full, gran, out_dtype)
            buffers["gate_up_proj"][j].copy_(q)
            buffers["gate_up_proj_scale_inv"][j].copy_(s)
        if tuple(ds.shape) != tuple(dn_s.shape[1:]):
            dq, ds = quantize_weight(dequantize_weight(dw, ds), gran, out_dtype)
            dw = dq
        buffers["down_proj"][j].copy_(dw)
        buffers["down_proj_scale_inv"][j].copy_(ds)
    for attr, t in buffers.items():
        _assign(module, attr, t, False)


def load_fp8_state_(
    model: nn.Module,
    index: CheckpointIndex,
    device_map: dict[str, torch.device],
    fp8_dtype: torch.dtype | None = None,
    ignore_unexpected: Iterable[str] = (),
    dtype: torch.dtype = torch.bfloat16,
    tp_load: Any = None,
) -> None:
    """Fill every parameter and persistent buffer of a (meta) `model` from the checkpoint, in place.

    `tp_load` (a :class:`~fp8linear.integrations.tensor_parallel.TpLoad`): read only this rank's
    slices of the tensors it shards."""
    ignore_re = [re.compile(p) for p in ignore_unexpected]
    fp32_names = _fp32_patterns(model, dtype)
    fused_names: dict[str, nn.Module] = {}
    try:
        fp8_experts_cls, _ = experts_api()
        fused_names = {n: m for n, m in model.named_modules() if isinstance(m, fp8_experts_cls)}
    except ImportError:
        pass
    used: set[str] = set()
    with ExitStack() as stack:
        reader = _Reader(stack, tp_load)
        for name, module in fused_names.items():
            _load_fused_experts(name, module, index, reader, _device_for(name, device_map), fp8_dtype, used)
        for mod_name, module in model.named_modules():
            if mod_name in fused_names or any(mod_name.startswith(f + ".") for f in fused_names):
                continue
            entries = [(n, t, False) for n, t in module._parameters.items() if t is not None]
            entries += [
                (n, t, True) for n, t in module._buffers.items()
                if t is not None and n not in module._non_persistent_buffers_set
            ]
            if not entries and all(b is None for b in module._buffers.values()):
                continue  # a container (the root, model, model.layers): the map need not name it
            device = _device_for(mod_name, device_map)
            pairs: dict[str, torch.Tensor] = {}
            for attr, target, is_buffer in entries:
                full = f"{mod_name}.{attr}" if mod_name else attr
                info = index.get(full)
                if info is None:
                    continue  # missing; tied weights are filled below, the rest reported
                _expected_shape(full, info, tuple(target.shape))
                t = _cast(reader.read(info, device), target, any(f in full for f in fp32_names))
                used.add(full)  # the index key (after renaming), not the name on disk
                if isinstance(module, Fp8BlockLinear) and attr in ("weight", "weight" + SCALE_SUFFIX):
                    pairs[attr] = t
                    continue
                _assign(module, attr, t, is_buffer)
            if pairs:
                w, s = _fp8_pair(pairs["weight"], pairs["weight" + SCALE_SUFFIX], fp8_dtype)
                _assign(module, "weight", w, False)
                _assign(module, "weight" + SCALE_SUFFIX, s, False)
            # Buffers that are not in the checkpoint (rotary inv_freq, ...) move to the module's device.
            for bname, buf in module._buffers.items():
                if buf is not None and buf.device.type != "meta" and buf.device != device:
                    module._buffers[bname] = buf.to(device)

    unexpected = sorted(n for n in index.tensors if n not in used and not any(p.search(n) for p in ignore_re))
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ValueError(
            f"checkpoint {index.root} has {len(unexpected)} tensors the model does not use: "
            f"{', '.join(unexpected[:5])}{more}"
        )


def _missing(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"] + [
        n for n, b in model.named_buffers(remove_duplicate=False) if b.device.type == "meta"
    ]


def from_pretrained(
    path: str | os.PathLike,
    device_map: Any = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    fp8_dtype: torch.dtype | str | None = None,
    backend: str | None = None,
    model_class: Any = None,
    attn_implementation: str | None = None,
    tp_plan: Any = None,
    share_inputs: bool = True,
    fuse_norms: bool = True,
) -> nn.Module:
    """Load an FP8 checkpoint folder into its transformers model class with fp8linear modules.

    Args:
        path: a local folder with config.json and safetensors (written by ``fp8linear quantize``,
            by :func:`save_pretrained`, or an official DeepSeek-V3-format FP8 checkpoint).
        device_map: ``None``/``"cpu"``, a device (``"cuda"``, ``"cuda:1"``), ``"auto"`` /
            ``"balanced"`` / ``"sequential"`` (accelerate spreads the FP8-sized modules over the
            GPUs), or a dict ``{module name: device}``.
        dtype: dtype of everything that is not FP8 (embeddings, norms, head, activations).
        fp8_dtype: convert e4m3fn checkpoints to ``"e4m3fnuz"`` (MI300); default: as stored.
        backend: force ``"triton"`` or ``"reference"`` in the FP8 modules; default auto.
        model_class: a transformers auto class or model class; default ``AutoModelForCausalLM``.
        attn_implementation: passed to the model constructor (e.g. ``"sdpa"``, ``"eager"``).
        tp_plan: ``"auto"`` (the model's transformers plan) or a plan dict: tensor parallel over
            all ranks of the initialised process group (``torchrun``); each rank reads only its
            slices. Needs ``device_map=None``. See docs/tensor_parallel.md.
        share_inputs: group the FP8 linears that take one input tensor (q / k / v, gate / up) so
            that eager GPU calls quantize it once (:func:`fp8linear.share_input_quantization`).
        fuse_norms: swap the RMSNorm modules for one-launch :class:`fp8linear.norm.FusedRMSNorm`
            (same weights and formula, checked per module: :func:`fp8linear.norm.fuse_rms_norms_`).

    Raises ValueError naming the tensor when the checkpoint and config.json disagree, when
    tensors are missing or unused, or when a file listed in the index lies outside `path`.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or is_fp8_dtype(dtype):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    if not isinstance(share_inputs, bool):
        raise TypeError(f"share_inputs must be a bool, got {type(share_inputs).__name__}")
    if not isinstance(fuse_norms, bool):
        raise TypeError(f"fuse_norms must be a bool, got {type(fuse_norms).__name__}")
    fp8 = parse_fp8_dtype(fp8_dtype) if fp8_dtype is not None else None
    root = Path(path).resolve()
    if not (root / "config.json").is_file():
        raise ValueError(f"expected a checkpoint folder with config.json, got {str(path)!r}")
    config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is not None:
        qdict = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
        if qdict.get("quant_method") != "fp8":
            raise ValueError(
                f"{root}/config.json: quantization_config.quant_method must be 'fp8' (or absent), "
                f"got {qdict.get('quant_method')!r}"
            )
        del config.quantization_config
    index = index_checkpoint(root)

    model_class = model_class or AutoModelForCausalLM
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights(include_buffers=False):
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config, **kwargs)
        else:
            model = model_class._from_config(config, **kwargs)
    index = _rename_index(index, model)
    check_fp8_scales(index)
    kinds = _replace_fp8_modules(model, index, backend)
    if not kinds:
        raise ValueError(f"{root}: no FP8 tensors found (no '*{SCALE_SUFFIX}'); is this an FP8 checkpoint?")
    tp_load = None
    if tp_plan is not None:
        if device_map is not None:
            raise ValueError(f"tp_plan and device_map cannot be combined (got device_map={device_map!r}); "
                             "under tensor parallelism each rank uses its own device")
        from .tensor_parallel import TpLoad

        tp_load = TpLoad(model, tp_plan)
        index = tp_load.localize(model, index)
        device_map = tp_load.device
    dmap = _normalize_device_map(model, device_map, dtype)
    ignore = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    load_fp8_state_(model, index, dmap, fp8, ignore_unexpected=ignore, dtype=dtype, tp_load=tp_load)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = _missing(model)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {root} lacks {len(missing)} tensors the model needs: {', '.join(missing[:5])}{more}")
    if qcfg is not None:
        config.quantization_config = qdict
    if len(set(dmap.values())) > 1:
        from accelerate import dispatch_model

        dispatch_model(model, device_map={k: str(v) for k, v in dmap.items()})
    if getattr(model, "can_generate", lambda: False)() and (root / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(root), local_files_only=True)
    if tp_load is not None:
        tp_load.finish(model)
    for module in model.modules():
        if isinstance(module, Fp8BlockLinear):
            module.init_split_k_counters()  # on the device its weight was placed on
    if share_inputs:
        share_input_quantization(model)
    if fuse_norms:
        fuse_rms_norms_(model)
    attach_save_hook_if_transformers(model)  # model.save_pretrained writes the checkpoint format
    model.eval()
    return model
