"""FP8 fused mixture-of-experts: a drop-in replacement for transformers 5.x experts modules.

transformers 5.x keeps a MoE layer's routed experts in one module with 3-D parameters
(``DeepseekV3Experts``, ``DeepseekV2Experts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``,
``MixtralExperts``, ...): ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) (or their
transposes when the class is declared ``is_transposed``; ``up_proj`` instead of
``gate_up_proj`` for gate-less experts; optional ``*_bias``), an ``act_fn``, and
``forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``.

:class:`Fp8Experts` keeps one FP8 weight and one scale grid per expert, stored as the
checkpoint names them (parameter P and ``P_scale_inv``, always (E, out, in)), and runs:

1. quantize the T token rows once (1x128 per token);
2. one grouped FP8 GEMM launch for gate/up over all (token, expert) pairs;
3. the module's own gate (``act_fn(gate) * up``, or the class's ``_apply_gate``);
4. quantize, one grouped FP8 GEMM launch for down, routing weight applied in the epilogue;
5. sum of the top_k rows of each token in fp32.

On the Triton backend nothing synchronises with the host (CUDA-graph capturable) and the
GEMM is a ``torch.library`` custom op with a fake implementation (``torch.compile`` traces it).
The reference backend computes the same numerics in PyTorch with a loop over experts; CPU tensors
under "auto" run each hit expert's rows through the CPU FP8 linear
(:func:`fp8linear.ops.cpu_linear.cpu_fp8_linear`) in the same order of roundings.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..backend import device_guard, interpreting
from ..checkpoint_format import SCALE_SUFFIX
from ..formats import GROUP_SIZE, SCALE_DTYPE, check_granularity, is_fp8_dtype, resolve_fp8_dtype
from ..functional import (
    OUT_DTYPES,
    _check_tensor,
    dequantize_weight,
    grouped_fp8_matmul,
    moe_routing,
    quantize_activation,
    quantize_weight,
)
from ..module import QuantizedDtypesMixin
from ..ops.router import cpu_fast_path, resolve_backend
from ..reference import weight_granularity, weight_scale_shape

__all__ = [
    "Fp8Experts",
    "ExpertsLayout",
    "experts_layout",
    "is_fused_experts_module",
    "grouped_fp8_matmul",
]

# Experts quantized per chunk in from_experts: bounds the fp32 temporaries to a few experts.
_QUANT_CHUNK = 8


# ----------------------------------------------------------------------------- detection
@dataclass(frozen=True)
class ExpertsLayout:
    """How a transformers experts module stores its weights (read from the module at runtime)."""

    num_experts: int
    hidden_dim: int
    intermediate_dim: int
    has_gate: bool  # gate_up_proj (E, 2I, H) vs up_proj (E, I, H)
    has_bias: bool
    is_transposed: bool  # weights stored (E, in, out) instead of (E, out, in)
    custom_gate: bool  # the class defines its own _apply_gate
    has_post_expert_norm: bool

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"


def _param3d(module: nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) and t.dim() == 3 else None


def _forward_takes_routing(module: nn.Module) -> bool:
    """forward(hidden_states, top_k_index, top_k_weights): three positional inputs (or *args)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _has_custom_gate(module: nn.Module) -> bool:
    fn = getattr(type(module), "_apply_gate", None)
    return callable(fn) and getattr(fn, "__name__", "") != "_default_apply_gate"


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The storage layout of a fused experts module, or None if `module` is not one.

    Generic: looks for 3-D ``down_proj`` and ``gate_up_proj`` (or ``up_proj``) parameters with
    consistent shapes and a forward taking (hidden_states, top_k_index, top_k_weights). The
    ``is_transposed`` / ``has_gate`` / ``has_bias`` attributes that transformers' experts
    decorator sets are used when present and checked against the shapes; older classes without
    them are read from the shapes alone.
    """
    if not isinstance(module, nn.Module) or isinstance(module, Fp8Experts):
        return None
    down = _param3d(module, "down_proj")
    has_gate = _param3d(module, "gate_up_proj") is not None
    up = _param3d(module, "gate_up_proj" if has_gate else "up_proj")
    if down is None or up is None or up.shape[0] != down.shape[0]:
        return None
    if not (down.dtype.is_floating_point and up.dtype.is_floating_point) or is_fp8_dtype(down.dtype):
        return None
    if not _forward_takes_routing(module):
        return None
    g = 2 if has_gate else 1
    _, u1, u2 = up.shape
    _, d1, d2 = down.shape
    fits_plain = u2 == d1 and u1 == g * d2  # up (E, g*I, H), down (E, H, I)
    fits_transposed = u1 == d2 and u2 == g * d1  # up (E, H, g*I), down (E, I, H)
    declared = getattr(module, "is_transposed", None)
    if isinstance(declared, bool):
        if not (fits_transposed if declared else fits_plain):
            return None
        transposed = declared
    elif fits_plain and fits_transposed:  # only possible without a gate and H == I: trust hidden_dim if set
        hidden = getattr(module, "hidden_dim", getattr(module, "hidden_size", None))
        transposed = hidden == u1 and hidden != u2
    elif fits_plain or fits_transposed:
        transposed = fits_transposed
    else:
        return None
    hidden_dim, inter = (u1, d1) if transposed else (u2, d2)
    bias_name = "gate_up_proj_bias" if has_gate else "up_proj_bias"
    has_bias = isinstance(getattr(module, bias_name, None), torch.Tensor)
    return ExpertsLayout(
        num_experts=up.shape[0], hidden_dim=hidden_dim, intermediate_dim=inter, has_gate=has_gate,
        has_bias=has_bias, is_transposed=transposed, custom_gate=_has_custom_gate(module),
        has_post_expert_norm=bool(getattr(module, "has_post_expert_norm", False))
        and isinstance(getattr(module, "post_expert_norm", None), nn.Module),
    )


def is_fused_experts_module(module: nn.Module) -> bool:
    """True for a transformers-style fused experts module (3-D expert weights, routed forward)."""
    return experts_layout(module) is not None


def _shadow(module: nn.Module) -> nn.Module:
    """A parameter-free copy of `module` (same class, attributes and small submodules).

    Keeps the class's own gate (``_apply_gate`` and the attributes it reads, e.g. GPT-OSS
    alpha/limit) and lets `to_experts` rebuild the original class without knowing its config.
    """
    shadow = type(module).__new__(type(module))
    # Copy the per-instance dicts (hooks, buffers, submodules) so the copy never shares them.
    state = {k: (type(v)(v) if isinstance(v, dict) else v) for k, v in module.__dict__.items()}
    state["_parameters"] = {}
    shadow.__dict__.update(state)
    return shadow


# ----------------------------------------------------------------------------- module
class Fp8Experts(QuantizedDtypesMixin):
    """Routed MoE experts with FP8 weights, one grouped FP8 GEMM launch per projection.

    Parameters (checkpoint names; always stored (E, out, in), K contiguous):
      - ``gate_up_proj`` FP8 (E, 2I, H) and ``gate_up_proj_scale_inv`` fp32 (E, ...)
        (``up_proj`` / ``up_proj_scale_inv`` (E, I, H) for gate-less experts)
      - ``down_proj`` FP8 (E, H, I) and ``down_proj_scale_inv`` fp32 (E, ...)
      - ``gate_up_proj_bias`` (E, 2I) and ``down_proj_bias`` (E, H) when ``has_bias``
    Scale shapes per expert: 'block' (ceil(N/128), ceil(K/128)), 'row' (N, ceil(K/128)),
    'tensor' () -> (E,). forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        *,
        granularity: str = "block",
        act_fn: nn.Module | Callable[[torch.Tensor], torch.Tensor] | str | None = None,
        has_gate: bool = True,
        has_bias: bool = False,
        fp8_dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        check_granularity(granularity)
        for name, v in (("num_experts", num_experts), ("hidden_dim", hidden_dim), ("intermediate_dim", intermediate_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.has_gate = has_gate
        self.has_bias = has_bias
        self.is_transposed = False  # our storage is always (E, out, in)
        self.has_post_expert_norm = False
        self.backend = backend
        self._source: nn.Module | None = None  # parameter-free copy of the replaced module (not a submodule)
        self._source_transposed = False  # whether the replaced module stored (E, in, out)
        self.act_fn = _resolve_act(act_fn)

        up_out = (2 if has_gate else 1) * intermediate_dim
        for name, (n, k) in ((self.up_name, (up_out, hidden_dim)), ("down_proj", (hidden_dim, intermediate_dim))):
            w = torch.empty((num_experts, n, k), dtype=fp8_dtype, device=device)
            s = torch.ones(weight_scale_shape(w.shape, granularity), dtype=SCALE_DTYPE, device=device)
            self.register_parameter(name, nn.Parameter(w, requires_grad=False))
            self.register_parameter(f"{name}_scale_inv", nn.Parameter(s, requires_grad=False))
            bias = torch.zeros((num_experts, n), dtype=dtype, device=device) if has_bias else None
            self.register_parameter(f"{name}_bias", nn.Parameter(bias, requires_grad=False) if has_bias else None)
        self._plans: dict = {}  # input signature -> ExpertsPlan (eager GPU calls, see forward)
        self._seen: set = set()  # signatures run once without a plan

    # -- properties ---------------------------------------------------------------------------
    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"

    @property
    def granularity(self) -> str:
        return weight_granularity(self.down_proj.shape, self.down_proj_scale_inv.shape)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.down_proj.dtype

    # -- conversion ---------------------------------------------------------------------------
    @classmethod
    def from_experts(
        cls,
        module: nn.Module,
        granularity: str = "block",
        fp8_dtype: torch.dtype | str | None = None,
        backend: str | None = None,
    ) -> "Fp8Experts":
        """Quantize a transformers fused experts module (on its own device; meta gives an empty shell)."""
        layout = experts_layout(module)
        if layout is None:
            raise TypeError(
                "from_experts expects a fused experts module with 3-D gate_up_proj/up_proj and down_proj "
                f"parameters and forward(hidden_states, top_k_index, top_k_weights), got {type(module).__name__}"
            )
        check_granularity(granularity)
        up_src = getattr(module, layout.up_name)
        device = up_src.device
        fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
        mod = cls(
            layout.num_experts, layout.hidden_dim, layout.intermediate_dim, granularity=granularity,
            act_fn=getattr(module, "act_fn", None), has_gate=layout.has_gate, has_bias=layout.has_bias,
            fp8_dtype=fp8_dtype, device="meta", dtype=up_src.dtype, backend=backend,
        )
        object.__setattr__(mod, "_source", _shadow(module))  # kept out of submodules and state_dict
        mod._source_transposed = layout.is_transposed
        if hasattr(module, "config"):
            mod.config = module.config
        if layout.has_post_expert_norm:
            mod.has_post_expert_norm = True
            mod.post_expert_norm = module.post_expert_norm
        for name in (layout.up_name, "down_proj"):
            src = getattr(module, name).detach()
            if layout.is_transposed:
                src = src.transpose(1, 2)
            if device.type == "meta":
                w_q = torch.empty(src.shape, dtype=fp8_dtype, device=device)
                w_s = torch.ones(weight_scale_shape(src.shape, granularity), dtype=SCALE_DTYPE, device=device)
            else:
                parts = [
                    quantize_weight(src[i : i + _QUANT_CHUNK].contiguous(), granularity, fp8_dtype)
                    for i in range(0, src.shape[0], _QUANT_CHUNK)
                ]
                w_q = torch.cat([p[0] for p in parts])
                w_s = torch.cat([p[1] for p in parts])
            setattr(mod, name, nn.Parameter(w_q, requires_grad=False))
            setattr(mod, f"{name}_scale_inv", nn.Parameter(w_s, requires_grad=False))
            if layout.has_bias:
                bias = getattr(module, f"{name}_bias").detach().clone()
                setattr(mod, f"{name}_bias", nn.Parameter(bias, requires_grad=False))
        return mod

    # -- checkpoint layouts -------------------------------------------------------------------
    def _up_granularity(self) -> str:
        # Of gate_up_proj itself: a (E, 1, 1) grid reads as per-tensor, whatever down_proj's says.
        return weight_granularity(getattr(self, self.up_name).shape, getattr(self, f"{self.up_name}_scale_inv").shape)

    def per_expert_layout_problem(self) -> str | None:
        """Why the per-expert checkpoint layout cannot hold this module's FP8 bytes and scales exactly.

        ``None`` when it can: gate and up of expert ``j`` are rows ``[:I]`` and ``[I:]`` of
        ``gate_up_proj[j]``, and their scales are the matching rows of the scale grid -- always for
        row-wise scales, for 128x128 blocks when ``I`` is a multiple of 128, and for per-tensor
        scales (gate and up both get the expert's one scale).
        """
        if not self.has_gate:
            return "gate-less experts (up_proj) have no per-expert gate/up names"
        if self.has_bias:
            return "experts with biases have no per-expert layout here"
        if self._up_granularity() == "block" and self.intermediate_dim % GROUP_SIZE:
            return (
                f"a 128x128 scale block straddles the gate/up boundary (intermediate size {self.intermediate_dim} "
                f"is not a multiple of {GROUP_SIZE})"
            )
        return None

    def per_expert_state(self, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
        """This module's tensors in the per-expert layout of official DeepSeek-V3 FP8 checkpoints.

        ``{"J.gate.weight": FP8 (I, H), "J.gate.weight_scale_inv": fp32, ..., "J.down.weight": FP8 (H, I), ...}``
        for each expert ``J`` with ``names = (gate, up, down)``: the weights are views of this
        module's (no copy), the scales small copies; exactly its bytes and scales. ValueError when
        :meth:`per_expert_layout_problem` says the layout cannot hold them.
        """
        problem = self.per_expert_layout_problem()
        if problem is not None:
            raise ValueError(f"per-expert layout cannot hold these experts exactly: {problem}")
        if not (isinstance(names, tuple) and len(names) == 3 and all(isinstance(n, str) and n for n in names)):
            raise TypeError(f"names must be a tuple of 3 projection names (gate, up, down), got {names!r}")
        gate_n, up_n, down_n = names
        inter = self.intermediate_dim
        gran = self._up_granularity()
        split = inter // GROUP_SIZE if gran == "block" else inter  # scale-grid rows of the gate
        gu_w, gu_s = self.gate_up_proj.detach(), self.gate_up_proj_scale_inv.detach()
        dn_w, dn_s = self.down_proj.detach(), self.down_proj_scale_inv.detach()
        out: dict[str, torch.Tensor] = {}
        for j in range(self.num_experts):
            if gran == "tensor":
                gate_s = up_s = gu_s[j]
            else:
                gate_s, up_s = gu_s[j, :split], gu_s[j, split:]
            for proj, w, s in (
                (gate_n, gu_w[j, :inter], gate_s), (up_n, gu_w[j, inter:], up_s), (down_n, dn_w[j], dn_s[j]),
            ):
                out[f"{j}.{proj}.weight"] = w
                out[f"{j}.{proj}.weight{SCALE_SUFFIX}"] = s.clone()  # small; distinct storage per name
        return out

    def dequantized_weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """{'gate_up_proj' (or 'up_proj'): (E, out, in), 'down_proj': (E, H, I)} dequantized to `dtype`."""
        return {
            name: dequantize_weight(getattr(self, name), getattr(self, f"{name}_scale_inv"), dtype)
            for name in (self.up_name, "down_proj")
        }

    def to_experts(self, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
        """A high-precision experts module with the dequantized weights.

        The original transformers class (same attributes, layout and gate) when this module came
        from :meth:`from_experts`; otherwise a plain eager experts module of the same interface.
        """
        weights = self.dequantized_weights(dtype)
        if self._source is not None:
            out = _shadow(self._source)
            transposed = self._source_transposed
        else:
            out = _EagerExperts(self.act_fn, self.has_gate)
            transposed = False
        for name, w in weights.items():
            out.register_parameter(name, nn.Parameter(w.transpose(1, 2).contiguous() if transposed else w))
            if self.has_bias:
                out.register_parameter(f"{name}_bias", nn.Parameter(getattr(self, f"{name}_bias").detach().to(dtype)))
        return out

    # -- forward ------------------------------------------------------------------------------
    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        if self._source is not None and _has_custom_gate(self._source):
            return self._source._apply_gate(h)
        if not self.has_gate:
            return self.act_fn(h)
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Eagerly on a GPU, an input signature's second call keeps an
        :class:`~fp8linear.ops.experts_plan.ExpertsPlan` (decisions made once, kernels launched
        directly, the same bits), which later calls of that signature run."""
        plans = self.__dict__.get("_plans")
        if plans and not torch.compiler.is_compiling():
            plan = plans.get(_signature(hidden_states, top_k_index, top_k_weights))
            if plan is not None and _plannable_inputs(hidden_states, top_k_index, top_k_weights):
                return plan(hidden_states.view(plan.t, self.hidden_dim), top_k_index, top_k_weights).view(
                    hidden_states.shape)
        if torch.compiler.is_compiling():
            return self._forward_checked(hidden_states, top_k_index, top_k_weights)
        with device_guard(hidden_states.device):  # Triton launches on the current device: make it the input's
            return self._forward_checked(hidden_states, top_k_index, top_k_weights)

    def clear_plans(self) -> None:
        """Forget the kept launch plans (done on parameter replacement, loading and moves; call it after
        swapping a parameter's ``.data`` or ``_parameters`` entry by other means: plans hold the
        tensors they were made with)."""
        self.__dict__.get("_plans", {}).clear()
        self.__dict__.get("_seen", set()).clear()
        self.__dict__.get("_cpu_prepared", {}).clear()  # the CPU path's prepared expert weights

    def __setattr__(self, name: str, value) -> None:
        if "_plans" in self.__dict__ and (name in _EXPERTS_PLANNED_FROM or isinstance(value, (torch.Tensor, nn.Module))):
            self.clear_plans()
        super().__setattr__(name, value)

    def __getstate__(self):
        return {**super().__getstate__(), "_plans": {}, "_seen": set(), "_cpu_prepared": {}}

    def _apply(self, fn, recurse=True):
        self.clear_plans()
        return super()._apply(fn, recurse)

    def _plan_or_none(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, backend: str):
        """On an eligible call's second sight, the plan for its signature (which runs this call)."""
        if torch.compiler.is_compiling():  # traced: the custom ops, no plans
            return None
        on_gpu = x.device.type == "cuda"
        if (backend != "triton" or not (on_gpu or interpreting()) or self.has_post_expert_norm
                or not _plannable_inputs(x, top_k_index, top_k_weights) or (on_gpu and torch.cuda.is_current_stream_capturing())):
            return None
        key = _signature(x, top_k_index, top_k_weights)
        seen = self.__dict__.setdefault("_seen", set())
        if key not in seen:
            if len(seen) >= MAX_EXPERT_PLANS:
                seen.clear()
            seen.add(key)
            return None
        from ..ops.experts_plan import ExpertsPlan

        plans = self.__dict__.setdefault("_plans", {})
        if len(plans) >= MAX_EXPERT_PLANS:
            del plans[next(iter(plans))]
        dtype = x.dtype
        up = self.up_name
        # the plan reaches this module through a weak reference: a strong one would make a cycle
        # (module -> plans -> plan -> module) that keeps the experts' weights allocated after the
        # model is deleted, until Python's cyclic garbage collector happens to run
        module = weakref.ref(self)
        plan = plans[key] = ExpertsPlan(
            x.view(-1, self.hidden_dim), top_k_index, top_k_weights,
            getattr(self, up), getattr(self, f"{up}_scale_inv"), getattr(self, f"{up}_bias"),
            self.down_proj, self.down_proj_scale_inv, self.down_proj_bias, self.granularity,
            lambda h: module()._gate(h).to(dtype))
        return plan

    def _forward_checked(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        _check_tensor("hidden_states", hidden_states)
        _check_tensor("top_k_index", top_k_index)
        _check_tensor("top_k_weights", top_k_weights)
        if hidden_states.dtype not in OUT_DTYPES:
            raise TypeError(f"hidden_states must be bfloat16, float16 or float32, got {hidden_states.dtype}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(f"hidden_states must have shape (..., H={self.hidden_dim}), got {tuple(hidden_states.shape)}")
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, self.hidden_dim)
        t = x.shape[0]
        if top_k_index.dim() != 2 or top_k_index.shape[0] != t:
            raise ValueError(f"top_k_index must have shape (T={t}, top_k), got {tuple(top_k_index.shape)}")
        if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
            raise ValueError(
                f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)}"
            )
        if not is_fp8_dtype(self.down_proj.dtype):
            raise TypeError(f"Fp8Experts weights must be FP8, got {self.down_proj.dtype}")
        top_k = top_k_index.shape[1]
        if cpu_fast_path(self.backend, x.device):
            return self._forward_cpu(x, top_k_index, top_k_weights).reshape(*lead, self.hidden_dim)
        backend = resolve_backend(self.backend, x.device)
        dtype = x.dtype
        plan = self._plan_or_none(hidden_states, top_k_index, top_k_weights, backend)
        if plan is not None:
            return plan.first_output().reshape(*lead, self.hidden_dim)
        w_up, w_down = getattr(self, self.up_name), self.down_proj
        routing = None
        if backend == "triton":
            from ..ops.router import grouped_config

            # block_m depends only on pairs per expert, so one routing serves both GEMMs.
            block_m = grouped_config(t * top_k, self.num_experts, w_up.shape[1], self.hidden_dim).block_m
            routing = moe_routing(top_k_index, self.num_experts, block_m)

        x_q, x_s = quantize_activation(x, fp8_dtype=self.fp8_dtype, backend=backend)
        h = grouped_fp8_matmul(
            x_q, x_s, w_up, getattr(self, f"{self.up_name}_scale_inv"), top_k_index, dtype,
            per_token_rows=True, bias=getattr(self, f"{self.up_name}_bias"), backend=backend, _routing=routing,
        )
        h = self._gate(h)
        h_q, h_s = quantize_activation(h.to(dtype), fp8_dtype=self.fp8_dtype, backend=backend)
        fuse_weights = not self.has_post_expert_norm
        y = grouped_fp8_matmul(
            h_q, h_s, w_down, self.down_proj_scale_inv, top_k_index, dtype,
            per_token_rows=False, bias=self.down_proj_bias,
            topk_weights=top_k_weights if fuse_weights else None, backend=backend, _routing=routing,
        )
        if not fuse_weights:
            y = self.post_expert_norm(y)
            y = (y.float() * top_k_weights.reshape(-1, 1).float()).to(dtype)
        out = y.view(t, top_k, self.hidden_dim).sum(dim=1, dtype=torch.float32)
        return out.to(dtype).reshape(*lead, self.hidden_dim)

    def _forward_cpu(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """CPU tensors under "auto": per expert that has pairs, its tokens' rows through the CPU FP8
        linear (:func:`fp8linear.ops.cpu_linear.cpu_fp8_linear`: weight decoded in cache, no
        dequantized copy), in the grouped path's order of roundings: gate/up output in x's dtype, the
        gate, down output in fp32 times the routing weight, then x's dtype, the top_k rows summed in fp32.
        Where :func:`~fp8linear.ops.router.cpu_experts_in_parallel` says so, the hit experts run side
        by side on the intra-op threads, each linear one compiled-kernel call."""
        from ..ops import router
        from ..ops.cpu_linear import cpu_fp8_linear, prepared_in
        from ..ops.cpu_native import native_kernel, run_split

        t, top_k = top_k_index.shape
        dtype, num_experts, granularity = x.dtype, self.num_experts, self.granularity
        up = self.up_name
        w_up, s_up, b_up = getattr(self, up), getattr(self, f"{up}_scale_inv"), getattr(self, f"{up}_bias")
        w_down, s_down, b_down = self.down_proj, self.down_proj_scale_inv, self.down_proj_bias
        up_granularity = weight_granularity(w_up.shape[1:], s_up.shape[1:])
        prepared = self.__dict__.setdefault("_cpu_prepared", {})
        fuse_weights = not self.has_post_expert_norm
        pair_expert = top_k_index.reshape(-1).long()
        valid = (pair_expert >= 0) & (pair_expert < num_experts)  # other ids: zero rows, as the grouped GEMM
        order = torch.argsort(torch.where(valid, pair_expert, num_experts), stable=True)
        counts = torch.bincount(pair_expert[valid], minlength=num_experts).tolist()
        weights = top_k_weights.reshape(-1)
        y = torch.zeros(t * top_k, self.hidden_dim, dtype=dtype)
        hits = []  # (expert, its pairs, its prepared gate/up and down weights), made on this thread
        start = 0
        for e, count in enumerate(counts):
            if count:
                hits.append((e, order[start:start + count],
                             prepared_in(prepared, (up, e), w_up[e], s_up[e], up_granularity),
                             prepared_in(prepared, ("down_proj", e), w_down[e], s_down[e], granularity)))
                start += count
        expert_elems = max(w_up.shape[1] * w_up.shape[2], w_down.shape[1] * w_down.shape[2])
        parallel = (router.cpu_experts_in_parallel(max(counts, default=0), len(hits), expert_elems)
                    and native_kernel() is not None)

        def expert_rows(e: int, pairs: torch.Tensor, p_up, p_down) -> torch.Tensor:
            h = cpu_fp8_linear(x.index_select(0, pairs // top_k), w_up[e], s_up[e], up_granularity,
                               None if b_up is None else b_up[e], prepared=p_up, whole=parallel)
            h = self._gate(h).to(dtype)
            b_e = None if b_down is None else b_down[e]
            if fuse_weights:  # fp32 sums + bias, times the routing weight, then rounded once
                ye = cpu_fp8_linear(h.float(), w_down[e], s_down[e], granularity, b_e, prepared=p_down,
                                    whole=parallel)
                return (ye * weights.index_select(0, pairs).float()[:, None]).to(dtype)
            return cpu_fp8_linear(h, w_down[e], s_down[e], granularity, b_e, prepared=p_down, whole=parallel)

        if parallel:  # whole experts side by side on the intra-op threads
            outs = run_split([partial(expert_rows, *hit) for hit in hits])
        else:
            outs = [expert_rows(*hit) for hit in hits]
        for (e, pairs, _, _), ye in zip(hits, outs):
            y.index_copy_(0, pairs, ye)
        if not fuse_weights:
            y = self.post_expert_norm(y)
            y = (y.float() * weights.reshape(-1, 1).float()).to(dtype)
        return y.view(t, top_k, self.hidden_dim).sum(dim=1, dtype=torch.float32).to(dtype)

    # -- state dict ---------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # A checkpoint of another granularity: adopt its scale shape when it fits the weight.
        for name in (self.up_name, "down_proj"):
            key = f"{prefix}{name}_scale_inv"
            incoming = state_dict.get(key)
            current = getattr(self, f"{name}_scale_inv")
            if isinstance(incoming, torch.Tensor) and incoming.shape != current.shape:
                try:
                    weight_granularity(getattr(self, name).shape, incoming.shape)
                except ValueError:
                    continue  # let the default loader report the mismatch
                setattr(self, f"{name}_scale_inv", nn.Parameter(
                    torch.empty(incoming.shape, dtype=SCALE_DTYPE, device=current.device), requires_grad=False
                ))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self.clear_plans()

    def extra_repr(self) -> str:
        act = type(self.act_fn).__name__ if isinstance(self.act_fn, nn.Module) else getattr(self.act_fn, "__name__", "?")
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"{self.up_name}={tuple(getattr(self, self.up_name).shape)}, granularity={self.granularity}, "
            f"fp8_dtype={str(self.fp8_dtype).removeprefix('torch.')}, has_bias={self.has_bias}, act_fn={act}"
        )


# Attributes a plan was made from (besides tensors and submodules, which clear the plans too).
_EXPERTS_PLANNED_FROM = frozenset(("backend", "has_post_expert_norm", "act_fn", "has_gate", "has_bias",
                                   "hidden_dim", "intermediate_dim", "num_experts"))
# Input signatures (shapes and dtypes) an Fp8Experts keeps plans for (the oldest is dropped): decode
# batch sizes and prefill chunk lengths. A plan holds no GPU memory.
MAX_EXPERT_PLANS = 64


def _signature(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> tuple:
    return (x.shape, x.dtype, x.device, top_k_index.shape, top_k_index.dtype, top_k_weights.shape, top_k_weights.dtype)


def _plannable_inputs(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
    """Inputs a plan's direct launches read as they are: contiguous, 16-byte aligned, not empty."""
    return (x.numel() > 0 and x.is_contiguous() and top_k_index.is_contiguous() and top_k_weights.is_contiguous()
            and x.data_ptr() % 16 == 0 and top_k_index.data_ptr() % 16 == 0 and top_k_weights.data_ptr() % 16 == 0)


def _resolve_act(act_fn: nn.Module | Callable | str | None) -> nn.Module | Callable:
    if act_fn is None:
        return nn.SiLU()
    if isinstance(act_fn, str):
        try:
            from transformers.activations import ACT2FN
        except ImportError as exc:
            raise ValueError(f"act_fn={act_fn!r} given by name needs transformers installed") from exc
        if act_fn not in ACT2FN:
            raise ValueError(f"unknown act_fn {act_fn!r}; expected a transformers ACT2FN name such as 'silu'")
        return ACT2FN[act_fn]
    if not callable(act_fn):
        raise TypeError(f"act_fn must be an nn.Module, a callable or a name, got {type(act_fn).__name__}")
    return act_fn


class _EagerExperts(nn.Module):
    """Plain high-precision experts with transformers' interface (for to_experts without a source class)."""

    def __init__(self, act_fn: nn.Module | Callable, has_gate: bool) -> None:
        super().__init__()
        self.act_fn = act_fn
        self.has_gate = has_gate

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        up = self.gate_up_proj if self.has_gate else self.up_proj
        up_bias = getattr(self, "gate_up_proj_bias" if self.has_gate else "up_proj_bias", None)
        down_bias = getattr(self, "down_proj_bias", None)
        out = torch.zeros_like(hidden_states)
        for e in range(up.shape[0]):
            token, slot = (top_k_index == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            h = nn.functional.linear(hidden_states[token], up[e], None if up_bias is None else up_bias[e])
            if self.has_gate:
                gate, u = h.chunk(2, dim=-1)
                h = self.act_fn(gate) * u
            else:
                h = self.act_fn(h)
            y = nn.functional.linear(h, self.down_proj[e], None if down_bias is None else down_bias[e])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out
