"""Public FP8 ops: validation, backend dispatch and `torch.library` custom ops.

Every public function validates its inputs here (clear ValueError/TypeError) and then runs
either the Triton kernels (:mod:`fp8linear.ops`) or the reference (:mod:`fp8linear.reference`).
The Triton paths and the CPU path of the whole linear are registered as custom ops with fake
implementations, so `torch.compile` traces them (one op each, no graph breaks) and CUDA graphs
capture them (no host synchronisation on the forward path); eager calls skip the dispatcher.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .backend import device_guard
from .formats import GROUP_SIZE, SCALE_DTYPE, check_granularity, is_fp8_dtype, resolve_fp8_dtype
from .ops import HAS_TRITON
from .ops.cpu_linear import cpu_fp8_linear
from .ops.router import cpu_fast_path, cublas_allowed, resolve_backend
from .reference import (
    block_fp8_matmul_ref,
    dequantize_weight_ref,
    grouped_fp8_matmul_ref,
    quantize_activation_ref,
    quantize_weight_ref,
    weight_granularity,
)

__all__ = [
    "OUT_DTYPES",
    "quantize_activation",
    "quantize_weight",
    "dequantize_weight",
    "block_fp8_matmul",
    "fp8_linear",
    "validate_linear",
    "grouped_fp8_matmul",
    "moe_routing",
]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- custom ops
def eager_or_traced(op: Callable[..., Any], launcher: Callable[..., Any]) -> Callable[..., Any]:
    """Call `launcher` directly in eager mode and the custom `op` while torch.compile traces.

    The custom op is what lets Dynamo trace and Inductor schedule our kernels, but going through
    the dispatcher costs 10-40 us of host time per call (measured: 41 us vs 4 us for a no-op on a
    2-core CPU), which dominated eager decode. Both run the same launcher, with the first
    argument's GPU current (:func:`fp8linear.backend.device_guard`: Triton launches on the current
    device, not on its tensors' one).
    """

    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return op(*args)
        with device_guard(args[0].device):
            return launcher(*args)

    return call


@torch.library.custom_op("fp8linear::cpu_fp8_linear", mutates_args=())
def _cpu_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_fp8_linear(x, weight, weight_scale_inv, granularity, bias)


@_cpu_linear_op.register_fake
def _(x, weight, weight_scale_inv, granularity, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


# The CPU path: called directly in eager mode, one opaque op (no graph breaks) under torch.compile.
_cpu_linear_call = eager_or_traced(_cpu_linear_op, cpu_fp8_linear)


if HAS_TRITON:

    @torch.library.custom_op("fp8linear::act_quant", mutates_args=())
    def _act_quant_op(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        from .ops.quant import act_quant

        with device_guard(x.device):
            return act_quant(x, fp8_dtype)

    @_act_quant_op.register_fake
    def _(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        return x.new_empty((m, k), dtype=fp8_dtype), x.new_empty((m, -(-k // GROUP_SIZE)), dtype=SCALE_DTYPE)

    # `counters` (split-K tile counters, below) are written during a kernel but left all zeros, as they
    # came: no mutation is visible outside the op, so none is declared.
    @torch.library.custom_op("fp8linear::block_fp8_gemm", mutates_args=())
    def _gemm_op(
        x_q: torch.Tensor,
        x_s: torch.Tensor,
        w_q: torch.Tensor,
        w_s: torch.Tensor,
        granularity: str,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
        allow_cublas: bool,
        counters: torch.Tensor | None,
    ) -> torch.Tensor:
        from .ops.gemm import block_fp8_gemm

        with device_guard(x_q.device):
            return block_fp8_gemm(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, allow_cublas=allow_cublas,
                                  counters=counters)

    @_gemm_op.register_fake
    def _(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, allow_cublas, counters):
        return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=out_dtype)

    @torch.library.custom_op("fp8linear::fp8_linear_tokens", mutates_args=())
    def _linear_op(
        x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str, bias: torch.Tensor | None,
        allow_cublas: bool, counters: torch.Tensor | None,
    ) -> torch.Tensor:
        from .ops.linear import fp8_linear_tokens

        with device_guard(x.device):
            return fp8_linear_tokens(x, w_q, w_s, granularity, bias, allow_cublas, counters)

    @_linear_op.register_fake
    def _(x, w_q, w_s, granularity, bias, allow_cublas, counters):
        return x.new_empty((x.shape[0], w_q.shape[0]))

    from .ops.gemm import block_fp8_gemm as _gemm_launcher
    from .ops.linear import fp8_linear_tokens as _linear_launcher
    from .ops.quant import act_quant as _act_quant_launcher

    def _gemm_launch(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, allow_cublas, counters):
        return _gemm_launcher(x_q, x_s, w_q, w_s, granularity, out_dtype, bias, allow_cublas=allow_cublas,
                              counters=counters)

    _act_quant_call = eager_or_traced(_act_quant_op, _act_quant_launcher)
    _gemm_call = eager_or_traced(_gemm_op, _gemm_launch)
    _linear_call = eager_or_traced(_linear_op, _linear_launcher)


# ----------------------------------------------------------------------------- grouped (MoE) custom ops
if HAS_TRITON:
    from .ops.grouped_gemm import align_num_blocks, grouped_fp8_gemm, moe_align_block_size

    def _moe_align_launcher(top_k_index: torch.Tensor, num_experts: int, block_m: int):
        r = moe_align_block_size(top_k_index, num_experts, block_m, method="kernel")
        return r.sorted_pair_ids, r.block_expert

    @torch.library.custom_op("fp8linear::grouped_fp8_gemm", mutates_args=())
    def _grouped_gemm_op(
        a_q: torch.Tensor,
        a_s: torch.Tensor,
        w_q: torch.Tensor,
        w_s: torch.Tensor,
        sorted_pair_ids: torch.Tensor,
        block_expert: torch.Tensor,
        num_pairs: int,
        a_row_div: int,
        granularity: str,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        with device_guard(a_q.device):
            return grouped_fp8_gemm(
                a_q, a_s, w_q, w_s, sorted_pair_ids, block_expert, num_pairs, a_row_div,
                granularity, out_dtype, bias, topk_weights,
            )

    @_grouped_gemm_op.register_fake
    def _(a_q, a_s, w_q, w_s, sorted_pair_ids, block_expert, num_pairs, a_row_div, granularity, out_dtype,
          bias, topk_weights):
        return a_q.new_empty((num_pairs, w_q.shape[1]), dtype=out_dtype)

    @torch.library.custom_op("fp8linear::moe_align", mutates_args=())
    def _moe_align_op(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        with device_guard(top_k_index.device):
            return _moe_align_launcher(top_k_index, num_experts, block_m)

    @_moe_align_op.register_fake
    def _(top_k_index, num_experts, block_m):
        num_blocks = align_num_blocks(top_k_index.numel(), num_experts, block_m)
        return (
            top_k_index.new_empty((num_blocks * block_m,), dtype=torch.int32),
            top_k_index.new_empty((num_blocks,), dtype=torch.int32),
        )

    # Eager calls go straight to the launchers; torch.compile traces the ops (see eager_or_traced).
    _moe_align_call = eager_or_traced(_moe_align_op, _moe_align_launcher)
    _grouped_gemm_call = eager_or_traced(_grouped_gemm_op, grouped_fp8_gemm)


def moe_routing(top_k_index: torch.Tensor, num_experts: int, block_m: int):
    """Routing of (token, expert) pairs for the grouped GEMM on the Triton path: the one-launch kernel
    (an opaque custom op) for decode-sized batches, else the traceable torch-ops path
    (:func:`fp8linear.ops.router.align_on_kernel` decides)."""
    from .ops.grouped_gemm import MoeRouting, moe_align_block_size
    from .ops.router import align_on_kernel

    if not align_on_kernel(top_k_index.numel(), num_experts):
        return moe_align_block_size(top_k_index, num_experts, block_m, method="torch")
    sorted_pair_ids, block_expert = _moe_align_call(top_k_index, num_experts, block_m)
    return MoeRouting(sorted_pair_ids, block_expert, block_m, top_k_index.numel(), top_k_index.shape[1])


# ----------------------------------------------------------------------------- grouped matmul


# ----------------------------------------------------------------------------- validation
def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_fp8(name: str, t: torch.Tensor) -> None:
    if not is_fp8_dtype(t.dtype):
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e4m3fnuz, got {t.dtype}")


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def _renamed_counters(counters: torch.Tensor | None, workspace: torch.Tensor | None) -> torch.Tensor | None:
    """`counters`, or the same tensor passed under its deprecated keyword `workspace`."""
    if workspace is None:
        return counters
    warnings.warn("the keyword 'workspace' is deprecated; pass the split-K tile counters as 'counters='",
                  DeprecationWarning, stacklevel=3)
    if counters is not None:
        raise TypeError("pass the split-K counters once, as 'counters=' (not also as 'workspace=')")
    return workspace


def _check_counters(counters: torch.Tensor | None, device: torch.device) -> None:
    if counters is None:
        return
    if not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or counters.dim() != 1:
        got = (f"{counters.dtype} of shape {tuple(counters.shape)}" if isinstance(counters, torch.Tensor)
               else type(counters).__name__)
        raise TypeError(f"counters must be a 1-D int32 tensor (ops.splitk_gemm.splitk_counters), got {got}")
    if counters.device != device:
        raise ValueError(f"counters are on {counters.device} but the activations are on {device}")


def _check_group_size(group_size: int) -> None:
    if group_size != GROUP_SIZE:
        raise ValueError(f"group_size must be {GROUP_SIZE} (the only size the kernels support), got {group_size}")


# ----------------------------------------------------------------------------- public ops
def quantize_activation(
    x: torch.Tensor,
    group_size: int = GROUP_SIZE,
    fp8_dtype: torch.dtype | str | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` (..., K) per token in 1x128 groups -> (x_q (..., K) fp8, x_s (..., ceil(K/128)) fp32)."""
    _check_tensor("x", x)
    _check_group_size(group_size)
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension (..., K), got shape {tuple(x.shape)}")
    fp8_dtype = resolve_fp8_dtype(fp8_dtype, x.device)
    if resolve_backend(backend, x.device) == "reference":
        return quantize_activation_ref(x, fp8_dtype, group_size)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    x_q, x_s = _act_quant_call(x2, fp8_dtype)
    return x_q.reshape(*lead, k), x_s.reshape(*lead, x_s.shape[-1])


