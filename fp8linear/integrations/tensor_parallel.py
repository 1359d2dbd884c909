"""Tensor parallelism for fp8linear modules on PyTorch's DTensor.

Two routes, one set of sharding rules:

- PyTorch: ``parallelize_module(model, mesh, {name: Fp8ColwiseParallel(), ...})`` with the
  :class:`Fp8ColwiseParallel`, :class:`Fp8RowwiseParallel` and :class:`Fp8ExpertsParallel`
  styles here, or :func:`parallelize` which builds that plan from transformers' ``tp_plan``.
- transformers: ``tp_plan="auto"`` under ``torchrun`` -- through
  :func:`fp8linear.integrations.transformers.from_pretrained` (FP8 checkpoints, each rank reads
  only its slices) or ``AutoModelForCausalLM.from_pretrained(bf16_path,
  quantization_config=Fp8LinearConfig(), tp_plan="auto")`` (transformers' own styles; the scale
  entries of the plan are added by :func:`extend_hf_tp_plan`).

Sharding (N = out features, K = in features, weight (N, K)):

- colwise: ``weight`` and ``weight_scale_inv`` split along N (dim 0), bias along N; the input
  is replicated, each rank computes its N/tp output columns.
- rowwise: ``weight`` and ``weight_scale_inv`` split along K (dim 1), bias replicated; each
  rank quantizes its K/tp slice of the activation in 1x128 groups, computes a partial output,
  the partials are summed by an all-reduce in the output dtype and the bias is added once.
- experts (transformers' plan ``packed_colwise`` gate_up, ``rowwise`` down,
  ``moe_tp_experts``): every rank holds all experts, each with its slice of the intermediate
  dimension: ``gate_up_proj`` (E, 2I, H) keeps rows [gate slice r; up slice r], ``down_proj``
  (E, H, I) columns slice r, the output is all-reduced (down bias, if any, added by rank 0).

A split must fall on a 128 boundary wherever a scale or an activation group spans 128
elements (block scales along N or K, activation groups along K): otherwise a rank would hold a
part of a 128-block whose scale covers the whole block. Such a layer raises ValueError naming it
and the tp size (replicating it alone would be wrong: colwise and rowwise layers come in pairs).
Per-tensor scales (0-d, or (E,) for experts) are replicated.
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..formats import GROUP_SIZE
from ..module import Fp8BlockLinear
from .checkpoint_index import EXPERT_NAME_SETS, CheckpointIndex, TensorInfo

__all__ = [
    "ParamShard",
    "Fp8ColwiseParallel",
    "Fp8RowwiseParallel",
    "Fp8ExpertsParallel",
    "module_param_shards",
    "check_shardable",
    "resolve_tp_plan",
    "parallelize",
    "extend_hf_tp_plan",
    "TpLoad",
]

SCALE_SUFFIX = "_scale_inv"

# transformers style names -> (kind, input replicated, output replicated)
_LINEAR_STYLES = {
    "colwise": ("colwise", True, False),
    "colwise_rep": ("colwise", True, True),
    "colwise_gather_output": ("colwise", True, True),
    "rowwise": ("rowwise", False, True),
    "rowwise_rep": ("rowwise", True, True),
    "rowwise_split_input": ("rowwise", True, True),
}
# Styles that leave a module (and its parameters) whole on every rank.
_REPLICATED_STYLES = ("replicate", "embedding_rowwise", "embedding_colwise")
_EXPERTS_STYLE = "moe_tp_experts"


def _experts_cls() -> type[nn.Module]:
    from .experts import Fp8Experts

    return Fp8Experts


# ----------------------------------------------------------------------------- sharding rules
@dataclass(frozen=True)
class ParamShard:
    """How one parameter is split over `tp` ranks.

    kind: ``"shard"`` (contiguous chunk r of `dim`), ``"packed"`` (dim holds two halves, e.g.
    gate and up: chunk r of each half, concatenated) or ``"replicate"``.
    """

    kind: str
    dim: int = 0

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if self.kind == "replicate":
            return tuple(shape)
        out = list(shape)
        out[self.dim] //= tp
        return tuple(out)

    def take(self, t: Any, shape: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
        """This rank's slice of `t` (a tensor or a safetensors slice, indexed once per piece)."""
        if self.kind == "replicate":
            return t[...] if not isinstance(t, torch.Tensor) else t

        def rows(lo: int, hi: int) -> torch.Tensor:
            idx = tuple(slice(lo, hi) if d == self.dim else slice(None) for d in range(len(shape)))
            return t[idx]

        size = shape[self.dim]
        if self.kind == "shard":
            c = size // tp
            return rows(rank * c, (rank + 1) * c)
        half = size // 2
        c = half // tp
        return torch.cat([rows(rank * c, (rank + 1) * c), rows(half + rank * c, half + (rank + 1) * c)], dim=self.dim)

    def placement(self) -> Any:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        if self.kind == "replicate":
            return Replicate()
        if self.kind == "shard":
            return Shard(self.dim)
        return _StridedShard(self.dim, split_factor=2)


