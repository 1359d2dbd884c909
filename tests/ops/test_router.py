"""The one router (fp8linear/ops/router.py): it decides for CPU-only installs too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Imports fp8linear with Triton made unimportable, then asks the router for each kind of decision and
# runs a CPU linear through it.
_WITHOUT_TRITON = r"""
import sys

class NoTriton:
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed here")

sys.meta_path.insert(0, NoTriton())
import torch
import fp8linear
from fp8linear.ops import router

cpu = torch.device("cpu")
assert not router.HAS_TRITON and router.TensorDescriptor is None
assert router.resolve_backend("auto", cpu) == "reference" and router.cpu_fast_path("auto", cpu)
assert router.use_cpu_native(1) and not router.use_cpu_native(router.CPU_NATIVE_MAX_M + 1)
assert router.cpu_row_parts(128, 128, 1) == [(0, 128)]
assert router.select_config(cpu, 4096, 7168, 7168).block_m == 128
assert router.splitk_config(1, 64, 7168, cpu).split_k > 1  # 4 "SMs" on the CPU
assert router.gemv_config(1, 576, 7168).block_n == 8
assert router.grouped_config(1024, 8, 2048, 7168).block_m == 64  # 128 rows per expert
assert not router.use_pdl(cpu, 1)
route = router.route_linear(cpu, 4096, 7168, 512, "block", torch.float8_e4m3fn, torch.bfloat16, None, True, True)
assert route.kernel == "tiled", route
layer = fp8linear.Fp8BlockLinear.from_linear(torch.nn.Linear(256, 192))
assert layer(torch.randn(3, 256)).shape == (3, 192)
print("ok")
"""


def test_router_decides_without_triton():
    """The router, and the CPU path it sends calls to, import and run where Triton is not installed."""
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_n_major_row_scales_rule():
    """1x128 scales go N-major to our kernels from N_MAJOR_SCALE_MIN_M rows (the warp-specialized
    kernel from N_MAJOR_SCALE_WS_MIN_K), never for other granularities, cuBLAS or the GEMV."""
    import torch

    from fp8linear.ops import router
    from fp8linear.ops.router import N_MAJOR_SCALE_MIN_M as M0, N_MAJOR_SCALE_WS_MIN_K as K0, Route

    for kernel in ("tiled", "splitk", "decode"):
        assert router.use_n_major_scales(Route(kernel), M0, 576, "row")
        assert not router.use_n_major_scales(Route(kernel), M0 - 1, 7168, "row")
        assert not router.use_n_major_scales(Route(kernel), 4096, 7168, "block")
    assert router.use_n_major_scales(Route("ws"), M0, K0, "row")
    assert not router.use_n_major_scales(Route("ws"), 4096, K0 - 128, "row")
    for kernel in ("cublas", "gemv", "persistent"):
        assert not router.use_n_major_scales(Route(kernel), 4096, 7168, "row")
    # CUTLASS's 1x128-weight kernels read N-major scales only, at every M and K
    assert router.use_n_major_scales(Route("cutlass"), 1, 576, "row")
    assert not router.use_n_major_scales(Route("cutlass"), 4096, 7168, "block")
    w_s = torch.ones(300, 5)
    n_major = w_s.t().contiguous().t()
    assert router.dense_scale(w_s, "row") and router.dense_scale(n_major, "row")
    assert not router.dense_scale(n_major, "block") and not router.dense_scale(w_s[:, ::2], "row")


def test_row_wise_weights_get_64x128_tiles_above_decode_without_a_table():
    """Without a table entry, 1x128 weights above SMALL_M_MAX rows run ROW_MID_CONFIG at every M (a
    128x128 tile, 128x128 weights' prefill config, promotes each product with a scale per column),
    on the GPU's heuristic and on the CPU's; 128x128 weights keep theirs; AMD's heuristic is its own."""
    import torch

    from fp8linear.ops import router
    from fp8linear.ops.router import ROW_MID_CONFIG, SMALL_M_MAX

    cpu = torch.device("cpu")
    for m in (SMALL_M_MAX + 1, 333, 1024, 4096, 16384):
        assert router.heuristic_config(m, 18432, 7168, "row") == ROW_MID_CONFIG
        assert router.select_config(cpu, m, 7168, 2048, "row") == ROW_MID_CONFIG
        assert router.config_for_arch("no-such-gpu", m, 576, 7168, "row") == ROW_MID_CONFIG
    assert (ROW_MID_CONFIG.block_m, ROW_MID_CONFIG.block_n, ROW_MID_CONFIG.num_warps, ROW_MID_CONFIG.num_stages) == (
        64, 128, 4, 3)
    assert router.heuristic_config(4096, 18432, 7168, "block").block_m == 128  # unchanged for 128x128 weights
    assert router.heuristic_config(4096, 18432, 7168) == router.heuristic_config(4096, 18432, 7168, "block")
    assert router.heuristic_config(SMALL_M_MAX, 18432, 7168, "row") == router.heuristic_config(SMALL_M_MAX, 18432, 7168)
    assert router.config_for_arch("gfx942", 4096, 3000, 5000, "row") == router.amd_heuristic_config(4096, 3000, 5000)