def quantize_weight(
    w: torch.Tensor,
    granularity: str = "block",
    fp8_dtype: torch.dtype | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight (N, K), or a stack (..., N, K), to FP8 -> (w_q, w_s).

    Scale shapes: 'block' (..., ceil(N/128), ceil(K/128)); 'row' (..., N, ceil(K/128));
    'tensor' (...) (a 0-d tensor for a 2-D weight). Runs on the weight's device.
    """
    _check_tensor("w", w)
    check_granularity(granularity)
    if w.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"w must be bfloat16, float16 or float32 (not already quantized), got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"w must be 2-D (N, K) or a stack (..., N, K), got shape {tuple(w.shape)}")
    return quantize_weight_ref(w, granularity, resolve_fp8_dtype(fp8_dtype, w.device))


def dequantize_weight(w_q: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize (..., N, K) FP8 weights; the granularity is read from the scale's shape."""
    _check_tensor("w_q", w_q)
    _check_tensor("w_s", w_s)
    _check_fp8("w_q", w_q)
    if w_q.dim() < 2:
        raise ValueError(f"w_q must be 2-D (N, K) or a stack (..., N, K), got shape {tuple(w_q.shape)}")
    weight_granularity(w_q.shape, w_s.shape)
    return dequantize_weight_ref(w_q, w_s).to(dtype)


def _validate_matmul(x_q, x_s, w_q, w_s, out_dtype, bias) -> str:
    for name, t in (("x_q", x_q), ("x_s", x_s), ("w_q", w_q), ("w_s", w_s)):
        _check_tensor(name, t)
    _check_fp8("x_q", x_q)
    _check_fp8("w_q", w_q)
    if x_q.dtype != w_q.dtype:
        raise TypeError(f"x_q and w_q must have the same FP8 dtype, got {x_q.dtype} and {w_q.dtype}")
    if x_q.dim() != 2:
        raise ValueError(f"x_q must be 2-D (M, K), got shape {tuple(x_q.shape)}; flatten leading dims first")
    if w_q.dim() != 2:
        raise ValueError(f"w_q must be 2-D (N, K), got shape {tuple(w_q.shape)}")
    m, k = x_q.shape
    n, kw = w_q.shape
    if k != kw:
        raise ValueError(f"K mismatch: x_q is (M={m}, K={k}) but w_q is (N={n}, K={kw})")
    groups = -(-k // GROUP_SIZE)
    if tuple(x_s.shape) != (m, groups):
        raise ValueError(f"x_s must have shape (M, ceil(K/128)) = {(m, groups)}, got {tuple(x_s.shape)}")
    for name, t in (("x_s", x_s), ("w_s", w_s)):
        if t.dtype != SCALE_DTYPE:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    granularity = weight_granularity(w_q.shape, w_s.shape)
    _check_out_dtype(out_dtype)
    if bias is not None:
        _check_tensor("bias", bias)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape (N,) = {(n,)}, got {tuple(bias.shape)}")
    devices = {t.device for t in (x_q, x_s, w_q, w_s) + ((bias,) if bias is not None else ())}
    if len(devices) > 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    return granularity


def _k_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def block_fp8_matmul(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    counters: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = dequant(x_q, x_s) @ dequant(w_q, w_s).T (+ bias), fp32 accumulation, shape (M, N).

    The router (:mod:`fp8linear.ops.router`) picks the kernel: under backend "auto" on Hopper,
    cuBLAS blockwise FP8 (:mod:`fp8linear.ops.cublas_gemm`) or, where built, CUTLASS's kernels
    (:mod:`fp8linear.ops.cutlass_gemm`) where this GPU's routes table measured them fastest;
    "triton" always runs our kernels. x_s may be row-major (M, K/128), as `quantize_activation`
    returns it, or M-major (strides (1, M)), the layout cuBLAS reads: each path copies the other
    layout into its own (cuBLAS reads M-major scales, our kernels and CUTLASS row-major ones). w_s
    may have any strides (CUTLASS runs only on contiguous operands). `counters`: as
    for :func:`fp8_linear` (``workspace=`` is its deprecated name).
    """
    granularity = _validate_matmul(x_q, x_s, w_q, w_s, out_dtype, bias)
    counters = _renamed_counters(counters, workspace)
    _check_counters(counters, x_q.device)
    if resolve_backend(backend, x_q.device) == "reference":
        return block_fp8_matmul_ref(x_q, x_s, w_q, w_s, out_dtype, bias)
    w_s = w_s.reshape(()) if granularity == "tensor" else w_s  # the kernels take any scale strides
    return _gemm_call(_k_contiguous(x_q), x_s, _k_contiguous(w_q), w_s, granularity, out_dtype, bias,
                      cublas_allowed(backend), counters)


def validate_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                    bias: torch.Tensor | None, counters: torch.Tensor | None = None) -> str:
    """The checks of :func:`fp8_linear` (clear TypeError/ValueError); returns the weight's granularity."""
    _check_tensor("x", x)
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    _check_fp8("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must have shape (..., K={k}), got {tuple(x.shape)}")
    if weight_scale_inv.dtype != SCALE_DTYPE:
        raise TypeError(f"weight_scale_inv must be float32, got {weight_scale_inv.dtype}")
    granularity = weight_granularity(weight.shape, weight_scale_inv.shape)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape (N,) = {(n,)}, got {tuple(bias.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the weight is on {weight.device}")
    _check_counters(counters, x.device)
    return granularity


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    counters: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole FP8 linear: quantize `x` (..., K) per token, FP8 GEMM, bias; returns x.dtype (..., N).

    It checks what can go wrong cheaply (no per-call tensor work), then the router
    (:mod:`fp8linear.ops.router`) picks the kernels: a single token with a weight below 24M
    elements runs one fused quantize+GEMV kernel (same quantized values, fp32 sums in another
    order); everything else quantizes x, then runs the GEMM (cuBLAS blockwise FP8 or, where built,
    CUTLASS's kernels for the sizes this GPU's routes table measured them fastest, on Hopper under
    backend "auto"; else ours). `Fp8BlockLinear` runs the same
    work through a plan it keeps per input shape. CPU tensors under backend "auto" run
    :func:`fp8linear.ops.cpu_linear.cpu_fp8_linear` (the reference's quantized values, weight decoded
    tile by tile, fp32 GEMMs); backend "reference" runs the reference itself.

    `counters`: optional int32 zeros from :func:`fp8linear.ops.splitk_gemm.splitk_counters`
    for this weight's N, on x's device (``workspace=`` is the deprecated name of this keyword);
    decode GEMMs then count their split-K tiles there instead of zeroing fresh counters each call
    (one launch less). The kernels leave it zeroed; calls that
    run concurrently on different streams must not share one. `Fp8BlockLinear` keeps its own.
    """
    counters = _renamed_counters(counters, workspace)
    granularity = validate_linear(x, weight, weight_scale_inv, bias, counters)
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if resolve_backend(backend, x.device) == "reference":
        if cpu_fast_path(backend, x.device):
            y = _cpu_linear_call(x2, weight, weight_scale_inv, granularity, bias)
        else:
            x_q, x_s = quantize_activation_ref(x2, weight.dtype)
            y = block_fp8_matmul_ref(x_q, x_s, weight, weight_scale_inv, x.dtype, bias)
    else:
        w_s = weight_scale_inv.reshape(()) if granularity == "tensor" else weight_scale_inv
        y = _linear_call(_k_contiguous(x2), _k_contiguous(weight), w_s, granularity, bias, cublas_allowed(backend),
                         counters)
    return y.reshape(*lead, n)


# ----------------------------------------------------------------------------- grouped matmul
def grouped_fp8_matmul(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    top_k_index: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    per_token_rows: bool = True,
    bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    backend: str | None = None,
    _routing: object | None = None,
) -> torch.Tensor:
    """Per (token, expert) pair: y[p] = (dequant(a[row]) @ dequant(w[e]).T + bias[e]) * topk_weights[p].

    Pairs are numbered ``p = token * top_k + slot`` with e = top_k_index[token, slot]; ids
    outside [0, E) give zero rows. ``per_token_rows=True``: `a_q` is (T, K), one row per token
    (row = p // top_k); False: `a_q` is (T * top_k, K), one row per pair. `w_q` (E, N, K) FP8
    with scales (E, ...) of any granularity; `bias` (E, N); `topk_weights` (T, top_k) or (S,).
    Returns (T * top_k, N) in `out_dtype`.
    """
    for name, t in (("a_q", a_q), ("a_s", a_s), ("w_q", w_q), ("w_s", w_s), ("top_k_index", top_k_index)):
        _check_tensor(name, t)
    for name, t in (("a_q", a_q), ("w_q", w_q)):
        if not is_fp8_dtype(t.dtype):
            raise TypeError(f"{name} must be float8_e4m3fn or float8_e4m3fnuz, got {t.dtype}")
    if a_q.dtype != w_q.dtype:
        raise TypeError(f"a_q and w_q must have the same FP8 dtype, got {a_q.dtype} and {w_q.dtype}")
    if w_q.dim() != 3:
        raise ValueError(f"w_q must be 3-D (E, N, K), got shape {tuple(w_q.shape)}")
    if a_q.dim() != 2:
        raise ValueError(f"a_q must be 2-D (rows, K), got shape {tuple(a_q.shape)}")
    if top_k_index.dim() != 2 or top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"top_k_index must be a 2-D (T, top_k) int32/int64 tensor, got {top_k_index.dtype} {tuple(top_k_index.shape)}"
        )
    num_experts, n, k = w_q.shape
    t, top_k = top_k_index.shape
    num_pairs = t * top_k
    rows = t if per_token_rows else num_pairs
    if tuple(a_q.shape) != (rows, k):
        what = "(T, K)" if per_token_rows else "(T * top_k, K)"
        raise ValueError(f"a_q must have shape {what} = {(rows, k)}, got {tuple(a_q.shape)}")
    groups = -(-k // GROUP_SIZE)  # 1x128 activation groups
    if tuple(a_s.shape) != (rows, groups):
        raise ValueError(f"a_s must have shape (rows, ceil(K/128)) = {(rows, groups)}, got {tuple(a_s.shape)}")
    for name, s in (("a_s", a_s), ("w_s", w_s)):
        if s.dtype != SCALE_DTYPE:
            raise TypeError(f"{name} must be float32, got {s.dtype}")
    granularity = weight_granularity(w_q.shape, w_s.shape)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None and tuple(_check_tensor("bias", bias).shape) != (num_experts, n):
        raise ValueError(f"bias must have shape (E, N) = {(num_experts, n)}, got {tuple(bias.shape)}")
    if topk_weights is not None:
        _check_tensor("topk_weights", topk_weights)
        if topk_weights.numel() != num_pairs:
            raise ValueError(
                f"topk_weights must have T * top_k = {num_pairs} elements (shape of top_k_index "
                f"{tuple(top_k_index.shape)}), got shape {tuple(topk_weights.shape)}"
            )
        topk_weights = topk_weights.reshape(num_pairs)
    a_row_div = top_k if per_token_rows else 1

    if resolve_backend(backend, a_q.device) == "reference":
        return grouped_fp8_matmul_ref(
            a_q, a_s, w_q, w_s, top_k_index.reshape(-1), a_row_div, out_dtype, bias, topk_weights
        )
    from .ops.router import grouped_config

    routing = _routing
    if routing is None:
        routing = moe_routing(top_k_index, num_experts, grouped_config(num_pairs, num_experts, n, k).block_m)
    w_s = w_s.reshape(num_experts) if granularity == "tensor" else w_s.contiguous()
    if a_q.shape[-1] > 1 and a_q.stride(-1) != 1:
        a_q = a_q.contiguous()
    if w_q.stride(-1) != 1:
        w_q = w_q.contiguous()
    return _grouped_gemm_call(
        a_q, a_s.contiguous(), w_q, w_s, routing.sorted_pair_ids, routing.block_expert, num_pairs, a_row_div,
        granularity, out_dtype,
        bias.contiguous() if bias is not None else None,
        topk_weights.float().contiguous() if topk_weights is not None else None,
    )
