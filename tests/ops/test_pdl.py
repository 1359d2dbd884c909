"""Programmatic dependent launch between act_quant and the decode GEMMs (fp8linear/ops/pdl.py)."""

from __future__ import annotations

import pytest
import torch

from fp8linear.ops import HAS_TRITON

from _utils import FP8_LINEAR_TOL, rel_err, same_bits
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


def test_pdl_only_for_decode_sizes_on_a_gpu(monkeypatch):
    from fp8linear.ops.router import SMALL_M_MAX
    from fp8linear.ops.pdl import pdl_launch
    from fp8linear.ops.router import use_pdl

    monkeypatch.delenv("FP8LINEAR_PDL", raising=False)
    assert not use_pdl(torch.device("cuda"), 1)  # opt-in: off unless asked for, never asks the device
    monkeypatch.setenv("FP8LINEAR_PDL", "yes")
    with pytest.raises(ValueError, match="FP8LINEAR_PDL must be 0 or 1"):
        use_pdl(torch.device("cuda"), 1)
    monkeypatch.setenv("FP8LINEAR_PDL", "1")
    assert not use_pdl(torch.device("cpu"), 1)
    assert not use_pdl(torch.device("cuda"), SMALL_M_MAX + 1)  # prefill: no PDL, never asks the device
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not use_pdl(torch.device("cuda"), 1)  # the interpreter runs no inline PTX
    assert pdl_launch(False) == {} and pdl_launch(True) == {"launch_pdl": True}
    from fp8linear.ops.router import route_linear

    def release_early(m, n, k):
        device = torch.device("cuda" if HAS_CUDA else "cpu")  # a CUDA device's SMs are asked for split-K
        route = route_linear(device, m, n, k, "block", torch.float8_e4m3fn, torch.bfloat16, None, True, True)
        assert route.release_early <= route.pdl
        return route.release_early

    assert not release_early(16, 576, 7168)  # no PDL in the interpreter, so no release
    if HAS_CUDA and torch.version.hip is None:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert use_pdl(torch.device("cuda"), SMALL_M_MAX) == hopper
        assert release_early(16, 576, 7168) == hopper  # split-K, K=7168
        assert release_early(16, 4096, 2048) == hopper  # tiled
        assert not release_early(16, 7168, 18432)  # long split-K


def _pdl_off(monkeypatch) -> None:
    monkeypatch.setenv("FP8LINEAR_PDL", "0")  # the router reads it for every new route


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
# split-K with early release, tiled (at M 16 and 64; on an H100 M=2 splits this 16-group K), ragged
# split-K, long split-K (no early release)
@pytest.mark.parametrize("n,k", [(576, 7168), (4096, 2048), (300, 4224), (256, 16384)])
@pytest.mark.parametrize("m", [2, 16, 64])
def test_pdl_decode_forward_same_bits_as_plain_launches(m, n, k, granularity, monkeypatch):
    monkeypatch.setenv("FP8LINEAR_PDL", "1")
    from fp8linear import dequantize_weight, fp8_linear, quantize_weight
    from fp8linear.ops.splitk_gemm import splitk_counters

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    w_q, w_s = quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.02, granularity)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    ws = splitk_counters(n, "cuda")
    xs = [torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(8)]
    with_pdl = [fp8_linear(x, w_q, w_s, bias, counters=ws) for x in xs]  # back to back: each GEMM follows its act_quant
    _pdl_off(monkeypatch)
    plain = [fp8_linear(x, w_q, w_s, bias, counters=ws) for x in xs]
    for x, a, b in zip(xs, with_pdl, plain):
        assert same_bits(a, b)
        ref = x.float() @ dequantize_weight(w_q, w_s).t() + bias.float()
        assert rel_err(a, ref) < FP8_LINEAR_TOL
    assert not ws.any()


@pytest.mark.gpu
def test_pdl_under_cuda_graphs_with_a_producer_in_between(monkeypatch):
    """Graph of three decode linears, each fed by the previous one's output through an
    elementwise op: a GEMM that read x before act_quant finished would differ from eager. Our
    kernels only (backend "triton"): where a routes table sends a decode GEMM to cuBLAS, graph and
    eager calls may run different kernels (eager plans take the one-launch decode kernel)."""
    monkeypatch.setenv("FP8LINEAR_PDL", "1")
    from torch import nn

    from fp8linear import Fp8BlockLinear

    torch.manual_seed(0)
    layers = [Fp8BlockLinear.from_linear(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16), "block",
                                         backend="triton")
              for k, n in ((7168, 2048), (2048, 7168), (7168, 576))]

    def run(x):
        for layer in layers:
            x = torch.nn.functional.silu(layer(x))
        return x

    static_x = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16)
    run(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run(static_x)
    for _ in range(5):
        fresh = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(static_y, run(fresh))
