"""The FP8 MoE experts forward for one input signature, prepared once (eager calls of ``Fp8Experts``).

An eager call of the experts module runs five kernels (the pairs' alignment, the quantization of
x, the gate/up grouped GEMM, the quantization of the gated activations, the down grouped GEMM)
and a few torch ops for the gate and the sum over the top-k slots. Through the functional ops each
kernel launch goes through the Triton JIT with its argument checks, and every buffer is its own
allocation. :class:`ExpertsPlan` makes the routing and tile decisions once per (tokens, top_k,
dtypes) and launches the kernels through :class:`~fp8linear.ops.launch.KernelCall` (the compiled
launcher called directly, raw addresses), with the alignment output and the quantized activations
and scales in one scratch allocation. The kernels, configs and operands are the functional path's,
so the results are the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..formats import GROUP_SIZE
from .grouped_gemm import (
    _grouped_fp8_gemm_kernel,
    _moe_align_kernel,
    align_args,
    align_num_blocks,
    grouped_gemm_args,
    moe_align_block_size,
)
from .launch import KernelCall, Scratch
from .quant import _act_quant_kernel, act_quant_args
from .router import align_on_kernel
from .router import grouped_config

__all__ = ["ExpertsPlan"]

_QUANT_SLOTS = ("x_ptr", "q_ptr", "s_ptr")
_GEMM_SLOTS = ("a_ptr", "as_ptr", "c_ptr", "sorted_ids_ptr", "block_expert_ptr", "topk_w_ptr")


class ExpertsPlan:
    """Experts forward for x (T, H) contiguous, top_k_index (T, k) and top_k_weights (T, k) of the
    shapes and dtypes it was built with, on fixed weights (held by reference: the plan is stale once
    a weight, scale or bias tensor is replaced). `gate` maps the up projection's output (pairs, N_up)
    to the down projection's input (pairs, I) in x's dtype. Built from a first real call, which it runs.
    """

    __slots__ = ("t", "top_k", "num_pairs", "hidden", "n_up", "inter", "dtype", "gate", "scratch", "on_kernel",
                 "num_experts", "block_m", "align", "quant_x", "quant_h", "gemm_up", "gemm_down", "fp8_dtype",
                 "direct", "_first")

    def __init__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 w_up: torch.Tensor, s_up: torch.Tensor, b_up: torch.Tensor | None,
                 w_down: torch.Tensor, s_down: torch.Tensor, b_down: torch.Tensor | None,
                 granularity: str, gate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.t, self.top_k = top_k_index.shape
        self.num_pairs = self.t * self.top_k
        self.num_experts, self.n_up, self.hidden = w_up.shape
        self.inter = w_down.shape[2]
        self.dtype, self.fp8_dtype, self.gate = x.dtype, w_up.dtype, gate
        cfg_up = grouped_config(self.num_pairs, self.num_experts, self.n_up, self.hidden)
        self.block_m = cfg_up.block_m  # one routing serves both GEMMs (block_m depends on pairs per expert only)
        cfg_down = replace(grouped_config(self.num_pairs, self.num_experts, self.hidden, self.inter),
                           block_m=self.block_m)
        self.on_kernel = align_on_kernel(self.num_pairs, self.num_experts)
        num_blocks = align_num_blocks(self.num_pairs, self.num_experts, self.block_m)
        gh, gi = -(-self.hidden // GROUP_SIZE), -(-self.inter // GROUP_SIZE)
        self.scratch = Scratch((((num_blocks * self.block_m,), torch.int32), ((num_blocks,), torch.int32),
                                ((self.t, self.hidden), self.fp8_dtype), ((self.t, gh), torch.float32),
                                ((self.num_pairs, self.inter), self.fp8_dtype), ((self.num_pairs, gi), torch.float32)))
        ws_up = s_up.reshape(self.num_experts) if granularity == "tensor" else s_up
        ws_down = s_down.reshape(self.num_experts) if granularity == "tensor" else s_down
        # the first call: every kernel through the JIT on tensor views, its launches kept
        buf = self.scratch.allocate(x.device)
        sorted_ids, block_expert, x_q, x_s, h_q, h_s = self.scratch.views(buf)
        self.align = None
        if self.on_kernel:
            grid, args, options = align_args(top_k_index.view(-1), sorted_ids, block_expert, self.num_experts,
                                             self.block_m)
            self.align = KernelCall(_moe_align_kernel, grid, args, options, ("ids_ptr", "sorted_ptr", "block_expert_ptr"))
            self.align(top_k_index, sorted_ids, block_expert)
        else:
            routing = moe_align_block_size(top_k_index, self.num_experts, self.block_m, method="torch")
            sorted_ids, block_expert = routing.sorted_pair_ids, routing.block_expert
        grid, args, options = act_quant_args(x, x_q, x_s)
        self.quant_x = KernelCall(_act_quant_kernel, grid, args, options, _QUANT_SLOTS)
        self.quant_x(x, x_q, x_s)
        h = torch.empty((self.num_pairs, self.n_up), dtype=self.dtype, device=x.device)
        grid, args, options = grouped_gemm_args(x_q, x_s, w_up, ws_up, h, sorted_ids, block_expert, self.num_pairs,
                                                self.top_k, granularity, b_up, None,
                                                replace(cfg_up, block_m=self.block_m))
        self.gemm_up = KernelCall(_grouped_fp8_gemm_kernel, grid, args, options, _GEMM_SLOTS[:5])
        self.gemm_up(x_q, x_s, h, sorted_ids, block_expert)
        g = gate(h)
        grid, args, options = act_quant_args(g, h_q, h_s)
        self.quant_h = KernelCall(_act_quant_kernel, grid, args, options, _QUANT_SLOTS)
        self.quant_h(g, h_q, h_s)
        weights = _routed_weights(top_k_weights, self.num_pairs)
        y = torch.empty((self.num_pairs, self.hidden), dtype=self.dtype, device=x.device)
        grid, args, options = grouped_gemm_args(h_q, h_s, w_down, ws_down, y, sorted_ids, block_expert,
                                                self.num_pairs, 1, granularity, b_down, weights, cfg_down)
        self.gemm_down = KernelCall(_grouped_fp8_gemm_kernel, grid, args, options, _GEMM_SLOTS)
        self.gemm_down(h_q, h_s, y, sorted_ids, block_expert, weights)
        self._first = self._finish(y)
        # every launch goes to the compiled kernel from now on (GPU, no launch hooks): raw addresses
        self.direct = all(c.direct for c in (self.align, self.quant_x, self.gemm_up, self.quant_h, self.gemm_down)
                          if c is not None)

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        return y.view(self.t, self.top_k, self.hidden).sum(dim=1, dtype=torch.float32).to(self.dtype)

    def __call__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """y (T, H) in x's dtype; x (T, H) contiguous and 16-byte aligned (the caller checks)."""
        buf = self.scratch.allocate(x.device)
        direct = self.direct
        if direct:
            sorted_ids, block_expert, x_q, x_s, h_q, h_s = self.scratch.addresses(buf)
            ids, xp = top_k_index.data_ptr(), x.data_ptr()
        else:
            sorted_ids, block_expert, x_q, x_s, h_q, h_s = self.scratch.views(buf)
            ids, xp = top_k_index, x
        if self.align is not None:
            self.align(ids, sorted_ids, block_expert)
        else:
            routing = moe_align_block_size(top_k_index, self.num_experts, self.block_m, method="torch")
            sorted_ids, block_expert = routing.sorted_pair_ids, routing.block_expert
            if direct:
                sorted_ids, block_expert = sorted_ids.data_ptr(), block_expert.data_ptr()
        self.quant_x(xp, x_q, x_s)
        h = torch.empty((self.num_pairs, self.n_up), dtype=self.dtype, device=x.device)
        self.gemm_up(x_q, x_s, h.data_ptr() if direct else h, sorted_ids, block_expert)
        g = self.gate(h)
        if not g.is_contiguous():
            g = g.contiguous()
        self.quant_h(g.data_ptr() if direct else g, h_q, h_s)
        weights = _routed_weights(top_k_weights, self.num_pairs)
        y = torch.empty((self.num_pairs, self.hidden), dtype=self.dtype, device=x.device)
        self.gemm_down(h_q, h_s, y.data_ptr() if direct else y, sorted_ids, block_expert,
                       weights.data_ptr() if direct else weights)
        return self._finish(y)

    def first_output(self) -> torch.Tensor:
        """The output of the call the plan was built from (once)."""
        out, self._first = self._first, None
        return out


def _routed_weights(top_k_weights: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """The routing weights as the down GEMM reads them: (pairs,) fp32, contiguous."""
    w = top_k_weights.reshape(num_pairs)
    return w if w.dtype == torch.float32 and w.is_contiguous() else w.float().contiguous()
