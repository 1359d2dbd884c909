"""The kernels and what picks them.

- one module per Triton kernel, each `@triton.jit` kernel followed by its thin launcher:
  :mod:`.quant`, :mod:`.gemm`, :mod:`.splitk_gemm`, :mod:`.fused_gemv`, :mod:`.fused_decode`,
  :mod:`.grouped_gemm` (shared building blocks in :mod:`.gemm_common`), cuBLAS blockwise FP8
  in :mod:`.cublas_gemm` (cuBLASLt called in :mod:`.cublaslt`, activations padded for it in
  :mod:`.cublas_pad`), and CUTLASS's Hopper kernels in :mod:`.cutlass_gemm` (source in
  ``cutlass/``, built by ``fp8linear build-cutlass``);
- the FP8 linear on CPU tensors: :mod:`.cpu_linear`;
- the one router (:mod:`.router`: every choice of backend, kernel and launch config, with its
  heuristics) and the plans that run its routes (:mod:`.linear`, :mod:`.launch`);
- launch configs: the dataclasses in :mod:`.configs`, tuned per-device tables read from the data
  folder ``tuned_configs/`` by :mod:`.config_tables` and ``tuned_configs/routes/`` by
  :mod:`.route_table`.

Launchers assume validated inputs (see :mod:`fp8linear.functional`) and are importable only
where Triton is installed; :data:`HAS_TRITON` says whether it is.
"""

from __future__ import annotations

from ..backend import HAS_TRITON

__all__ = ["HAS_TRITON"]