def _split_check(name: str, what: str, size: int, tp: int, group: int) -> None:
    if size % (tp * group) != 0:
        unit = f"{tp} x {group}" if group > 1 else f"{tp}"
        raise ValueError(
            f"cannot shard {name!r} over tp={tp}: its {what} ({size}) is not a multiple of {unit} = {tp * group}, "
            f"so a rank's slice would cut a {group}-element scale block or activation group"
            if group > 1 else
            f"cannot shard {name!r} over tp={tp}: its {what} ({size}) is not a multiple of {tp}"
        )


def check_shardable(name: str, module: nn.Module, kind: str, tp: int) -> None:
    """ValueError naming `name` and `tp` unless `module` splits on 128 boundaries for `kind`.

    colwise: N % (tp * 128) for block scales, N % tp otherwise. rowwise: K % (tp * 128) (the
    activation's 1x128 groups, and block or row scales). experts: I % (tp * 128) for block or
    row scales and for the down projection's activation groups.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if tp == 1:
        return
    if isinstance(module, _experts_cls()):
        _split_check(name, "intermediate size", module.intermediate_dim, tp, GROUP_SIZE)
        return
    if not isinstance(module, (Fp8BlockLinear, nn.Linear)):
        raise TypeError(f"{name!r}: tensor parallel styles shard Fp8BlockLinear, nn.Linear or Fp8Experts, "
                        f"got {type(module).__name__}")
    fp8 = isinstance(module, Fp8BlockLinear)
    if kind == "colwise":
        block = fp8 and module.granularity == "block"
        _split_check(name, "out_features", module.out_features, tp, GROUP_SIZE if block else 1)
    elif kind == "rowwise":
        _split_check(name, "in_features", module.in_features, tp, GROUP_SIZE if fp8 else 1)
    else:
        raise ValueError(f"kind must be 'colwise' or 'rowwise', got {kind!r}")


def module_param_shards(module: nn.Module, kind: str) -> dict[str, ParamShard]:
    """{parameter name: ParamShard} for `module` sharded as `kind` ('colwise', 'rowwise', 'experts')."""
    out: dict[str, ParamShard] = {}
    if kind == "experts":
        up = module.up_name
        packed = "packed" if module.has_gate else "shard"
        for pname, p in module.named_parameters(recurse=False):
            if pname.startswith(up):
                if pname == up + SCALE_SUFFIX and p.dim() < 3:  # per-tensor scales (E,)
                    out[pname] = ParamShard("replicate")
                else:
                    out[pname] = ParamShard(packed, 1)
            elif pname.startswith("down_proj"):
                if pname == "down_proj_bias" or (pname == "down_proj" + SCALE_SUFFIX and p.dim() < 3):
                    out[pname] = ParamShard("replicate")
                else:
                    out[pname] = ParamShard("shard", 2)
            else:
                out[pname] = ParamShard("replicate")
        return out
    if kind not in ("colwise", "rowwise"):
        raise ValueError(f"kind must be 'colwise', 'rowwise' or 'experts', got {kind!r}")
    for pname, p in module.named_parameters(recurse=False):
        if pname == "bias":
            out[pname] = ParamShard("shard", 0) if kind == "colwise" else ParamShard("replicate")
        elif p.dim() < 2:  # per-tensor scale
            out[pname] = ParamShard("replicate")
        else:
            out[pname] = ParamShard("shard", 0 if kind == "colwise" else 1)
    return out


# ----------------------------------------------------------------------------- forward
def _mesh_info(mesh: Any) -> tuple[int, int, Any]:
    if mesh.ndim != 1:
        raise ValueError(f"expected a 1-D tensor-parallel DeviceMesh, got {mesh.ndim}-D")
    return mesh.get_local_rank(), mesh.size(), mesh.get_group()


@contextlib.contextmanager
def _local_params(module: nn.Module, hide: tuple[str, ...] = ()) -> Iterator[None]:
    """Run with the module's DTensor parameters swapped for their local shards (`hide`: set to None)."""
    from torch.distributed.tensor import DTensor

    saved = dict(module._parameters)
    for name, p in saved.items():
        if name in hide:
            module._parameters[name] = None
        elif isinstance(p, DTensor):
            module._parameters[name] = p.to_local()
    try:
        yield
    finally:
        module._parameters.update(saved)


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _input_local(x: Any, mesh: Any, want: str, in_features: int) -> torch.Tensor:
    """The local tensor this rank computes on: the whole input ('replicate') or its K slice ('shard')."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(x, DTensor):
        target = Replicate() if want == "replicate" else Shard(x.dim() - 1)
        if x.placements != (target,):
            x = x.redistribute(placements=[target])
        return x.to_local()
    if want == "shard_from_full":  # a replicated plain tensor: take this rank's K slice
        rank, tp, _ = _mesh_info(mesh)
        c = in_features // tp
        return x[..., rank * c : (rank + 1) * c]
    return x


def all_reduce_sum_(y: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum `y` over the group in place, in its own dtype (NCCL and gloo both reduce bf16/fp16)."""
    import torch.distributed as dist

    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


