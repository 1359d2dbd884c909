"""`Fp8BlockLinear`: an nn.Linear with FP8 weights and fine-grained dequant scales."""

from __future__ import annotations

import sys

import torch
from torch import nn

from .backend import device_guard
from .formats import SCALE_DTYPE, check_granularity, is_fp8_dtype, resolve_fp8_dtype
from .functional import dequantize_weight, fp8_linear, quantize_weight, validate_linear
from .ops import HAS_TRITON
from .ops.router import cpu_fast_path, cublas_allowed, resolve_backend
from .reference import weight_granularity, weight_scale_shape

__all__ = ["Fp8BlockLinear", "QuantizedDtypesMixin", "share_input_quantization"]

# Plans an Fp8BlockLinear keeps (one per input shape and dtype; the oldest is dropped to make room):
# serving meets a few dozen shapes (decode batch sizes, prefill chunks), and transformers' DeepSeek
# attention one per generated position (kv_b_proj over the whole cached sequence), which repeated
# generations of one length meet again. A plan holds no GPU memory, a few KB of host memory.
MAX_PLANS = 256
# Input signatures a GPU layer remembers having seen once (a plan is made on the second call of a
# shape, see Fp8BlockLinear): shapes that never come back, such as that whole-sequence projection
# in a single generation, then cost a routed call each instead of a plan each.
MAX_SEEN = 1024
# Attributes whose replacement makes the plans stale.
_PLANNED_FROM = frozenset(("weight", "weight_scale_inv", "bias", "backend"))
# Pointer alignment a planned launch relies on (fp8linear.ops.launch.ALIGN).
_ALIGN = 16


