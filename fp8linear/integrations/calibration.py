"""GPTQ calibration of a model's linear layers, block by block (used by ``quantize_model_``).

The linear layers are grouped by the numbered block that holds them (``model.layers.3`` for
``model.layers.3.self_attn.q_proj``; layers outside any numbered block form one group of their
own) and the groups are taken in the order the model first calls them. For each group, the
calibration batches are run through the model, in which every earlier group is already FP8,
until that group's block has run (a forward hook stops the pass there); hooks on the group's
layers add up each layer's input second moments ``X^T X``; then every layer of the group is
rounded with :func:`fp8linear.gptq.gptq_quantize_weight` and replaced by an
:class:`~fp8linear.Fp8BlockLinear`. So each layer's rounding sees, and makes up for, the errors
of the FP8 layers before it ("sequential" GPTQ). Layers fed the very same input tensor (q/k/v,
gate/up) share one accumulator. A layer the calibration data never reaches keeps the
round-to-nearest result. Cost: about (number of blocks / 2) forward passes over the data.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..gptq import GPTQConfig, gptq_quantize_weight, hessian_from_inputs
from ..module import Fp8BlockLinear
from ..reference import dequantize_activation_ref, quantize_activation_ref

__all__ = ["gptq_replace_linears_", "calibration_groups", "check_calibration_data", "set_submodule"]


class _StopCalibration(Exception):
    """Raised by a block's forward hook to end a calibration pass once the block has run."""


@dataclass
class _Target:
    """One linear layer to calibrate: its qualified name, the module and the FP8 dtype for it."""

    name: str
    module: nn.Linear
    fp8_dtype: torch.dtype


class _Accumulator:
    """Running sum of X^T X and the number of input rows, on the layer's device."""

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.rows = 0

    def add(self, product: torch.Tensor, rows: int) -> None:
        self.sum = product.clone() if self.sum is None else self.sum.add_(product)
        self.rows += rows

    def hessian(self) -> torch.Tensor:
        return self.sum / self.rows