def _gather_last(y: torch.Tensor, mesh: Any, full: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = (*y.shape[:-1], full)
    d = DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False, shape=shape,
                           stride=torch.empty(shape, device="meta").stride())
    return d.redistribute(placements=[Replicate()]).to_local()


def _distribute_(module: nn.Module, shards: dict[str, ParamShard], mesh: Any, local: bool) -> None:
    """Make each listed parameter a DTensor. `local`: the parameter already holds this rank's
    slice (as the sharded loader leaves it); otherwise it holds the full tensor, the same on
    every rank, and each rank keeps its slice (no communication)."""
    from torch.distributed.tensor import DTensor

    rank, tp, _ = _mesh_info(mesh)
    for pname, spec in shards.items():
        p = module._parameters.get(pname)
        if p is None or isinstance(p, DTensor):
            continue
        if local:
            lt = p.detach()
            shape = list(lt.shape)
            if spec.kind != "replicate":
                shape[spec.dim] *= tp
            shape = tuple(shape)
        else:
            shape = tuple(p.shape)
            lt = spec.take(p.detach(), shape, rank, tp)
            if lt.device.type != "meta":
                lt = lt.contiguous().clone()  # own storage: the full tensor can be freed
        dt = DTensor.from_local(lt, mesh, [spec.placement()], run_check=False, shape=shape,
                                stride=torch.empty(shape, device="meta").stride())
        module._parameters[pname] = nn.Parameter(dt, requires_grad=False)
    clear = getattr(module, "clear_plans", None)
    if clear is not None:  # plans made before hold the full tensors (and a rowwise layer's bias)
        clear()


def _own_forward(module: nn.Module) -> tuple[Callable[[], nn.Module], Callable[..., Any]]:
    """(``owner()`` giving `module`, ``call(module, *args)`` running its forward as it stands).
    The TP wrappers installed as ``module.forward`` reach the module only through these, by a weak
    reference: a bound method or the module itself in their closures would make a cycle (module ->
    forward -> module) that keeps a deleted model's shards allocated until Python's cyclic garbage
    collector runs. A forward set on the instance before (accelerate's hooks, say) is called as it
    stands, with whatever it holds."""
    ref = weakref.ref(module)
    name = type(module).__name__

    def owner() -> nn.Module:
        m = ref()
        if m is None:  # a copy.deepcopy of a parallelized module shares its forward function
            raise RuntimeError(f"this tensor-parallel forward belongs to a {name} that no longer exists (a copy "
                               "of a parallelized module keeps the original's forward): parallelize the copy itself")
        return m

    installed = module.__dict__.get("forward")
    if installed is not None:
        return owner, lambda m, *args: installed(*args)
    return owner, type(module).forward