def _mark_static_address(t: torch.Tensor) -> None:
    """`torch._dynamo.mark_static_address(t)`, without importing Dynamo (1 s) where nothing has.

    A plain tensor attribute that torch.compile lifts into a graph is not a parameter or buffer,
    so CUDA-graph trees would copy it into a static buffer before every replay: one copy launch
    per layer per decode step. Marked static, the graph reads it where it is. (Dynamo reads the
    mark when it traces; mark_static_address itself only sets this attribute, tested against
    the installed torch in tests/core/test_module.py.)
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.mark_static_address(t)
    else:
        t._dynamo_static_input_type = "unguarded"


class QuantizedDtypesMixin(nn.Module):
    """`.to(dtype)`, `.half()`, `.float()` leave FP8 weights and fp32 `*_scale_inv` alone.

    nn.Module casts every floating-point parameter, FP8 included: fp8 -> bf16 would silently
    dequantize without the scales. Device moves still apply.
    """

    def _apply(self, fn, recurse=True):
        protected = {
            id(p)
            for name, p in self._parameters.items()
            if p is not None and (is_fp8_dtype(p.dtype) or name.endswith("scale_inv"))
        }

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) in protected and isinstance(out, torch.Tensor) and out.dtype != t.dtype:
                out = t.to(device=out.device)
            return out

        return super()._apply(keep_dtype, recurse)


class Fp8BlockLinear(QuantizedDtypesMixin):
    """Linear layer y = x @ dequant(weight).T + bias with FP8 weights.

    Parameters (the DeepSeek-V3 / HF ``quant_method: "fp8"`` names):
      - ``weight``: FP8 (out_features, in_features)
      - ``weight_scale_inv``: fp32 dequant multipliers, shape per granularity:
        'block' (ceil(N/128), ceil(K/128)), 'row' (N, ceil(K/128)), 'tensor' ()
      - ``bias``: optional, high precision

    Activations are quantized on the fly per token in 1x128 groups. The granularity is
    read from the scale's shape, so loading a state dict of another granularity just works.
    Decode-sized GEMMs count their split-K tiles in small counters the layer keeps (which
    spares a memset launch per call), so one layer must not run on two streams at the same time.

    In eager mode on a GPU, a call with an input of a new shape and dtype validates it and runs
    the route the router (:mod:`fp8linear.ops.router`) picks for it; the second call of that shape
    also keeps a launch plan (:class:`fp8linear.ops.linear.LinearPlan`), and later calls run the
    plan directly (a dictionary lookup, two allocations, one or two kernel launches), bit-identical
    to the first ones (same route). The backend choice,
    including ``FP8LINEAR_BACKEND`` and ``FP8LINEAR_PDL``, is read when a plan is made. Plans are
    dropped when the weight, scales, bias or backend are replaced, a state dict is loaded or the
    layer moves (:meth:`clear_plans` does it by hand).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        granularity: str = "block",
        device: torch.device | str | None = None,
        fp8_dtype: torch.dtype | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        check_granularity(granularity)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=fp8_dtype, device=device), requires_grad=False
        )
        scale_shape = weight_scale_shape((out_features, in_features), granularity)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(scale_shape, dtype=SCALE_DTYPE, device=device), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # Split-K tile counters for decode GEMMs (fp8linear.ops.splitk_gemm.splitk_counters): a
        # plain attribute, not a buffer (never saved, never filled from a checkpoint or by
        # `to_empty`), made zeroed on the weight's device (see init_split_k_counters).
        self._split_k_counters: torch.Tensor | None = None
        self._plans: dict = {}
        self._seen: set = set()  # input signatures run once without a plan (GPU)
        self._cublas_linear = None  # the cuBLAS route for any M, shared by the cuBLAS plans (see _cublas_runner)
        self._input_share = None  # its sibling group's SharedActivations (see set_input_share)
        self.init_split_k_counters()

    @property
    def granularity(self) -> str:
        return weight_granularity(self.weight.shape, self.weight_scale_inv.shape)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.weight.dtype

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        granularity: str = "block",
        fp8_dtype: torch.dtype | str | None = None,
        backend: str | None = None,
    ) -> "Fp8BlockLinear":
        """Quantize an nn.Linear (on its own device); the bias keeps its dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.device.type == "meta":
            raise ValueError("from_linear needs a materialised nn.Linear, got one on the meta device")
        fp8_dtype = resolve_fp8_dtype(fp8_dtype, w.device)
        w_q, w_s = quantize_weight(w, granularity, fp8_dtype)
        return cls.from_quantized(w_q, w_s, linear.bias, backend=backend)

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        weight_scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> "Fp8BlockLinear":
        """A layer holding given FP8 `weight` (N, K) and its scales (any granularity) and optional bias."""
        if not isinstance(weight, torch.Tensor) or not is_fp8_dtype(weight.dtype) or weight.dim() != 2:
            got = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise TypeError(f"weight must be a 2-D FP8 tensor, got {got}")
        if not isinstance(weight_scale_inv, torch.Tensor) or weight_scale_inv.dtype != SCALE_DTYPE:
            got = weight_scale_inv.dtype if isinstance(weight_scale_inv, torch.Tensor) else type(weight_scale_inv).__name__
            raise TypeError(f"weight_scale_inv must be a {SCALE_DTYPE} tensor, got {got}")
        granularity = weight_granularity(weight.shape, weight_scale_inv.shape)  # ValueError if none fits
        n, k = weight.shape
        if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
            raise ValueError(f"bias must be a float tensor of shape ({n},), got {bias.dtype} {tuple(bias.shape)}")
        mod = cls(k, n, bias=bias is not None, granularity=granularity, device="meta", fp8_dtype=weight.dtype, backend=backend)
        mod.weight = nn.Parameter(weight.detach(), requires_grad=False)
        mod.weight_scale_inv = nn.Parameter(weight_scale_inv.detach().to(weight.device), requires_grad=False)
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone().to(weight.device), requires_grad=False)
        mod.init_split_k_counters()
        return mod

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.dtype != self.weight.dtype:
            # Parameter.copy_ would convert values (e4m3fn 448 is NaN in fnuz): refuse instead.
            raise TypeError(
                f"{prefix}weight is {weight.dtype} but this module holds {self.weight.dtype}; "
                "convert with fp8linear.e4m3fn_to_e4m3fnuz or build the module with that fp8_dtype"
            )
        scale = state_dict.get(prefix + "weight_scale_inv")
        if scale is not None and scale.shape != self.weight_scale_inv.shape:
            weight_granularity(self.weight.shape, scale.shape)  # ValueError unless a valid granularity
            self.weight_scale_inv = nn.Parameter(
                torch.empty(scale.shape, dtype=SCALE_DTYPE, device=self.weight_scale_inv.device), requires_grad=False
            )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self.clear_plans()

    def to_linear(self, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
        """A dequantized nn.Linear with the same weights (up to FP8 rounding) and bias."""
        lin = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=dtype
        )
        lin.weight = nn.Parameter(dequantize_weight(self.weight, self.weight_scale_inv, dtype))
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().to(dtype).clone())
        return lin

    def __setattr__(self, name: str, value) -> None:
        if name in _PLANNED_FROM and "_plans" in self.__dict__:
            self.clear_plans()
        super().__setattr__(name, value)

    def __getstate__(self):
        # Plans hold closures and compiled kernels: neither pickles nor deep-copies; a copy makes its own.
        # A sibling group copies as a new empty group (SharedActivations.__reduce__), one per copy.
        state = super().__getstate__()
        return {**state, "_plans": {}, "_seen": set(), "_cublas_linear": None, "_row_scale_n_major": None}

    def set_input_share(self, share) -> None:
        """Join a group of linears that may be called on the same input tensor (the q / k / v
        projections of one attention layer): their eager GPU plans quantize such an input once and
        share it (:class:`fp8linear.ops.linear.SharedActivations`; None leaves the group).
        :func:`share_input_quantization` groups a model's linears."""
        from .ops.linear import SharedActivations

        if share is not None and not isinstance(share, SharedActivations):
            raise TypeError(f"set_input_share takes a fp8linear.ops.linear.SharedActivations or None, "
                            f"got {type(share).__name__}")
        self.__dict__["_input_share"] = share
        self.clear_plans()

    def clear_plans(self) -> None:
        """Forget the launch plans (done on replacement, loading and moves; call it after changing
        ``weight_scale_inv`` in place by other means: a cuBLAS plan holds it in cuBLAS's layout,
        1x128 scales are also held N-major, and a plan on CUTLASS's 64-column tiles holds it per 64 rows)."""
        self._plans.clear()
        self.__dict__.setdefault("_seen", set()).clear()
        self.__dict__["_cublas_linear"] = None  # holds the weight scale in cuBLAS's layout
        self.__dict__["_row_scale_n_major"] = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.clear_plans()
        self.init_split_k_counters()  # made again, zeroed, where the weight now lives
        return out

    def init_split_k_counters(self) -> None:
        """(Re)make this layer's split-K counters, zeroed, on the weight's device.

        Done on construction, `from_linear`, device moves and by the loaders in
        :mod:`fp8linear.integrations`; otherwise the first eager forward makes them. A layer that
        torch.compile traces before it has them zeroes fresh counters in every call instead.
        """
        self._split_k_counters = None
        self._counters()

    def _counters(self) -> torch.Tensor | None:
        """This layer's split-K counters, made (zeroed) if missing; None where none can be made
        here (no Triton, a meta weight, while torch.compile traces or a CUDA graph is captured:
        those calls zero fresh counters as plain `fp8_linear` does)."""
        ws = self._split_k_counters
        device = self.weight.device
        if ws is not None and ws.device == device:
            return ws
        if not HAS_TRITON or device.type == "meta" or torch.compiler.is_compiling():
            return None
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        from .ops.splitk_gemm import splitk_counters

        self._split_k_counters = ws = splitk_counters(self.weight.shape[0], device)
        _mark_static_address(ws)
        return ws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the custom ops, no plans
            return self._forward_validated(x)
        plan = self._plans.get((x.shape, x.dtype, x.device))
        if plan is not None and x.is_contiguous() and x.data_ptr() % _ALIGN == 0:
            return plan(x)
        with device_guard(x.device):  # Triton launches on the current device: make it x's
            return self._forward_and_plan(x)

    def _forward_validated(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fp8_dtype(self.weight.dtype):
            raise TypeError(f"Fp8BlockLinear.weight must be FP8, got {self.weight.dtype}")
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, backend=self.backend,
                          counters=self._counters())

    def _forward_and_plan(self, x: torch.Tensor) -> torch.Tensor:
        """The validated forward; where our Triton kernels or the CPU path run it, through a plan it
        keeps for x's shape (on a GPU from the shape's second call; the CPU plan, a closure, from
        the first). A plan computes what the calls before it did (the same route)."""
        weight = self.weight
        if (x.device.type == "cpu" and x.numel() and x.is_contiguous() and x.data_ptr() % _ALIGN == 0
                and is_fp8_dtype(weight.dtype) and cpu_fast_path(self.backend, x.device)):
            granularity = validate_linear(x, weight, self.weight_scale_inv, self.bias, None)
            if len(self._plans) >= MAX_PLANS:
                del self._plans[next(iter(self._plans))]  # the oldest
            plan = self._plans[(x.shape, x.dtype, x.device)] = self._make_cpu_plan(x, granularity)
            return plan(x)
        if not (HAS_TRITON and x.numel() and x.is_contiguous() and x.data_ptr() % _ALIGN == 0
                and weight.is_contiguous() and is_fp8_dtype(weight.dtype)
                and resolve_backend(self.backend, x.device) == "triton"):
            return self._forward_validated(x)
        counters = self._counters()
        validate_linear(x, weight, self.weight_scale_inv, self.bias, counters)
        key = (x.shape, x.dtype, x.device)
        seen = self.__dict__.setdefault("_seen", set())  # (layers unpickled from older versions lack it)
        if key not in seen:  # first call of this shape: routed, no plan yet
            if len(seen) >= MAX_SEEN:
                seen.clear()
            seen.add(key)
            return self._run_routed(x, counters)
        if len(self._plans) >= MAX_PLANS:
            del self._plans[next(iter(self._plans))]  # the oldest
        plan = self._plans[key] = self._make_plan(x, counters)
        return plan(x)

    def _make_cpu_plan(self, x: torch.Tensor, granularity: str):
        """The CPU path for x's shape (:func:`fp8linear.ops.cpu_linear.cpu_fp8_linear`, what
        fp8_linear runs for CPU tensors), without fp8_linear's per-call backend lookup and checks."""
        from .ops.cpu_linear import cpu_fp8_linear, native_linear_plan

        weight, scale, bias = self.weight, self.weight_scale_inv, self.bias
        k, out_shape = x.shape[-1], (*x.shape[:-1], weight.shape[0])
        m = x.numel() // k
        native = native_linear_plan(weight, scale, granularity, bias, m, x.dtype)

        def run(x: torch.Tensor) -> torch.Tensor:
            nonlocal native
            if native is not None:  # the compiled kernel in one prepared call
                y = native(x, out_shape)
                if y is None:  # weight, scales or bias changed in place, or the thread count: prepared again
                    native = native_linear_plan(weight, scale, granularity, bias, m, x.dtype)
                    y = None if native is None else native(x, out_shape)
                if y is not None:
                    return y
            return cpu_fp8_linear(x.reshape(-1, k), weight, scale, granularity, bias).reshape(out_shape)

        return run

    def _route_args(self, x: torch.Tensor) -> tuple:
        from .ops.router import tma_ok

        weight, granularity = self.weight, self.granularity
        w_s = self.weight_scale_inv.reshape(()) if granularity == "tensor" else self.weight_scale_inv
        k = x.shape[-1]
        args = (x.device, x.numel() // k, weight.shape[0], k, granularity, weight.dtype, x.dtype, self.bias,
                cublas_allowed(self.backend), tma_ok(weight))
        return args, w_s, granularity, weight.is_contiguous() and w_s.is_contiguous()

    def _run_routed(self, x: torch.Tensor, counters: torch.Tensor | None) -> torch.Tensor:
        """One call on the route a plan of x's shape would run (so the same bits), without the plan."""
        from .ops.linear import run_linear_route
        from .ops.router import route_linear

        args, w_s, granularity, dense = self._route_args(x)
        eager = not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        route = route_linear(*args, eager=eager, weight_contiguous=dense)
        if route.kernel == "cublas":  # the layer's cuBLAS route serves any M without a plan
            runner = self._cublas_runner(w_s, granularity)
            return runner(x, *runner.form(route.config))  # the route's workspace limit, scale form and algorithm
        k = x.shape[-1]
        w_s = self._gemm_scale(w_s, granularity, x.numel() // k, k, route)
        y = run_linear_route(route, x.reshape(-1, k), self.weight, w_s, granularity, self.bias, counters)
        return y.reshape(*x.shape[:-1], self.weight.shape[0])

    def _make_plan(self, x: torch.Tensor, counters: torch.Tensor | None):
        from .ops.linear import LinearPlan
        from .ops.router import route_linear

        args, w_s, granularity, dense = self._route_args(x)
        # eager calls may take the one-launch decode kernel; CUDA-graph capture takes the GPU-faster route
        route, capture = route_linear(*args, eager=True, weight_contiguous=dense), route_linear(*args,
                                                                                               weight_contiguous=dense)
        m, k = args[1], args[3]
        return LinearPlan(route, x, self.weight, self._gemm_scale(w_s, granularity, m, k, route, capture), granularity,
                          self.bias, counters, capture_route=capture,
                          cublas_linear=lambda: self._cublas_runner(w_s, granularity),
                          share=self.__dict__.get("_input_share"))

    def _gemm_scale(self, w_s: torch.Tensor, granularity: str, m: int, k: int, *routes) -> torch.Tensor:
        """The weight scale our kernels on `routes` read: for 1x128 weights the N-major copy (see
        :meth:`row_scale_n_major`) where the router says every one of them reads it faster
        (:func:`fp8linear.ops.router.use_n_major_scales`), else `w_s`; cuBLAS routes hold their own."""
        from .ops.router import use_n_major_scales

        ours = [r for r in routes if r.kernel != "cublas"]
        if granularity == "row" and ours and all(use_n_major_scales(r, m, k, granularity) for r in ours):
            return self.row_scale_n_major()
        return w_s

    def row_scale_n_major(self) -> torch.Tensor:
        """``weight_scale_inv`` of 1x128 weights, (N, K/128) with stride (1, N): a K group's scales
        for consecutive output columns side by side. Made once (N*K/128 floats, 1/32 of the FP8
        weight) and dropped with the plans; the layer's cuBLAS route reads the same storage as its
        (K/128, N) scale, so with both in use the layer holds one copy."""
        scale = self.__dict__.get("_row_scale_n_major")
        if scale is None:
            scale = self.__dict__["_row_scale_n_major"] = self.weight_scale_inv.detach().t().contiguous().t()
        return scale

    def _cublas_runner(self, w_s: torch.Tensor, granularity: str):
        """This layer's :class:`fp8linear.ops.linear.CublasLinear`, made once: every cuBLAS-routed
        shape runs it, planned or not, so a new M costs no plan, and the weight scale is held once
        per form in cuBLAS's layout (for 128x128 weights the grid, its rows padded where K/128 is
        not a multiple of 4, and a 1x128 copy of N*K/128 floats once a route runs that form)."""
        runner = self.__dict__.get("_cublas_linear")
        if runner is None:
            from .ops.linear import CublasLinear

            if granularity == "row":  # cuBLAS reads 1x128 scales as (K/128, N): the N-major copy's storage
                w_s = self.row_scale_n_major()
            runner = self.__dict__["_cublas_linear"] = CublasLinear(self.weight, w_s, granularity, self.bias)
        return runner

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, granularity={self.granularity}, "
            f"fp8_dtype={str(self.weight.dtype).removeprefix('torch.')}"
        )


def share_input_quantization(model: nn.Module) -> int:
    """Group the FP8 linears of `model` that may be called on one input tensor: the direct children
    of one module with the same input width, FP8 dtype and device (an attention layer's q / k / v
    projections, an MLP's gate and up projections). In eager GPU calls, a group's linears then
    quantize an input they all receive once (the first of them; the others read its quantized
    copy, the same bytes), where each would have quantized it again. Returns the number of groups.
    Linears given to the wrong group only miss: sharing needs the very same input tensor."""
    from .ops.linear import SharedActivations

    if not isinstance(model, nn.Module):
        raise TypeError(f"share_input_quantization takes an nn.Module, got {type(model).__name__}")
    groups = 0
    for parent in model.modules():
        siblings: dict[tuple, list[Fp8BlockLinear]] = {}
        for child in parent.children():
            if isinstance(child, Fp8BlockLinear):
                siblings.setdefault((child.in_features, child.weight.dtype, child.weight.device), []).append(child)
        for members in siblings.values():
            if len(members) > 1:
                share = SharedActivations()
                for member in members:
                    member.set_input_share(share)
                groups += 1
    return groups
