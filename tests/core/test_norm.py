"""FusedRMSNorm: the module's CPU path, plans, copies and errors; its GPU path (marked gpu).

The kernel itself is checked against float64 in tests/ops/test_rmsnorm.py; models in
tests/integrations/test_fused_norms.py.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from fp8linear.norm import FusedRMSNorm



class LlamaStyleRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, written out (the formula the fused module must reproduce)."""

    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _pair(n: int, dtype: torch.dtype, device: str = "cpu", eps: float = 1e-5):
    torch.manual_seed(n)
    ref = LlamaStyleRMSNorm(n, eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref.weight.uniform_(-0.5, 1.5)
    return ref, FusedRMSNorm.from_module(ref, eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 320), (2, 5, 576), (7, 2112)])
def test_cpu_path_is_the_replaced_formula_bit_for_bit(dtype, shape):
    ref, fused = _pair(shape[-1], dtype)
    assert fused.weight is ref.weight and fused.variance_epsilon == ref.variance_epsilon
    x = torch.randn(shape).to(dtype) * 3
    with torch.no_grad():
        assert torch.equal(fused(x), ref(x))
    x32 = x.float()  # fp32 activations into a low-precision weight: result_type, as the formula
    with torch.no_grad():
        y = fused(x32)
        assert y.dtype == ref(x32).dtype and torch.equal(y, ref(x32))


def test_autograd_flows_through_the_formula():
    ref, fused = _pair(256, torch.float32)
    x = torch.randn(3, 256, requires_grad=True)
    fused(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref(x).sum().backward()
    assert torch.equal(g, x.grad)


def test_copies_and_pickles_without_plans_and_validates():
    _, fused = _pair(256, torch.bfloat16)
    fused._plans[("fake",)] = object()
    for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert clone._plans == {} and torch.equal(clone.weight, fused.weight)
    assert "256, eps=1e-05" in repr(fused)
    with pytest.raises(ValueError, match="hidden_size"):
        FusedRMSNorm(0)
    with pytest.raises(ValueError, match="eps"):
        FusedRMSNorm(8, eps=-1.0)
    with pytest.raises(ValueError, match="width 256"):
        fused(torch.randn(2, 128, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="tensor"):
        fused([1.0] * 256)
    assert list(FusedRMSNorm(8).state_dict()) == ["weight"]


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((1, 7168), torch.bfloat16), ((2048, 7168), torch.bfloat16),
                                         ((3, 4, 576), torch.float16), ((77, 2112), torch.float32)])
def test_gpu_plan_reused_and_same_as_kernel(shape, dtype):
    from fp8linear.ops.rmsnorm import rms_norm

    ref, fused = _pair(shape[-1], dtype, "cuda")
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    with torch.no_grad():
        first = fused(x)
        assert len(fused._plans) == 1
        plan = next(iter(fused._plans.values()))
        again = fused(x.clone())
        assert next(iter(fused._plans.values())) is plan and plan.call.compiled is not None
        expect = rms_norm(x, fused.weight, fused.variance_epsilon)
        assert torch.equal(first, expect) and torch.equal(again, expect)
        aten = ref(x)
    assert first.dtype == aten.dtype
    if dtype == torch.float32:  # no intermediate rounding: the sum's last bit shows everywhere
        assert torch.allclose(first, aten, rtol=2e-6, atol=0)
    else:
        assert (first == aten).double().mean() >= 0.98


@pytest.mark.gpu
def test_gpu_strided_input_weight_swap_and_moves():
    ref, fused = _pair(576, torch.bfloat16, "cuda")
    wide = torch.randn(4, 640, device="cuda", dtype=torch.bfloat16)
    x = wide[:, :576]  # a split of a wider projection's output
    with torch.no_grad():
        a, b = fused(x), fused(x)  # second call through the plan made for these strides
        assert torch.equal(a, b) and torch.equal(a, fused(x.contiguous()))
        fused.weight = nn.Parameter(fused.weight * 2)  # a new Parameter: the plan is not reused
        assert torch.equal(fused(x), (a.float() * 2).to(torch.bfloat16))
        fused.to(torch.float32)  # moves and casts forget the plans
        assert fused._plans == {}
        assert fused(x).dtype == torch.float32