@dataclass
class _SeenInput:
    """An input tensor met in the current batch, its X^T X, row count and the accumulator it went to."""

    x: torch.Tensor  # held so that id(x) stays unique until the batch ends
    product: torch.Tensor
    rows: int
    acc: _Accumulator | None = None


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` at the dotted path `name` of `model` (``layers.0.mlp.up_proj``), replacing what is there."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def calibration_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """Group qualified module names by their numbered block (``a.layers.3.x.y`` -> ``a.layers.3``).

    Names without a numeric component go to the group ``""`` (the model itself).
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        cut = next((i + 1 for i, p in enumerate(parts[:-1]) if p.isdigit()), 0)
        groups.setdefault(".".join(parts[:cut]), []).append(name)
    return groups


def _input_device(model: nn.Module) -> torch.device:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, nn.Module):
        for p in emb.parameters():
            return p.device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def check_calibration_data(data: Any) -> list[Any]:
    """The batches of `data` as a list; TypeError/ValueError naming what is wrong otherwise."""
    if isinstance(data, (torch.Tensor, dict)) or not isinstance(data, Sequence):
        raise TypeError(
            "calibration_data must be a list or tuple of batches (LongTensor input_ids [B, T] or dicts of "
            f"model keyword arguments), got {type(data).__name__}"
        )
    if len(data) == 0:
        raise ValueError("calibration_data is empty; give at least one batch")
    for i, b in enumerate(data):
        if isinstance(b, torch.Tensor):
            if b.dtype not in (torch.int32, torch.int64) or b.dim() != 2:
                raise ValueError(f"calibration_data[{i}] must be integer input_ids of shape [B, T], got {b.dtype} {tuple(b.shape)}")
        elif not isinstance(b, dict):
            raise TypeError(f"calibration_data[{i}] must be a tensor of input_ids or a dict, got {type(b).__name__}")
    return list(data)


def _runner(model: nn.Module, batches: list[Any]):
    """A function that runs every batch through `model`, each pass ending early on _StopCalibration."""
    device = _input_device(model)
    try:
        accepts_use_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepts_use_cache = False

    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    def run_all(on_batch_end) -> None:
        for b in batches:
            kwargs = {k: move(v) for k, v in b.items()} if isinstance(b, dict) else {"input_ids": move(b)}
            if accepts_use_cache:
                kwargs.setdefault("use_cache", False)
            try:
                model(**kwargs)
            except _StopCalibration:
                pass
            on_batch_end()

    return run_all


def _call_order(model: nn.Module, targets: list[_Target], run_first) -> dict[str, int]:
    """Order in which the model first calls each target on the first batch (unreached: not in the dict)."""
    order: dict[str, int] = {}
    handles = []
    for t in targets:
        def hook(mod, args, name=t.name):
            order.setdefault(name, len(order))
        handles.append(t.module.register_forward_pre_hook(hook))
    try:
        run_first(lambda: None)
    finally:
        for h in handles:
            h.remove()
    return order


@torch.no_grad()
def gptq_replace_linears_(
    model: nn.Module,
    targets: Sequence[tuple[str, nn.Linear, torch.dtype]],
    calibration_data: Sequence[Any],
    granularity: str,
    backend: str | None = None,
    config: GPTQConfig | None = None,
) -> int:
    """Replace each ``(name, linear, fp8_dtype)`` of `targets` with a GPTQ-rounded Fp8BlockLinear.

    `calibration_data`: a list of batches, each a LongTensor of input_ids ``[B, T]`` or a dict of
    keyword arguments for ``model(...)``. Returns how many layers got GPTQ rounding (the others,
    never reached by the data, are rounded to nearest).
    """
    config = config or GPTQConfig()
    batches = check_calibration_data(calibration_data)
    items = [_Target(n, m, d) for n, m, d in targets]
    for t in items:
        if not isinstance(t.module, nn.Linear):
            raise TypeError(f"{t.name}: GPTQ calibrates nn.Linear layers, got {type(t.module).__name__}")
        if t.module.weight.device.type == "meta":
            raise ValueError(f"{t.name}: calibration needs materialised weights, got the meta device")
    if not items:
        return 0
    run_all = _runner(model, batches)
    first_only = _runner(model, batches[:1])
    was_training = model.training
    model.eval()
    try:
        order = _call_order(model, items, first_only)
        by_name = {t.name: t for t in items}
        groups = calibration_groups([t.name for t in items])
        ranked = sorted(groups, key=lambda g: min(order.get(n, len(order)) for n in groups[g]))
        calibrated = 0
        for g in ranked:
            members = [by_name[n] for n in groups[g]]
            reached = [t for t in members if t.name in order]
            accs = _collect(model, g, reached, run_all, config) if reached else {}
            for t in members:
                w = t.module.weight
                acc = accs.get(t.name)
                if acc is not None and acc.rows:
                    h = acc.hessian()
                    calibrated += 1
                else:  # never reached by the data: a zero H gives the round-to-nearest result
                    h = torch.zeros(w.shape[1], w.shape[1], device=w.device)
                w_q, w_s = gptq_quantize_weight(w, h, granularity, t.fp8_dtype, config, name=t.name)
                new = Fp8BlockLinear.from_quantized(w_q, w_s, t.module.bias, backend=backend)
                new.train(t.module.training)
                set_submodule(model, t.name, new)
            del accs
        return calibrated
    finally:
        model.train(was_training)


def _collect(model: nn.Module, group: str, members: list[_Target], run_all, config: GPTQConfig) -> dict[str, _Accumulator]:
    """Run the data through `model` up to the end of block `group`, summing X^T X of each member."""
    accs: dict[str, _Accumulator] = {}
    seen: dict[int, _SeenInput] = {}
    updated: set[int] = set()
    handles = []

    def make_hook(t: _Target):
        def hook(mod, args):
            x = args[0]
            entry = seen.get(id(x))
            if entry is None:
                xin = x
                if config.quantized_inputs:  # what the FP8 layer will multiply: per-token 1x128 FP8
                    xin = dequantize_activation_ref(*quantize_activation_ref(x, t.fp8_dtype))
                entry = seen[id(x)] = _SeenInput(x, hessian_from_inputs(xin), xin.numel() // xin.shape[-1])
            if t.name not in accs:  # first batch: layers fed the same tensor share an accumulator
                accs[t.name] = entry.acc or _Accumulator()
            acc = accs[t.name]
            entry.acc = entry.acc or acc
            if id(acc) not in updated:
                acc.add(entry.product, entry.rows)
                updated.add(id(acc))
        return hook

    def end_batch() -> None:
        seen.clear()
        updated.clear()

    for t in members:
        handles.append(t.module.register_forward_pre_hook(make_hook(t)))
    if group:
        def stop(mod, args, out):
            raise _StopCalibration
        handles.append(model.get_submodule(group).register_forward_hook(stop))
    try:
        run_all(end_batch)
    finally:
        for h in handles:
            h.remove()
    return accs