def _install_linear(module: nn.Module, mesh: Any, kind: str, input_rep: bool, output_rep: bool) -> None:
    owner, original = _own_forward(module)
    _, _, group = _mesh_info(mesh)
    n_full = module.out_features
    k_full = module.in_features

    if kind == "colwise":
        def forward(x: torch.Tensor) -> torch.Tensor:
            m = owner()
            x = _input_local(x, mesh, "replicate", k_full)
            with _local_params(m):
                y = original(m, x)
            return _gather_last(y, mesh, n_full) if output_rep else y
    else:
        def forward(x: torch.Tensor) -> torch.Tensor:
            from torch.distributed.tensor import DTensor

            m = owner()
            want = "shard_from_full" if input_rep and not isinstance(x, DTensor) else "shard"
            x = _input_local(x, mesh, want, k_full)
            with _local_params(m, hide=("bias",)):
                y = original(m, x)
            y = all_reduce_sum_(y, group)
            bias = m._parameters.get("bias")
            return y if bias is None else y + _local(bias).to(y.dtype)

    module.forward = forward


def _install_experts(module: nn.Module, mesh: Any) -> None:
    owner, original = _own_forward(module)
    rank, _, group = _mesh_info(mesh)
    hide = () if rank == 0 else ("down_proj_bias",)  # the down bias is added once

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        m = owner()
        hidden_states, top_k_weights = _local(hidden_states), _local(top_k_weights)
        with _local_params(m, hide=hide):
            y = original(m, hidden_states, top_k_index, top_k_weights)
        return all_reduce_sum_(y, group)

    module.forward = forward


class _Fp8Style:
    """Checks shared by the styles below."""

    kind = ""

    def _check(self, module: nn.Module, mesh: Any, name: str = "module") -> None:
        if getattr(module, "_fp8linear_tp", None) is not None:
            raise ValueError(f"{name!r} is already tensor-parallel ({module._fp8linear_tp})")
        check_shardable(name, module, self.kind, mesh.size())


def _parallel_style_base() -> type:
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


class Fp8ColwiseParallel(_Fp8Style, _parallel_style_base()):
    """Column-wise TP for Fp8BlockLinear (and nn.Linear): weight, scales and bias split along N.

    Input replicated (a DTensor is redistributed to Replicate); output this rank's N slice
    (``output_replicated=True``: all-gathered). Every rank must hold the same full module
    before (no data moves; each keeps its slice), or its slices (``already_local``).
    """

    kind = "colwise"

    def __init__(self, *, output_replicated: bool = False, already_local: bool = False, name: str = "module") -> None:
        super().__init__()
        self.output_replicated = output_replicated
        self.already_local = already_local
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self._check(module, device_mesh, self.name)
        _distribute_(module, module_param_shards(module, "colwise"), device_mesh, self.already_local)
        _install_linear(module, device_mesh, "colwise", True, self.output_replicated)
        module._fp8linear_tp = "colwise"
        return module


class Fp8RowwiseParallel(_Fp8Style, _parallel_style_base()):
    """Row-wise TP for Fp8BlockLinear (and nn.Linear): weight and scales split along K, bias replicated.

    Input: this rank's K slice (``input_replicated=True``: the full input, sliced here). The
    partial outputs are summed by an all-reduce in the output dtype, then the bias is added once.
    """

    kind = "rowwise"

    def __init__(self, *, input_replicated: bool = False, already_local: bool = False, name: str = "module") -> None:
        super().__init__()
        self.input_replicated = input_replicated
        self.already_local = already_local
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self._check(module, device_mesh, self.name)
        _distribute_(module, module_param_shards(module, "rowwise"), device_mesh, self.already_local)
        _install_linear(module, device_mesh, "rowwise", self.input_replicated, True)
        module._fp8linear_tp = "rowwise"
        return module