@pytest.mark.gpu
def test_gpu_cuda_graph_and_compile():
    _, fused = _pair(7168, torch.bfloat16, "cuda")
    x = torch.randn(8, 7168, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = fused(x)
        fused(x)  # plan made
        static_in = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fused(static_in)
        static_in.copy_(x * 0.5)
        graph.replay()
        assert torch.equal(static_out, fused(x * 0.5))
        compiled = torch.compile(fused, fullgraph=True)
        out = compiled(x)
    assert out.dtype == eager.dtype
    torch.testing.assert_close(out.float(), eager.float(), rtol=2 ** -7, atol=0)


@pytest.mark.gpu
def test_gpu_autograd_after_a_plan_goes_through_the_formula():
    ref, fused = _pair(512, torch.float32, "cuda")
    x = torch.randn(4, 512, device="cuda")
    with torch.no_grad():
        fused(x)  # a plan exists for this shape now
    assert fused._plans
    y = fused(x)  # grad mode, weight requires grad: the ATen formula, with its backward
    assert y.grad_fn is not None
    y.sum().backward()
    assert fused.weight.grad is not None and torch.equal(y, ref(x))


def _planned(n: int, m: int):
    """A bf16 pair on the GPU whose fused module holds a plan for an (m, n) input, and that input."""
    ref, fused = _pair(n, torch.bfloat16, "cuda")
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fused(x)
        fused(x)
    assert fused._plans
    return ref, fused, x


class _Tagged(torch.Tensor):
    """A tensor subclass (as DTensor is one): its data pointer is not the kernel's to read."""


@pytest.mark.gpu
def test_gpu_tensor_subclasses_take_the_formula():
    ref, fused, x = _planned(256, 3)
    with torch.no_grad():
        tagged = x.as_subclass(_Tagged)
        out = fused(tagged)
        assert torch.equal(out.as_subclass(torch.Tensor), ref(x))


@pytest.mark.gpu
def test_gpu_plan_follows_weight_data_and_tracing():
    ref, fused, x = _planned(512, 4)
    with torch.no_grad():
        fused.weight.data = fused.weight.data.float()  # same Parameter, new storage and dtype
        y = fused(x)
        assert y.dtype == torch.float32 and torch.equal(y, fused(x))
        assert torch.allclose(y, ref.float()(x), rtol=2 ** -7, atol=0)
        traced = torch.jit.trace(fused, x)  # the tracer records the formula, not an empty tensor
        x2 = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
        assert torch.allclose(traced(x2), fused(x2), rtol=2 ** -7, atol=0)


def _two_gpus():
    return pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@_two_gpus()
def test_gpu_norm_and_linear_on_a_gpu_that_is_not_current(monkeypatch):
    """Triton launches on the current device: modules on cuda:1 called while cuda:0 is current
    (a device_map model) must still compute on cuda:1, first call, plan and planned calls alike;
    eager CUTLASS plans through the one-C++-call path too, where it is built."""
    from fp8linear import Fp8BlockLinear
    from fp8linear.ops.cutlass_gemm import CutlassCall, cutlass_available, one_call_available

    allocating = []
    real_allocating_call = CutlassCall.allocating_call
    monkeypatch.setattr(CutlassCall, "allocating_call",
                        lambda self, *a: allocating.append(real_allocating_call(self, *a)) or allocating[-1])
    torch.cuda.set_device(0)
    _, norm = _pair(7168, torch.bfloat16, "cuda:1")
    lin = Fp8BlockLinear.from_linear(nn.Linear(7168, 2112, bias=False, device="cuda:1", dtype=torch.bfloat16))
    xs = [torch.randn(m, 7168, device="cuda:1", dtype=torch.bfloat16) for m in (1, 8, 512)]
    with torch.no_grad():
        with torch.cuda.device(1):
            expect = [(norm(x), lin(x)) for x in xs]
        norm._plans.clear()
        lin.clear_plans()
        for _ in range(3):  # routed, planned, plan reused
            for x, (n_ref, l_ref) in zip(xs, expect):
                assert torch.cuda.current_device() == 0
                assert torch.equal(norm(x), n_ref) and torch.equal(lin(x), l_ref)
        torch.cuda.synchronize(1)
    if cutlass_available(torch.device("cuda:1")) and one_call_available():  # the one-C++-call plans ran too
        assert "cutlass" in {plan.route.kernel for plan in lin._plans.values()}
        assert any(call is not None for call in allocating)
