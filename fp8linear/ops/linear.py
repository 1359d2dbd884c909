"""The whole FP8 linear on the GPU: run a route of :mod:`fp8linear.ops.router`, once or as a plan.

:func:`run_linear_route` runs one call: the fused quantize + GEMV kernel, or our act-quant kernel
followed by the GEMM the route names (for cuBLAS, activations are quantized straight into its
layout: M padded to a multiple of 4, M-major scales).

:class:`LinearPlan` is the same work prepared for one input shape and dtype of one weight:
buffers' shapes, grids, scalar arguments and launch options are computed once, and each kernel is
launched through :class:`fp8linear.ops.launch.KernelCall` (the compiled kernel's launcher called
directly after the first launch, with raw device addresses). The quantized activations, their
scales and split-K partial sums share one scratch allocation (:class:`fp8linear.ops.launch.Scratch`).
``Fp8BlockLinear`` keeps one plan per input shape, which makes its eager forward a dictionary
lookup, two allocations (the output and the scratch; one for the fused GEMV) and one or two launches.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
import triton

from ..formats import GROUP_SIZE
from .cublas_gemm import algo_rows, config_row_scales, cublas_fp8_gemm, cublas_row_scales, held_weight_scale, workspace_limit
from .cublaslt import LT_WORKSPACE_LIMIT, lt_block_gemm
from .cutlass_gemm import CutlassCall
from .fused_decode import _fused_decode_kernel, fused_decode_args, fused_decode_gemm, split_counters
from .fused_gemv import _fused_fp8_gemv_kernel, fused_fp8_gemv, fused_gemv_args
from .gemm import _block_fp8_gemm_kernel, run_gemm_route, tiled_args
from .launch import KernelCall, Scratch, aligned
from .quant import _act_quant_kernel, act_quant, act_quant_args, act_quant_outputs, cublas_rows
from .router import Route, act_quant_launch, dense_scale, route_linear, tma_ok, use_library_quantization
from .splitk_gemm import _splitk_fp8_gemm_kernel, splitk_args, splitk_buffers

__all__ = ["CublasLinear", "LinearPlan", "MAX_CUBLAS_SCRATCH_SHAPES", "SharedActivations", "fp8_linear_tokens",
           "run_linear_route", "serves_capture"]

# Row counts a CublasLinear keeps a scratch layout for (the oldest is dropped), as many as the
# cuBLASLt plans it keeps per M (fp8linear.ops.cublaslt).
MAX_CUBLAS_SCRATCH_SHAPES = 512


def _stream_of(x: torch.Tensor) -> int:
    """The current stream of x's GPU as a raw handle (0 for CPU tensors: the interpreter's plans)."""
    return torch._C._cuda_getCurrentRawStream(x.device.index) if x.device.type == "cuda" else 0


def _capturing(x: torch.Tensor) -> bool:
    """Whether x's GPU's current stream is capturing a CUDA graph."""
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SharedActivations:
    """The quantized activations the last of a group of FP8 linears made from its input tensor, for
    the group's other linears called on that same tensor: the q / k / v projections of an attention
    layer, or the gate and up projections of an MLP, quantize their common input once instead of
    once each (the same bytes: the quantization is deterministic).

    An entry is the input tensor (weakly), its version counter, the current stream, a key naming
    the layout (rows, K, FP8 dtype and scale layout) and the raw addresses of x_q and x_s with the
    buffer holding them. It is found only for the very same tensor object, unmodified since, on the
    same stream, outside CUDA-graph capture, and for the same key; it lives until the input tensor
    is freed or the next entry replaces it (so the buffer outlives its linear's call by as long as
    the input does: one quantized copy, half the size of a bf16 input, in the call's scratch, which
    for a cuBLAS route also holds up to 32 MiB of workspace). Inference tensors, which carry no
    version counter, are not shared.
    """

    __slots__ = ("_ref", "_version", "_stream", "_key", "_value", "_users", "__weakref__")

    def __init__(self) -> None:
        self._ref = None
        self._version = self._stream = -1
        self._key = self._value = None
        self._users: dict[tuple, set[int]] = {}  # key -> the weights whose plans read that layout

    def __reduce__(self):
        # A copy (deepcopy, pickle) is a new empty group: entries hold addresses of this group's
        # buffers, and the copied layers make new plans, which register again.
        return (SharedActivations, ())

    def register(self, key: tuple, weight: torch.Tensor) -> None:
        """A plan of the linear with this `weight` reads activations quantized under `key`: entries
        are published only under keys two or more of the group's linears read (where the members'
        routes read other layouts, publishing would only keep buffers alive: H100, eager, a cuBLAS
        and a CUTLASS member at M=2048, 157.9 against 139.3 us)."""
        self._users.setdefault(key, set()).add(id(weight))

    def lookup(self, x: torch.Tensor, key: tuple) -> tuple | None:
        """(x_q address, x_s address) published for `x` under `key`, or None."""
        ref = self._ref
        if ref is None or ref() is not x or self._key != key or x._version != self._version:
            return None
        if _stream_of(x) != self._stream or _capturing(x):
            return None
        return self._value[:2]

    def publish(self, x: torch.Tensor, key: tuple, q_addr: int, s_addr: int, keep: torch.Tensor) -> None:
        """Offer the quantized activations of `x` (addresses inside `keep`) to the group."""
        if len(self._users.get(key, ())) < 2:
            return
        if x.is_inference() or _capturing(x):
            self._drop()
            return
        self._ref = weakref.ref(x, self._expire)
        self._version = x._version
        self._stream = _stream_of(x)
        self._key, self._value = key, (q_addr, s_addr, keep)

    def _expire(self, ref) -> None:
        if self._ref is ref:  # the input of the current entry was freed
            self._drop()

    def _drop(self) -> None:
        self._ref = None
        self._key = self._value = None


def run_linear_route(route: Route, x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str,
                     bias: torch.Tensor | None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """y (M, N) in x.dtype for a validated, K-contiguous x (M, K), weight w_q (N, K), on `route`."""
    if route.kernel == "gemv":
        return fused_fp8_gemv(x, w_q, w_s, granularity, bias, route.config)
    if route.kernel == "decode":
        return fused_decode_gemm(x, w_q, w_s, granularity, bias, route.config, counters)
    m = x.shape[0]
    if route.kernel == "cublas":
        x_q, x_s = act_quant(x, w_q.dtype, cublas_layout=True)
        y = cublas_fp8_gemm(x_q, x_s, w_q, w_s, granularity, bias, route.config)
        return y if y.shape[0] == m else y[:m]  # drop the padding rows (a contiguous view)
    x_q, x_s = act_quant(x, w_q.dtype, release_early=route.release_early)
    return run_gemm_route(route, x_q, x_s, w_q, w_s, granularity, x.dtype, bias, counters=counters)


def fp8_linear_tokens(
    x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str, bias: torch.Tensor | None,
    allow_cublas: bool, counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (M, N) in x.dtype for a validated, K-contiguous x (M, K) and weight w_q (N, K), routed here;
    `counters`: split-K counters (:func:`fp8linear.ops.splitk_gemm.splitk_counters`) or None."""
    route = route_linear(x.device, x.shape[0], w_q.shape[0], x.shape[1], granularity, w_q.dtype, x.dtype, bias,
                         allow_cublas, tma_ok(w_q), weight_contiguous=w_q.is_contiguous() and dense_scale(w_s, granularity))
    return run_linear_route(route, x, w_q, w_s, granularity, bias, counters)