class Fp8ExpertsParallel(_Fp8Style, _parallel_style_base()):
    """TP for Fp8Experts as transformers' experts plan: gate_up packed colwise, down rowwise, output all-reduced."""

    kind = "experts"

    def __init__(self, *, already_local: bool = False, name: str = "module") -> None:
        super().__init__()
        self.already_local = already_local
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, _experts_cls()):
            raise TypeError(f"{self.name!r}: Fp8ExpertsParallel shards Fp8Experts, got {type(module).__name__}")
        self._check(module, device_mesh, self.name)
        _distribute_(module, module_param_shards(module, "experts"), device_mesh, self.already_local)
        _install_experts(module, device_mesh)
        module._fp8linear_tp = "experts"
        return module


# ----------------------------------------------------------------------------- plans
def _wildcard(name: str) -> str:
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _model_tp_plan(model: nn.Module, tp_plan: Any) -> dict[str, str]:
    if tp_plan == "auto":
        plan = getattr(model, "tp_plan", None)
        if not plan:
            raise ValueError(f"tp_plan='auto' needs a model with a tensor-parallel plan "
                             f"(transformers' base_model_tp_plan); {type(model).__name__} has none")
        return dict(plan)
    if isinstance(tp_plan, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items()):
        return dict(tp_plan)
    raise TypeError(f"tp_plan must be 'auto' or a dict {{module pattern: style name}}, got {tp_plan!r}")


def resolve_tp_plan(model: nn.Module, tp_plan: Any = "auto") -> dict[str, str]:
    """{module name: 'colwise' | 'colwise_rep' | 'rowwise' | 'rowwise_rep' | 'experts'} for the
    modules of `model` that the transformers-style `tp_plan` shards ('auto': the model's own).

    Module entries of the plan name linear layers; parameter entries under an experts module
    (``experts.gate_up_proj: packed_colwise``, ``experts.down_proj: rowwise``) go with its
    ``moe_tp_experts`` entry. Styles that keep a module whole (embeddings, ``replicate``) are
    left out. Any other style raises ValueError naming it.
    """
    plan = _model_tp_plan(model, tp_plan)
    experts_cls = _experts_cls()
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        style = plan.get(_wildcard(name))
        if style is None or style in _REPLICATED_STYLES:
            continue
        if isinstance(module, experts_cls):
            if style != _EXPERTS_STYLE:
                raise ValueError(f"{name!r} is an Fp8Experts module; its tp_plan style must be "
                                 f"{_EXPERTS_STYLE!r}, got {style!r}")
            up = plan.get(_wildcard(f"{name}.{module.up_name}"))
            down = plan.get(_wildcard(f"{name}.down_proj"))
            want_up = "packed_colwise" if module.has_gate else "colwise"
            if (up, down) != (want_up, "rowwise"):
                raise ValueError(
                    f"{name!r}: tp_plan shards the experts' {module.up_name} as {up!r} and down_proj as {down!r}; "
                    f"fp8linear supports {want_up!r} and 'rowwise' (transformers' experts plan)"
                )
            out[name] = "experts"
        elif style in _LINEAR_STYLES:
            if not isinstance(module, (Fp8BlockLinear, nn.Linear)):
                raise ValueError(f"tp_plan style {style!r} for {name!r}: expected a linear layer, got {type(module).__name__}")
            kind, input_rep, output_rep = _LINEAR_STYLES[style]
            out[name] = kind + ("_rep" if (kind == "colwise" and output_rep) or (kind == "rowwise" and input_rep) else "")
        elif style == _EXPERTS_STYLE:
            raise ValueError(f"tp_plan style {style!r} for {name!r}: expected an Fp8Experts module, "
                             f"got {type(module).__name__} (quantize the experts first)")
        else:
            raise ValueError(f"tp_plan style {style!r} (for {name!r}) is not supported by fp8linear's tensor "
                             f"parallelism; supported: {sorted(_LINEAR_STYLES) + [_EXPERTS_STYLE] + list(_REPLICATED_STYLES)}")
    return out


