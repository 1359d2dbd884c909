"""RMSNorm in one launch for the models fp8linear quantizes.

In an eager decode step every module is host-bound, and transformers' Llama-family RMSNorm is
eight ATen kernels, each with its own host work. H100, torch 2.11, ``benchmarks/norm_ab.py``, bf16:
74-82 us of wall time per call at 1 to 512 rows against 15-18 us for one planned launch; GPU time
5-12 us against 26-143, and 86 against 898 at 8,192 rows of width 7168. A DeepSeek-V3 layer runs
four norms: in ``examples/deepseek_v3_small.py --preset v3`` they took about a quarter of an
eager FP8 decode step's host time.

:class:`FusedRMSNorm` computes the same formula in one launch (:mod:`fp8linear.ops.rmsnorm`) with
a launch plan per input shape, as :class:`Fp8BlockLinear` does. :func:`fuse_rms_norms_` swaps it
in for the norms whose outputs it reproduces; :func:`fp8linear.integrations.transformers.quantize_model_`
and the loaders do that by default (``fuse_norms=False`` keeps the model's own norms).

CPU tensors, ``torch.compile`` (which fuses the formula itself) and installs without Triton run
the formula in ATen ops, bit for bit what the replaced module computed.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .backend import HAS_TRITON, device_guard
from .reference import rms_norm_ref

__all__ = ["FusedRMSNorm", "fuse_rms_norms_"]

# Launch plans kept per module (input shapes; a generate() call meets one prefill shape and the
# decode shape): the oldest goes first beyond this.
MAX_PLANS = 64
_ALIGN = 16  # Triton specializes pointers on 16-byte alignment: a plan is reused only for aligned inputs
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _functorch_wrapped(x: torch.Tensor) -> bool:
    """Whether `x` is a torch.func (vmap, grad) wrapper, whose data pointer is not its own."""
    is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return bool(is_wrapped(x)) if is_wrapped is not None else False


class _Plan:
    __slots__ = ("call", "weight_ptr", "stride", "shape", "dtype", "device")

    def __init__(self, call: Any, weight: torch.Tensor, stride: tuple, y: torch.Tensor):
        # the weight's storage (a new Parameter, or `weight.data = ...` with another dtype or
        # device, has another address): the kernel was specialized for it
        self.call, self.weight_ptr, self.stride = call, weight.data_ptr(), stride
        self.shape, self.dtype, self.device = y.shape, y.dtype, y.device


class FusedRMSNorm(nn.Module):
    """``weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)`` in one launch on GPUs.

    The parameter and attribute names are those of transformers' ``LlamaRMSNorm`` (``weight``,
    ``variance_epsilon``), so state dicts and code reading them are unchanged. GPU outputs may
    differ from the ATen formula's by one rounding step of the output (the order of the row's sum
    of squares); CPU, traced and Triton-less calls compute the ATen formula itself.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = float(eps)
        self._plans: dict = {}

    @classmethod
    def from_module(cls, norm: nn.Module, eps: float) -> FusedRMSNorm:
        """A FusedRMSNorm holding `norm`'s weight Parameter itself (no copy)."""
        weight = norm.weight
        new = cls(weight.shape[0], eps, device="meta", dtype=weight.dtype)
        new.weight = weight
        new.train(norm.training)
        return new

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"

    def __getstate__(self):
        # Plans hold compiled kernels: neither pickles nor deep-copies; a copy makes its own.
        return {**super().__getstate__(), "_plans": {}}

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._plans.clear()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # traced: the formula (compilers fuse it)
            return rms_norm_ref(x, self.weight, self.variance_epsilon)
        try:
            plan = self._plans.get((x.shape, x.dtype, x.device))
        except AttributeError:
            raise TypeError(f"FusedRMSNorm takes a tensor, got {type(x).__name__}") from None
        if plan is not None:
            w = self.weight
            wp = w.data_ptr()
            if (wp == plan.weight_ptr and type(x) is torch.Tensor and x.stride() == plan.stride
                    and x.data_ptr() % _ALIGN == 0
                    and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
                y = torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)
                call = plan.call
                if call.compiled is not None:  # raw addresses: no driver query per pointer
                    call(x.data_ptr(), wp, y.data_ptr())
                else:
                    call(x, w, y)
                return y
        return self._forward_and_plan(x)

    def _forward_and_plan(self, x: torch.Tensor) -> torch.Tensor:
        from .ops.rmsnorm import rms_norm, rms_norm_supported

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"FusedRMSNorm takes a tensor, got {type(x).__name__}")
        w, eps = self.weight, self.variance_epsilon
        if x.shape[-1:] != w.shape:
            raise ValueError(f"FusedRMSNorm of width {w.shape[0]} got an input of shape {tuple(x.shape)}")
        if not (HAS_TRITON and x.is_cuda and type(x) is torch.Tensor and type(w.data) is torch.Tensor
                and not _functorch_wrapped(x) and rms_norm_supported(x, w)):
            return rms_norm_ref(x, w, eps)  # CPU, Triton-less, or tensor subclasses (DTensor): ATen ops
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return rms_norm_ref(x, w, eps)  # the kernel has no backward: autograd through ATen
        with device_guard(x.device):  # Triton launches on the current device: make it x's
            if x.data_ptr() % _ALIGN or w.data_ptr() % _ALIGN or torch.cuda.is_current_stream_capturing():
                return rms_norm(x, w, eps)  # launched through the JIT, no plan
            return self._run_new_plan(x)

    def _run_new_plan(self, x: torch.Tensor) -> torch.Tensor:
        from .ops.launch import KernelCall
        from .ops.rmsnorm import _rms_norm_kernel, rms_norm_args, rows_view

        w = self.weight
        y = torch.empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype), device=x.device)
        grid, args, options = rms_norm_args(rows_view(x), w, y, self.variance_epsilon)
        call = KernelCall(_rms_norm_kernel, grid, args, options, ("x_ptr", "w_ptr", "y_ptr"))
        call(x, w, y)
        if len(self._plans) >= MAX_PLANS:
            del self._plans[next(iter(self._plans))]  # the oldest
        self._plans[(x.shape, x.dtype, x.device)] = _Plan(call, w, x.stride(), y)
        return y