class CublasLinear:
    """One weight's cuBLAS blockwise route for inputs of any M: act_quant straight into cuBLAS's
    layout (M padded to a multiple of 4, M-major scales), then the GEMM on cuBLASLt called directly
    (:mod:`fp8linear.ops.cublaslt`: descriptors made once per (workspace limit, weight-scale form),
    the algorithm once per (workspace limit, form, M, the route's ``algo_m``), about a tenth of
    ``torch._scaled_mm``'s host time), or ``torch._scaled_mm`` where that is not available
    (`direct=False`, the environment variable ``FP8LINEAR_CUBLASLT=0`` when it is made, or a
    cuBLASLt that cannot be set up).

    ``Fp8BlockLinear`` keeps one per layer and every cuBLAS-routed shape runs it, so an M the layer
    has not met costs no plan: transformers' DeepSeek attention projects the whole cached sequence
    through kv_b_proj at every decode step, a new M each time. The quantization is launched through
    one prepared :class:`~fp8linear.ops.launch.KernelCall` per launch configuration, with the grid
    and M given per call; the weight scale is converted to cuBLAS's layout once per form (the 128x128
    grid, or 1x128 scales where a route's :class:`~fp8linear.ops.cublas_gemm.CublasConfig` says
    so, made on first use). Results are those
    of :func:`run_linear_route` on the cuBLAS route, bit for bit. Inputs: contiguous (..., K),
    16-byte aligned (the caller checks), of one dtype.
    """

    __slots__ = ("w_t", "w_s", "granularity", "scale_b", "bias", "k", "n", "fp8_dtype", "quant_calls", "lt", "lts",
                 "row_scales", "torch_rows", "direct", "w_q", "scratch", "scales")

    def __init__(self, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str, bias: torch.Tensor | None,
                 direct: bool | None = None) -> None:
        self.w_t = w_q.t()
        self.w_s, self.granularity = w_s, granularity
        self.bias = bias
        self.n, self.k = w_q.shape
        self.fp8_dtype = w_q.dtype
        self.quant_calls: dict[tuple[int, int], KernelCall] = {}  # (rows per program, warps) -> launch
        if direct is None:
            direct = os.environ.get("FP8LINEAR_CUBLASLT", "1") != "0"
        self.w_q = w_q
        for self.direct in ((True, False) if direct else (False,)):
            # the default route's weight scale in cuBLAS's layout (torch._scaled_mm reads no padded
            # 128x128 grid); where 128x128 weights also run as 1x128 weights (a route's
            # CublasConfig.row_scales), that form is made on first use (scales)
            self.row_scales = cublas_row_scales(w_q, granularity, direct=self.direct)
            self.scale_b = held_weight_scale(w_q, w_s, granularity, self.row_scales)
            self.scales = {self.row_scales: self.scale_b}
            # cuBLASLt called directly (fp8linear.ops.cublaslt), else torch._scaled_mm; one per (workspace
            # limit, 1x128 form)
            self.lt = lt_block_gemm(w_q, self.scale_b, self.row_scales, bias) if self.direct else None
            if self.lt is not None or not self.direct:
                break
        self.lts = {(LT_WORKSPACE_LIMIT, self.row_scales): self.lt}
        # the form torch._scaled_mm reads (no padded 128x128 grid: such weights go as 1x128 weights)
        self.torch_rows = cublas_row_scales(w_q, granularity, direct=False)
        # (rows, workspace bytes) -> x_q, x_s (M-major) and the cuBLASLt workspace, one buffer
        self.scratch: dict[tuple[int, int], Scratch] = {}

    def quant_call(self, x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor) -> KernelCall:
        """The prepared act_quant launch for x (..., K) into x_q, x_s (made on first use)."""
        block_m, num_warps = act_quant_launch(x_q.shape[0], self.k)
        quant = self.quant_calls.get((block_m, num_warps))
        if quant is None:
            grid, args, options = act_quant_args(x.view(-1, self.k), x_q, x_s)
            quant = self.quant_calls[(block_m, num_warps)] = KernelCall(
                _act_quant_kernel, grid, args, options, ("x_ptr", "q_ptr", "s_ptr", "M", "M_IN", "stride_sg"))
        return quant

    def scale_for(self, as_rows: bool) -> torch.Tensor:
        """The weight scale in cuBLAS's layout, as 1x128 scales or not (made on first use)."""
        scale = self.scales.get(as_rows)
        if scale is None:
            scale = self.scales[as_rows] = held_weight_scale(self.w_q, self.w_s, self.granularity, as_rows)
        return scale

    def form(self, config) -> tuple[int, bool, int]:
        """(workspace limit, 1x128 form, algorithm rows) of a cuBLAS route's config
        (:class:`~fp8linear.ops.cublas_gemm.CublasConfig`): :meth:`__call__`'s last arguments."""
        return workspace_limit(config), self.row_scales or config_row_scales(config), algo_rows(config)

    def lt_for(self, limit: int, as_rows: bool | None = None):
        """The held cuBLASLt GEMM with this workspace limit and scale form (made on first use), or None
        (torch._scaled_mm)."""
        as_rows = self.row_scales if as_rows is None else as_rows
        key = (limit, as_rows)
        if key not in self.lts:
            self.lts[key] = (lt_block_gemm(self.w_q, self.scale_for(as_rows), as_rows, self.bias, limit)
                             if self.direct else None)
        return self.lts[key]

    def __call__(self, x: torch.Tensor, limit: int = LT_WORKSPACE_LIMIT, as_rows: bool | None = None,
                 algo_m: int = 0, share: SharedActivations | None = None) -> torch.Tensor:
        """y (..., N) for x (..., K); `limit`: the route's cuBLASLt workspace limit in bytes, `as_rows`:
        128x128 weights as 1x128 weights (None: this weight's default form), `algo_m`: the rows whose
        heuristic algorithm runs (0: the call's own; :meth:`form` of the route's
        :class:`~fp8linear.ops.cublas_gemm.CublasConfig` gives all three); `share`: the layer's
        group's :class:`SharedActivations` (with cuBLASLt called directly)."""
        k = self.k
        m = x.numel() // k
        rows = cublas_rows(m)
        block_m, num_warps = act_quant_launch(rows, k)
        grid = (-(-rows // block_m), -(-k // GROUP_SIZE), 1)
        if as_rows is None or as_rows == self.row_scales:
            as_rows = self.row_scales
            lt = self.lt if limit == LT_WORKSPACE_LIMIT else self.lt_for(limit)
        else:
            lt = self.lt_for(limit, as_rows)
        if lt is not None:
            with lt.lock:  # the plan stays live (not evicted by another thread) until its GEMM is enqueued
                plan = lt.plan(rows, algo_m)
                if plan is not None:  # one scratch allocation, raw addresses, cuBLASLt called directly
                    scratch = self.scratch.get((rows, plan[3])) or self._scratch(rows, plan[3])
                    buf = scratch.allocate(x.device)
                    y = torch.empty((rows, self.n), dtype=torch.bfloat16, device=x.device)
                    q_addr, s_addr, ws_addr = scratch.addresses(buf)
                    shared = None
                    if share is not None:
                        key = (rows, k, self.fp8_dtype, "m-major")
                        shared = share.lookup(x, key)
                    if shared is not None:  # a sibling linear quantized this very input already
                        q_addr, s_addr = shared
                    else:
                        quant = self.quant_calls.get((block_m, num_warps))
                        if quant is not None and quant.direct:
                            quant.launch(grid, x.data_ptr(), q_addr, s_addr, rows, m, rows)
                        else:
                            x_q, x_s_t, _ = scratch.views(buf)
                            x_s = x_s_t.t()  # (rows, K/128), M-major
                            (quant or self.quant_call(x, x_q, x_s)).launch(grid, x, x_q, x_s, rows, m, rows)
                        if share is not None:
                            share.publish(x, key, q_addr, s_addr, buf)
                    lt.run_locked(plan, q_addr, s_addr, y.data_ptr(), ws_addr)
                    return (y[:m] if rows != m else y).view(*x.shape[:-1], self.n)
        x_q, x_s = act_quant_outputs(m, k, self.fp8_dtype, x.device, cublas_layout=True)
        quant = self.quant_calls.get((block_m, num_warps)) or self.quant_call(x, x_q, x_s)
        if quant.direct:
            quant.launch(grid, x.data_ptr(), x_q.data_ptr(), x_s.data_ptr(), rows, m, rows)
        else:
            quant.launch(grid, x, x_q, x_s, rows, m, rows)
        y = torch._scaled_mm(x_q, self.w_t, scale_a=x_s, scale_b=self.scale_for(as_rows or self.torch_rows),
                             bias=self.bias, out_dtype=torch.bfloat16)
        return (y[:m] if rows != m else y).view(*x.shape[:-1], self.n)

    def _scratch(self, rows: int, workspace_bytes: int) -> Scratch:
        if len(self.scratch) >= MAX_CUBLAS_SCRATCH_SHAPES:
            del self.scratch[next(iter(self.scratch))]
        scratch = self.scratch[(rows, workspace_bytes)] = Scratch((((rows, self.k), self.fp8_dtype),
                                                 ((-(-self.k // GROUP_SIZE), rows), torch.float32),
                                                 ((max(workspace_bytes, 1),), torch.uint8)))
        return scratch


def serves_capture(route: Route, capture_route: Route) -> bool:
    """Whether the plan of the eager `route` also serves CUDA-graph capture, where `capture_route`
    runs: the same route, or CUTLASS routes that differ in PDL only (a CUTLASS plan launches its
    GEMM plain under capture, after act_quant)."""
    if route == capture_route:
        return True
    return route.kernel == "cutlass" and replace(route, pdl=False) == replace(capture_route, pdl=False)


class LinearPlan:
    """The FP8 linear for inputs of one shape (M, K) and dtype on one weight, prepared once.

    Built from a first, real input `x` (..., K) (validated, contiguous); callable with any later
    contiguous input of the same shape, dtype and device whose data pointer is 16-byte aligned
    (:func:`fp8linear.ops.launch.aligned`: the caller checks), returning y (..., N). Results are
    bit-identical to :func:`run_linear_route` on the same route. cuBLAS routes keep the weight
    scale in cuBLAS's layout; CUTLASS routes hold a :class:`~fp8linear.ops.cutlass_gemm.CutlassCall`;
    routes without a prepared form (the persistent kernel, whose TMA descriptors hold the
    activations' address, and empty shapes) run :func:`run_linear_route`.
    `capture_route`: the route to run inside CUDA-graph capture where it differs from `route`
    (the one-launch decode kernel is an eager choice, :mod:`fp8linear.ops.router`).
    The weight, scales, bias and `counters` are held by reference: a plan stays valid while
    they are updated in place (except a cuBLAS route's weight scale, a copy where cuBLAS needs
    another layout, and the 64-column CUTLASS tiles' scale per 64 rows, a copy), and must be made again
    when they are replaced. `cublas_linear`: a callable
    giving the layer's :class:`CublasLinear`, which its cuBLAS plans share (one weight scale in
    cuBLAS's layout, one prepared quantization launch); without it a cuBLAS plan makes its own.
    """

    __slots__ = ("route", "run", "calls", "capture_calls")

    def __init__(self, route: Route, x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str,
                 bias: torch.Tensor | None, counters: torch.Tensor | None, capture_route: Route | None = None,
                 cublas_linear: Callable[[], CublasLinear] | None = None,
                 share: SharedActivations | None = None) -> None:
        self.route = route
        if cublas_linear is None:
            def cublas_linear() -> CublasLinear:
                return CublasLinear(w_q, w_s, granularity, bias)
        capture_run, capture_calls = None, ()
        if capture_route is not None and not serves_capture(route, capture_route) and x.device.type == "cuda":
            # the eager route's choice does not hold inside CUDA-graph capture: there the other one runs
            capture_run, capture_calls = self._prepare(capture_route, x, w_q, w_s, granularity, bias, counters,
                                                       cublas_linear, None)
        run, calls = self._prepare(route, x, w_q, w_s, granularity, bias, counters, cublas_linear, share, capture_run)

        self.run: Callable[[torch.Tensor], torch.Tensor] = run
        self.calls: tuple[KernelCall, ...] = calls  # the prepared launches of the eager route (none: unprepared)
        self.capture_calls = capture_calls  # those run under CUDA-graph capture, where the route differs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """y (..., N) for x (..., K) of the planned shape: the kernels read x through its data
        pointer, so leading dimensions cost no reshape."""
        return self.run(x)

    @staticmethod
    def _prepare(route: Route, x_in: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str,
                 bias: torch.Tensor | None, counters: torch.Tensor | None,
                 cublas_linear: Callable[[], CublasLinear], share: SharedActivations | None,
                 capture_run: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> tuple[Callable, tuple[KernelCall, ...]]:
        """(run, its prepared launches) of `route`; with `capture_run`, run calls that instead inside
        CUDA-graph capture (the CUTLASS route in its own capture check, the others through a wrapper)."""
        k = x_in.shape[-1]
        x = x_in.reshape(-1, k)
        m, n = x.shape[0], w_q.shape[0]
        out_shape = (*x_in.shape[:-1], n)
        device, out_dtype = x.device, x.dtype

        def either(run: Callable, calls: tuple[KernelCall, ...]) -> tuple[Callable, tuple[KernelCall, ...]]:
            if capture_run is None:
                return run, calls
            is_capturing = torch.cuda.is_current_stream_capturing

            def run_either(x: torch.Tensor) -> torch.Tensor:
                return capture_run(x) if is_capturing() else run(x)

            return run_either, calls

        def unprepared(x: torch.Tensor) -> torch.Tensor:
            return run_linear_route(route, x.reshape(m, k), w_q, w_s, granularity, bias, counters).reshape(out_shape)

        if m == 0 or n == 0 or k == 0 or route.kernel in ("persistent", "ws") or not aligned(x):
            return either(unprepared, ())
        fp8_dtype = w_q.dtype
        if route.kernel == "cublas":
            runner = cublas_linear()  # the layer's: shared by its cuBLAS plans, for any M
            x_q0, x_s0 = act_quant_outputs(m, k, fp8_dtype, device, cublas_layout=True)
            form = runner.form(route.config)
            if share is not None:
                share.register((cublas_rows(m), k, fp8_dtype, "m-major"), w_q)

                def run(x: torch.Tensor) -> torch.Tensor:
                    return runner(x, *form, share)
            else:
                run = runner if form == (LT_WORKSPACE_LIMIT, runner.row_scales, 0) else (lambda x: runner(x, *form))
            return either(run, (runner.quant_call(x, x_q0, x_s0),))
        y0 = torch.empty((m, n), dtype=out_dtype, device=device)
        groups = triton.cdiv(k, GROUP_SIZE)
        quant_bufs = [((m, k), fp8_dtype), ((m, groups), torch.float32)]
        if route.kernel == "decode":
            tile_counters, sync = split_counters(counters, m, n, route.config, device)
            split, count, part_shape = splitk_buffers(m, n, route.config, k, device, tile_counters)
            if tile_counters is None:
                return either(unprepared, ())  # no counters to count in: fresh counters per call, as unprepared
            scratch = Scratch(quant_bufs + ([(part_shape, torch.float32)] if part_shape else []))
            x_q0, x_s0, *part0 = scratch.views(scratch.allocate(device))
            grid, args, options = fused_decode_args(x, x_q0, x_s0, w_q, w_s, y0, granularity, bias, route.config, split,
                                                    part0[0] if part0 else None, count, sync)
            slots = ("x_ptr", "xq_ptr", "xs_ptr", "y_ptr") + (() if bias is not None else ("bias_ptr",))
            one = KernelCall(_fused_decode_kernel, grid, args, options, slots + (("part_ptr",) if part_shape else ()))
            nbytes, has_bias = scratch.nbytes, bias is not None

            def run_decode(x: torch.Tensor) -> torch.Tensor:
                y = torch.empty(out_shape, dtype=out_dtype, device=device)
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                if one.direct:  # raw addresses: no per-buffer tensors, no driver query per pointer
                    yv, bufs, xv = y.data_ptr(), scratch.addresses(buf), x.data_ptr()
                else:
                    yv, bufs, xv = y, scratch.views(buf), x
                if has_bias:
                    one(xv, *bufs[:2], yv, *bufs[2:])
                else:  # the kernel's unused bias pointer is y
                    one(xv, *bufs[:2], yv, yv, *bufs[2:])
                return y

            return either(run_decode, (one,))
        if route.kernel == "gemv":
            grid, args, options = fused_gemv_args(x, w_q, w_s, y0, granularity, bias, route.config)
            gemv = KernelCall(_fused_fp8_gemv_kernel, grid, args, options, ("x_ptr", "y_ptr") + (() if bias is not None else ("bias_ptr",)))

            def run_gemv(x: torch.Tensor) -> torch.Tensor:
                y = torch.empty(out_shape, dtype=out_dtype, device=device)
                if gemv.direct:
                    yv = y.data_ptr()
                    gemv(x.data_ptr(), yv, yv)
                else:
                    gemv(x, y, y)  # without a bias, the kernel's unused bias pointer is y
                return y

            return either(run_gemv, (gemv,))
        if route.kernel == "cutlass":
            return LinearPlan._prepare_cutlass(route, x, w_q, w_s, granularity, bias, out_shape, quant_bufs, share,
                                               capture_run)
        split, count, part_shape = ((1, 0), None, None)
        if route.kernel == "splitk":
            split, count, part_shape = splitk_buffers(m, n, route.config, k, device, counters)
            if part_shape is not None and count is not counters:
                return either(unprepared, ())  # no counters to count in: fresh counters per call, as unprepared
        scratch = Scratch(quant_bufs + ([(part_shape, torch.float32)] if part_shape else []))
        x_q0, x_s0, *part0 = scratch.views(scratch.allocate(device))
        grid, args, options = act_quant_args(x, x_q0, x_s0, route.release_early)
        quant = KernelCall(_act_quant_kernel, grid, args, options, ("x_ptr", "q_ptr", "s_ptr"))
        out_slots = ("y_ptr",) + (() if bias is not None else ("bias_ptr",))
        if route.kernel == "splitk":
            grid, args, options = splitk_args(x_q0, x_s0, w_q, w_s, y0, granularity, bias, route.config, split,
                                              part0[0] if part0 else None, count, route.pdl)
            # without a split, the unused partial-sum and counter pointers are y
            slots = ("x_ptr", "xs_ptr") + out_slots + (("part_ptr",) if part_shape else ("part_ptr", "count_ptr"))
            gemm = KernelCall(_splitk_fp8_gemm_kernel, grid, args, options, slots)
            fill = (0 if bias is not None else 1) + (0 if part_shape else 2)  # slots after y that take y
        else:
            grid, args, options = tiled_args(x_q0, x_s0, w_q, w_s, y0, granularity, bias, route.config, route.pdl)
            gemm = KernelCall(_block_fp8_gemm_kernel, grid, args, options, ("x_ptr", "xs_ptr") + out_slots)
            fill = 0 if bias is not None else 1
        nbytes = scratch.nbytes
        key = (m, k, fp8_dtype, "row-major")
        if share is not None:
            share.register(key, w_q)

        def run_two(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(out_shape, dtype=out_dtype, device=device)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if gemm.direct and quant.direct:  # raw addresses: no per-buffer tensors, no driver query per pointer
                yv, bufs, xv = y.data_ptr(), scratch.addresses(buf), x.data_ptr()
                shared = share.lookup(x, key) if share is not None else None
                if shared is not None:  # a sibling linear quantized this very input already
                    gemm(*shared, yv, *(yv,) * fill, *bufs[2:])
                    return y
                quant(xv, bufs[0], bufs[1])
                if share is not None:
                    share.publish(x, key, bufs[0], bufs[1], buf)
            else:
                yv, bufs, xv = y, scratch.views(buf), x
                quant(xv, bufs[0], bufs[1])
            gemm(bufs[0], bufs[1], yv, *(yv,) * fill, *bufs[2:])
            return y

        return either(run_two, (quant, gemm))

    @staticmethod
    def _prepare_cutlass(route: Route, x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str,
                         bias: torch.Tensor | None, out_shape: tuple[int, ...], quant_bufs: list,
                         share: SharedActivations | None,
                         capture_run: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         ) -> tuple[Callable, tuple[KernelCall, ...]]:
        """act_quant (row-major scales), then the CUTLASS GEMM called on raw addresses; the quantized
        activations, their scales and CUTLASS's workspace share one allocation. Eagerly, on inputs
        the router gives to it (:func:`fp8linear.ops.router.use_library_quantization`), a prepared
        GEMM's call quantizes x itself: both kernels from one host call (act_quant's bytes), which
        also allocates the output and the scratch where the plan-call module is built
        (:meth:`~fp8linear.ops.cutlass_gemm.CutlassCall.allocating_call`). With `capture_run`, that
        runs inside CUDA-graph capture instead, decided in the same capture check as the eager call's
        (one check a call: host time)."""
        m, device = x.shape[0], x.device
        gemm = CutlassCall(w_q, w_s, bias, m, route.config, granularity, pdl=route.pdl)
        fused = gemm.with_quantization() if use_library_quantization(m, x.shape[1], x.dtype) else None
        capturing = torch.cuda.is_current_stream_capturing
        scratch = Scratch(quant_bufs + [((max(gemm.workspace_bytes, 1),), torch.uint8)])
        x_q0, x_s0, _ = scratch.views(scratch.allocate(device))
        grid, args, options = act_quant_args(x, x_q0, x_s0, route.release_early)
        quant = KernelCall(_act_quant_kernel, grid, args, options, ("x_ptr", "q_ptr", "s_ptr"))
        nbytes, has_workspace = scratch.nbytes, gemm.workspace_bytes > 0
        allocating = None if fused is None else gemm.allocating_call(out_shape, nbytes, scratch.offsets[1])
        key = (m, x.shape[1], w_q.dtype, "row-major")
        if share is not None:
            share.register(key, w_q)

        watch_capture = fused is not None or capture_run is not None

        def run_cutlass(x: torch.Tensor) -> torch.Tensor:
            eager = watch_capture and not capturing()
            if capture_run is not None and not eager:
                return capture_run(x)
            shared = share.lookup(x, key) if share is not None else None
            if shared is None and fused is not None and eager:  # eager: host time sets the pace
                if allocating is not None:  # the allocations too, in the same C++ call
                    if share is None:
                        return allocating(x)
                    y, buf = allocating(x, True)
                    q, s, _ = scratch.addresses(buf)
                else:
                    y = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                    q, s, _ = scratch.addresses(buf)
                    fused(x.data_ptr(), q, s, y.data_ptr())
                if share is not None:
                    share.publish(x, key, q, s, buf)
                return y
            y = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            q, s, ws = scratch.addresses(buf)
            if shared is not None:  # a sibling linear quantized this very input already
                q, s = shared
            else:
                if quant.direct:
                    quant(x.data_ptr(), q, s)
                else:
                    x_q, x_s, _ = scratch.views(buf)
                    quant(x, x_q, x_s)
                if share is not None:
                    share.publish(x, key, q, s, buf)
            gemm(q, s, y.data_ptr(), ws if has_workspace else None)
            return y

        return run_cutlass, (quant,)