def _style_for(kind: str, name: str, already_local: bool = False) -> Any:
    if kind.startswith("colwise"):
        return Fp8ColwiseParallel(output_replicated=kind.endswith("_rep"), already_local=already_local, name=name)
    if kind.startswith("rowwise"):
        return Fp8RowwiseParallel(input_replicated=kind.endswith("_rep"), already_local=already_local, name=name)
    return Fp8ExpertsParallel(already_local=already_local, name=name)


def _default_mesh(mesh: Any) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(mesh, DeviceMesh):
        return mesh
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("tensor parallelism needs torch.distributed: run under torchrun "
                             "(or call torch.distributed.init_process_group first)")
        if torch.cuda.is_available():  # as torchrun's ranks expect: one GPU each, NCCL
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    tp = world if mesh is None else mesh
    if not isinstance(tp, int) or tp < 1 or world % tp:
        raise ValueError(f"tp must be a positive divisor of the world size {world}, got {mesh!r}")
    return init_device_mesh(_device_type(), (tp,))


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parallelize(model: nn.Module, mesh: Any = None, tp_plan: Any = "auto") -> nn.Module:
    """Shard a loaded model (the same weights on every rank) with ``parallelize_module``.

    `mesh`: a 1-D DeviceMesh, a tp size, or None (all ranks). `tp_plan`: 'auto' (the model's
    transformers plan) or a transformers-style dict. Every sharded layer is checked first, so a
    layer that cannot be split raises before any is changed.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _default_mesh(mesh)
    kinds = resolve_tp_plan(model, tp_plan)
    for name, kind in kinds.items():
        check_shardable(name, model.get_submodule(name), kind.split("_")[0], mesh.size())
    parallelize_module(model, mesh, {name: _style_for(kind, name) for name, kind in kinds.items()})
    _after_shard(model)
    return model


def _after_shard(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Fp8BlockLinear):
            module.init_split_k_counters()


# ----------------------------------------------------------------------------- transformers' own styles
def extend_hf_tp_plan(model: nn.Module, plan: dict[str, str], tp: int | None = None) -> None:
    """Adapt transformers' `plan` (in place) for a model holding fp8linear modules.

    Adds each scale's entry next to its weight's (``weight_scale_inv`` follows its layer, experts'
    ``P_scale_inv`` follow ``P``), marks the fp8linear modules to run transformers' styles on
    local tensors, and checks every sharded module splits on 128 boundaries for `tp` ranks (by
    default the current world size; ValueError naming the module otherwise). Per-tensor scales of
    sharded modules are refused: transformers quantizes each rank's slice as it loads, which would
    give every rank its own scale.
    """
    import torch.distributed as dist

    if tp is None:
        tp = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    experts_cls = _experts_cls()

    def refuse_per_tensor(name: str) -> None:
        # transformers quantizes each rank's slice as it loads: one scale per slice, not one per tensor.
        raise ValueError(
            f"{name!r}: per-tensor scales cannot be computed while loading under tp_plan (each rank would "
            "scale its own slice); use granularity 'block' or 'row', or save the quantized model and load it "
            "with fp8linear.integrations.transformers.from_pretrained(path, tp_plan='auto')"
        )

    for name, module in model.named_modules():
        generic = _wildcard(name)
        if isinstance(module, Fp8BlockLinear):
            style = plan.get(generic)
            if style is None:
                continue
            module._hf_quantized_needs_local_tp = True
            if style in _LINEAR_STYLES:
                check_shardable(name, module, _LINEAR_STYLES[style][0], tp)
            if module.weight_scale_inv.dim() < 2:
                if tp > 1 and style not in _REPLICATED_STYLES:
                    refuse_per_tensor(name)
                plan[f"{generic}.weight{SCALE_SUFFIX}"] = "replicate"
        elif isinstance(module, experts_cls):
            if plan.get(generic) is None:
                continue
            module._hf_quantized_needs_local_tp = True
            check_shardable(name, module, "experts", tp)
            if tp > 1 and module.down_proj_scale_inv.dim() < 3:
                refuse_per_tensor(name)
            for p in (module.up_name, "down_proj"):
                style = plan.get(f"{generic}.{p}")
                scale = getattr(module, p + SCALE_SUFFIX)
                if style is not None:
                    plan[f"{generic}.{p}{SCALE_SUFFIX}"] = style if scale.dim() == 3 else "replicate"


# ----------------------------------------------------------------------------- sharded loading
class TpLoad:
    """Per-rank loading of an FP8 checkpoint into a meta model under a tensor-parallel plan.

    Used by :func:`fp8linear.integrations.transformers.from_pretrained` with ``tp_plan=``:
    :meth:`localize` gives the sharded modules local-shaped meta parameters and an index whose
    shapes are the local ones; :meth:`read` reads only this rank's slice of a sharded tensor
    (``safe_open(...).get_slice``); :meth:`finish` makes the parameters DTensors and installs
    the forwards.
    """

    def __init__(self, model: nn.Module, tp_plan: Any = "auto", mesh: Any = None) -> None:
        self.mesh = _default_mesh(mesh)
        self.rank, self.tp, _ = _mesh_info(self.mesh)
        self.kinds = resolve_tp_plan(model, tp_plan)
        for name, kind in self.kinds.items():
            check_shardable(name, model.get_submodule(name), kind.split("_")[0], self.tp)
        self._by_param: dict[str, ParamShard] = {}
        self._by_file_name: dict[str, tuple[ParamShard, tuple[int, ...]]] = {}

    @property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        return torch.device(self.mesh.device_type)

    def localize(self, model: nn.Module, index: Any) -> Any:
        """Local-shaped meta parameters in the sharded modules; a CheckpointIndex with local shapes."""
        for name, kind in self.kinds.items():
            module = model.get_submodule(name)
            shards = module_param_shards(module, "experts" if kind == "experts" else kind.split("_")[0])
            for pname, spec in shards.items():
                p = module._parameters[pname]
                self._by_param[f"{name}.{pname}"] = spec
                if spec.kind != "replicate":
                    module._parameters[pname] = nn.Parameter(
                        torch.empty(spec.local_shape(tuple(p.shape), self.tp), dtype=p.dtype, device="meta"),
                        requires_grad=False,
                    )
            if kind == "experts":
                self._per_expert_specs(name, module, index)
        out = CheckpointIndex(index.root)
        for key, info in index.tensors.items():
            spec = self._by_param.get(key)
            if spec is not None and spec.kind != "replicate":
                if len(info.shape) <= spec.dim:
                    raise ValueError(f"checkpoint tensor {info.name!r} has shape {info.shape}, cannot shard it along dim {spec.dim}")
                self._by_file_name[info.name] = (spec, tuple(info.shape))
                info = TensorInfo(info.name, info.file, spec.local_shape(tuple(info.shape), self.tp), info.dtype)
            out.tensors[key] = info
        return out

    def _per_expert_specs(self, name: str, module: nn.Module, index: Any) -> None:
        """Experts stored one tensor per expert (gate/up (I, H), down (H, I)): gate and up split
        along their rows, down along its columns; per-tensor scales replicated."""
        for gate, up, down in EXPERT_NAME_SETS:
            for j in range(module.num_experts):
                for proj, dim in ((gate, 0), (up, 0), (down, 1)):
                    for suffix in ("weight", "weight" + SCALE_SUFFIX):
                        key = f"{name}.{j}.{proj}.{suffix}"
                        info = index.get(key)
                        if info is not None:
                            spec = ParamShard("shard", dim) if len(info.shape) == 2 else ParamShard("replicate")
                            self._by_param[key] = spec

    def read(self, info: Any, handle: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor `info` from an open safetensors `handle`."""
        entry = self._by_file_name.get(info.name)
        if entry is None:
            return handle.get_tensor(info.name)
        spec, shape = entry
        local = spec.take(handle.get_slice(info.name), shape, self.rank, self.tp)
        return local.to(self.device).contiguous()  # a no-op where the handle already put it there

    def finish(self, model: nn.Module) -> None:
        """DTensor parameters (from the local slices just loaded) and TP forwards on every sharded module."""
        for name, kind in self.kinds.items():
            _style_for(kind, name, already_local=True)._apply(model.get_submodule(name), self.mesh)
        _after_shard(model)