def _norm_eps(module: nn.Module) -> float | None:
    """The eps of a transformers Llama-family norm (its ``variance_epsilon``), else None."""
    eps = getattr(module, "variance_epsilon", None)
    return eps if isinstance(eps, float) and eps >= 0 else None


# Hooks a replacement would drop: a module holding any is left alone.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
# Probe rows' magnitudes: typical, small, and below 1e-6's reach on the mean square (where a
# module's eps, or its absence, shows), and an all-zero row.
_PROBE_SCALES = (3.0, 1e-2, 1e-4, 0.0)


def _single_input_forward(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(params) == 1 and len(required) == 1


def _fusable(module: nn.Module) -> float | None:
    """`module`'s eps when FusedRMSNorm computes what it does, else None.

    Structure first: one 1-D float weight Parameter on a real device and no other parameters,
    buffers, children or hooks, a ``variance_epsilon`` float, a forward of one input. Then the
    formula: for its own weight and a random one (``torch.func.functional_call``), on probe rows
    of several magnitudes in bf16, fp16 and fp32, the module's output must equal the ATen
    formula's bit for bit, dtype included. This rejects Gemma's ``(1 + weight)``, norms that
    multiply in float32 before rounding (GPT-OSS, Olmo2) or skip the intermediate rounding for
    float32 weights (T5), LayerNorm-style centring and other eps placements."""
    if isinstance(module, FusedRMSNorm) or list(module.children()) or list(module.buffers()):
        return None
    params = dict(module.named_parameters(recurse=False))
    w = params.get("weight")
    if w is None or len(params) != 1 or w.dim() != 1 or w.dtype not in _FLOAT_DTYPES or w.device.type == "meta":
        return None
    if type(w.data) is not torch.Tensor:  # a DTensor or another subclass: sharded by someone else
        return None
    if any(getattr(module, d, None) for d in _HOOK_DICTS) or getattr(module, "_hf_hook", None) is not None:
        return None
    eps = _norm_eps(module)
    if eps is None or not _single_input_forward(module):
        return None
    n, dev = w.shape[0], w.device
    gen = torch.Generator(device=dev).manual_seed(0)
    scales = torch.tensor(_PROBE_SCALES, device=dev)[:, None]
    other = (torch.rand(n, generator=gen, device=dev) * 2 - 0.5).to(w.dtype)
    with torch.no_grad():
        for weight in (w.detach(), other):
            for dtype in _FLOAT_DTYPES:
                probe = (torch.randn(len(_PROBE_SCALES), n, generator=gen, device=dev) * scales).to(dtype)
                try:
                    out = torch.func.functional_call(module, {"weight": weight}, (probe,))
                except (TypeError, ValueError, RuntimeError):
                    return None
                ref = rms_norm_ref(probe, weight, eps)
                if not isinstance(out, torch.Tensor) or out.dtype != ref.dtype or not torch.equal(out, ref):
                    return None
    return eps


def fuse_rms_norms_(model: nn.Module) -> int:
    """Replace, in place, the RMSNorm modules of `model` whose output :class:`FusedRMSNorm`
    reproduces (checked per module on a probe input, see ``_fusable``) by FusedRMSNorm modules
    holding the same weight Parameters. Returns how many were replaced."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_rms_norms_ takes an nn.Module, got {type(model).__name__}")
    targets = []
    for name, module in model.named_modules():
        if not name:
            continue
        eps = _fusable(module)
        if eps is not None:
            targets.append((name, module, eps))
    for name, module, eps in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FusedRMSNorm.from_module(module, eps))
    return len(targets)
