"""Fp8Experts against the real transformers experts modules (tiny models built from configs).

Tolerances (relative Frobenius error, random weights at the models' init std, fp32 unless said):
  - vs the original high-precision experts: < 8% (FP8_EXPERTS_TOL). Two FP8 GEMMs in a row,
    each with ~2-3% rounding per operand, and SwiGLU multiplying two noisy values: ~5-7%.
  - vs the dequantized-weights module (``to_experts``): < 6%; what is left is the 1x128
    activation quantization of the token rows and of the SwiGLU output.
  - vs a float64 emulation of the same FP8 numerics (quantized activations, dequantized
    weights, per pair): < 1e-3 (fp32 accumulation order; a rare 1-ulp flip when the SwiGLU
    output is re-quantized, measured up to 5e-4).
  - Triton kernel path vs reference path: < 2e-3 (same reasons as the emulation).

Kernel tests (``test_kernel_*``) run on CUDA or under ``TRITON_INTERPRET=1`` (see
``tests/ops/test_grouped_gemm.py`` for how the interpreter is switched on; the same subprocess
fallback is used here).
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from fp8linear.integrations.experts import (  # noqa: E402
    Fp8Experts,
    experts_layout,
    is_fused_experts_module,
)
from fp8linear.reference import dequantize_activation_ref, quantize_activation_ref  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
FP8_EXPERTS_TOL = 0.08  # vs the original module (see the module docstring)
ACT_QUANT_TOL = 0.06  # vs the dequantized-weights module
EMULATION_TOL = 2e-3  # vs a float64 emulation of the FP8 numerics
KERNEL_TOL = 2e-3  # Triton path vs reference path

try:
    from fp8linear.ops import grouped_gemm as _gg
    from fp8linear.ops import router as _router

    _INTERPRETED = type(_gg._grouped_fp8_gemm_kernel).__name__ == "InterpretedFunction"
except ImportError:  # no Triton
    _gg, _router, _INTERPRETED = None, None, False
KERNEL_DEVICE = "cpu" if _INTERPRETED else ("cuda" if CUDA and _gg is not None else None)
needs_kernel = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")

transformers.logging.set_verbosity_error()

_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
_MLA = dict(q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
SPECS: dict[str, dict] = {
    "deepseek_v3": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=192, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, num_hidden_layers=2,
        **_MLA, **{**_ATTN, "num_key_value_heads": 4},
    ),
    "deepseek_v2": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=192, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, num_hidden_layers=2,
        **_MLA, **{**_ATTN, "num_key_value_heads": 4},
    ),
    "qwen2_moe": dict(
        hidden_size=320, intermediate_size=512, moe_intermediate_size=192, shared_expert_intermediate_size=256,
        num_experts=8, num_experts_per_tok=4, num_hidden_layers=2, **_ATTN,
    ),
    "qwen3_moe": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=192, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=2, head_dim=64, **_ATTN,
    ),
    "mixtral": dict(
        hidden_size=320, intermediate_size=192, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
        **_ATTN,
    ),
    # GPT-OSS: transposed (E, in, out) weights, biases, interleaved gate/up and its own clamped gate.
    "gpt_oss": dict(
        hidden_size=256, intermediate_size=192, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
        head_dim=64, **_ATTN,
    ),
}
MAIN_MODELS = ["deepseek_v3", "deepseek_v2", "qwen2_moe", "qwen3_moe", "mixtral"]


@functools.lru_cache(maxsize=None)
def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **SPECS[name]))
    return model.float().eval()


def _experts(name: str) -> nn.Module:
    """A private copy of the first experts module of the tiny `name` model (biases randomised)."""
    found = [m for _, m in _model(name).named_modules() if is_fused_experts_module(m)]
    ex = copy.deepcopy(found[0])
    g = torch.Generator().manual_seed(1)
    for pname in ("gate_up_proj_bias", "down_proj_bias"):
        b = getattr(ex, pname, None)
        if isinstance(b, torch.Tensor):
            b.data = torch.randn(b.shape, generator=g) * 0.02
    return ex


def _inputs(ex_or_fp8: nn.Module, t: int, top_k: int, seed: int = 2, dtype=torch.float32):
    e, h = _dims(ex_or_fp8)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)])
    w = torch.rand(t, top_k, generator=g)
    return x, idx, w / w.sum(-1, keepdim=True)


def _dims(m: nn.Module) -> tuple[int, int]:
    if isinstance(m, Fp8Experts):
        return m.num_experts, m.hidden_dim
    lay = experts_layout(m)
    return lay.num_experts, lay.hidden_dim


def _top_k(name: str) -> int:
    return SPECS[name]["num_experts_per_tok"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _emulate(f: Fp8Experts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64, per (token, expert) pair, from the dequantized weights and quantized activations."""
    weights = f.dequantized_weights(torch.float64)
    w_up, w_down = weights[f.up_name], weights["down_proj"]
    x, idx, w = (v.to(w_up.device) for v in (x, idx, w))  # compute where the weights live
    t, top_k = idx.shape
    flat = idx.reshape(-1)
    xq, xs = quantize_activation_ref(x, f.fp8_dtype)
    xd = dequantize_activation_ref(xq, xs).double().repeat_interleave(top_k, 0)
    h = torch.einsum("sk,snk->sn", xd, w_up[flat])
    if f.has_bias:
        h = h + getattr(f, f"{f.up_name}_bias").double()[flat]
    h = f._gate(h).to(x.dtype)
    hq, hs = quantize_activation_ref(h, f.fp8_dtype)
    y = torch.einsum("sk,snk->sn", dequantize_activation_ref(hq, hs).double(), w_down[flat])
    if f.has_bias:
        y = y + f.down_proj_bias.double()[flat]
    return (y * w.reshape(-1, 1).double()).view(t, top_k, -1).sum(1)


# ----------------------------------------------------------------------------- detection
@pytest.mark.parametrize("name", list(SPECS))
def test_detects_fused_experts_in_real_models(name):
    model = _model(name)
    found = [(n, type(m).__name__) for n, m in model.named_modules() if is_fused_experts_module(m)]
    moe_layers = model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0)
    assert len(found) == moe_layers, found
    assert all(n.endswith(".experts") and cls.endswith("Experts") for n, cls in found), found
    lay = experts_layout(model.get_submodule(found[0][0]))
    assert lay.num_experts == 8 and lay.hidden_dim == SPECS[name]["hidden_size"]
    assert lay.intermediate_dim == SPECS[name].get("moe_intermediate_size", SPECS[name]["intermediate_size"])
    assert lay.is_transposed == (name == "gpt_oss") and lay.has_bias == (name == "gpt_oss")
    assert lay.custom_gate == (name == "gpt_oss")


def test_detector_rejects_other_modules():
    class OneArg(nn.Module):  # 3-D parameters but not a routed forward
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 64, 32))
            self.down_proj = nn.Parameter(torch.zeros(4, 32, 32))

        def forward(self, x):
            return x

    class BadShapes(OneArg):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    bad = BadShapes()
    bad.down_proj = nn.Parameter(torch.zeros(4, 32, 31))
    for m in (nn.Linear(8, 8), OneArg(), bad, nn.Module(), "not a module"):
        assert not is_fused_experts_module(m)
    f = Fp8Experts.from_experts(_experts("mixtral"), backend="reference")
    assert not is_fused_experts_module(f)  # already FP8


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_transformers_experts(name, granularity):
    ex = _experts(name)
    f = Fp8Experts.from_experts(ex, granularity=granularity, backend="reference")
    x, idx, w = _inputs(ex, t=9, top_k=_top_k(name))
    with torch.no_grad():
        ref = ex(x, idx, w)
        y = f(x, idx, w)
        deq = f.to_experts(torch.float32)(x, idx, w)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel(y, ref) < FP8_EXPERTS_TOL
    assert rel(y, deq) < ACT_QUANT_TOL
    assert rel(y, _emulate(f, x, idx, w)) < EMULATION_TOL


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2_moe", "mixtral"])
def test_whole_model_logits_with_fp8_experts(name):
    model = copy.deepcopy(_model(name))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
        n = 0
        for mod_name, mod in list(model.named_modules()):
            if is_fused_experts_module(mod):
                model.set_submodule(mod_name, Fp8Experts.from_experts(mod, backend="reference"))
                n += 1
        out = model(ids).logits
    assert n == model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0)
    assert sum(isinstance(m, Fp8Experts) for m in model.modules()) == n
    assert rel(out, ref) < FP8_EXPERTS_TOL


def test_bfloat16_hidden_states_and_weights():
    ex = _experts("qwen2_moe").bfloat16()
    f = Fp8Experts.from_experts(ex, backend="reference")
    x, idx, w = _inputs(ex, t=6, top_k=4, dtype=torch.bfloat16)
    with torch.no_grad():
        y, ref = f(x, idx, w.bfloat16()), ex(x, idx, w.bfloat16())
    assert y.dtype == torch.bfloat16
    assert rel(y, ref) < FP8_EXPERTS_TOL + 0.01  # bf16 output rounding on top


def test_sentinel_expert_ids_contribute_nothing():
    ex = _experts("deepseek_v3")
    f = Fp8Experts.from_experts(ex, backend="reference")
    x, idx, w = _inputs(ex, t=4, top_k=2)
    idx2 = idx.clone()
    idx2[:, 1] = 8  # expert-parallel sentinel (== E)
    with torch.no_grad():
        y = f(x, idx2, w)
        only_first = f(x, idx[:, :1], w[:, :1])
    torch.testing.assert_close(y, only_first, rtol=1e-6, atol=1e-6)


def test_gate_less_experts():
    class UpOnlyExperts(nn.Module):  # nemotron_h-style: up_proj (E, I, H), act_fn only
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.up_proj = nn.Parameter(torch.randn(4, 192, 256, generator=g) * 0.05)
            self.down_proj = nn.Parameter(torch.randn(4, 256, 192, generator=g) * 0.05)
            self.act_fn = nn.ReLU()
            self.has_gate = False

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for j, e in enumerate(top_k_index[t].tolist()):
                    h = self.act_fn(self.up_proj[e] @ hidden_states[t])
                    out[t] += top_k_weights[t, j] * (self.down_proj[e] @ h)
            return out

    ex = UpOnlyExperts()
    lay = experts_layout(ex)
    assert lay is not None and not lay.has_gate and lay.intermediate_dim == 192
    f = Fp8Experts.from_experts(ex, backend="reference")
    assert set(f.state_dict()) == {"up_proj", "up_proj_scale_inv", "down_proj", "down_proj_scale_inv"}
    x, idx, w = _inputs(ex, t=5, top_k=2)
    with torch.no_grad():
        assert rel(f(x, idx, w), ex(x, idx, w)) < FP8_EXPERTS_TOL
        assert rel(f(x, idx, w), _emulate(f, x, idx, w)) < EMULATION_TOL


@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("name", list(SPECS))
def test_cpu_path_matches_the_reference_path(name, granularity, dtype, t, monkeypatch):
    """CPU tensors under "auto" run each expert's rows through the CPU FP8 linear (no dequantized
    weights, no grouped reference): the float64 emulation's bound, the reference path's result up to
    the order of the fp32 sums (bf16: a rounding of h may differ by an ulp), sentinel ids included."""
    import fp8linear.integrations.experts as experts_mod

    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    ex = _experts(name).to(dtype)
    f = Fp8Experts.from_experts(ex, granularity=granularity)
    x, idx, w = _inputs(ex, t=t, top_k=_top_k(name), dtype=dtype)
    w = w.to(dtype)
    if t > 1:
        idx[1, 0] = f.num_experts  # an expert-parallel sentinel: no contribution
    with torch.no_grad():
        ref = Fp8Experts.from_experts(ex, granularity=granularity, backend="reference")(x, idx, w)
        monkeypatch.setattr(experts_mod, "grouped_fp8_matmul", None)  # the CPU path never calls it
        y = f(x, idx, w)
        y_again = f(x, idx, w)  # prepared expert weights reused
    assert y.shape == ref.shape and y.dtype == dtype and torch.equal(y, y_again)
    assert rel(y, ref) < (1e-5 if dtype == torch.float32 else 1e-3)
    if dtype == torch.float32 and t == 1:  # (the emulation takes no sentinel ids)
        assert rel(y, _emulate(f, x, idx, w)) < EMULATION_TOL


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("t", [1, 3, 40])
@pytest.mark.parametrize("granularity", ["block", "row"])
def test_cpu_path_runs_hit_experts_side_by_side(granularity, t, threads, monkeypatch):
    """With several intra-op threads, the CPU path runs whole experts side by side on the threads
    (router.cpu_experts_in_parallel), each linear one compiled-kernel call: up to CPU_NATIVE_MAX_M rows
    per expert the bits of one expert after the other; above (t=40: about 20 rows per expert, where
    one by one runs torch ops) the reference path's result up to the order of the fp32 sums."""
    from fp8linear.ops import cpu_native, router

    if cpu_native.native_kernel() is None:
        pytest.skip("the compiled CPU kernels do not build here")
    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    monkeypatch.setattr(router, "CPU_THREAD_MIN_ELEMS", 1)  # these small experts count as big enough
    ex = _experts("qwen2_moe").to(torch.bfloat16)
    f = Fp8Experts.from_experts(ex, granularity=granularity)
    x, idx, w = _inputs(ex, t=t, top_k=_top_k("qwen2_moe"), dtype=torch.bfloat16)
    w = w.to(torch.bfloat16)
    rows = int(torch.bincount(idx.reshape(-1)).max())
    assert (rows > router.CPU_NATIVE_MAX_M) == (t == 40)
    ran = []
    real_split = cpu_native.run_split

    def spy(tasks):
        ran.append(len(tasks))
        return real_split(tasks)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            monkeypatch.setattr(cpu_native, "run_split", spy)
            y = f(x, idx, w)
            ref = Fp8Experts.from_experts(ex, granularity=granularity, backend="reference")(x, idx, w)
            monkeypatch.setattr(router, "cpu_experts_in_parallel", lambda *args: False)
            y_serial = f(x, idx, w)
    finally:
        torch.set_num_threads(before)
    assert ran and ran[0] == len(set(idx.reshape(-1).tolist())) >= 2
    assert rel(y, ref) < 1e-3
    if rows <= router.CPU_NATIVE_MAX_M:
        assert torch.equal(y, y_serial)
    else:
        assert rel(y, y_serial) < 1e-3


def test_cpu_experts_side_by_side_rule(monkeypatch):
    """Side by side where one by one would hand rows to a worker per linear (the larger weight's work
    from CPU_THREAD_MIN_ELEMS) or run torch ops (above CPU_NATIVE_MAX_M rows), up to
    CPU_EXPERTS_NATIVE_MAX_M rows, with two or more hit experts and threads."""
    from fp8linear.ops import router

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    big, small = 1536 * 2048, 384 * 320
    assert router.cpu_experts_in_parallel(1, 8, big)
    assert router.cpu_experts_in_parallel(router.CPU_EXPERTS_NATIVE_MAX_M, 8, small)
    assert router.cpu_experts_in_parallel(router.CPU_NATIVE_MAX_M + 1, 8, small)
    assert not router.cpu_experts_in_parallel(router.CPU_NATIVE_MAX_M, 8, small)
    assert not router.cpu_experts_in_parallel(1, 8, router.CPU_THREAD_MIN_ELEMS - 1)
    assert router.cpu_experts_in_parallel(8, 8, router.CPU_THREAD_MIN_ELEMS // 8)  # rows count above the GEMV's
    assert not router.cpu_experts_in_parallel(router.CPU_EXPERTS_NATIVE_MAX_M + 1, 8, big)
    assert not router.cpu_experts_in_parallel(1, 1, big) and not router.cpu_experts_in_parallel(0, 8, big)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not router.cpu_experts_in_parallel(1, 8, big)


def test_run_split_keeps_order_and_never_waits_on_its_own_pool():
    """run_split returns the tasks' results in order; a task that splits a linear's rows over the
    pool runs the parts itself (a worker waiting on the pool it belongs to could deadlock)."""
    from fp8linear.ops import cpu_native
    from fp8linear import quantize_weight
    from fp8linear.ops.cpu_linear import cpu_fp8_linear

    if cpu_native.native_kernel() is None:
        pytest.skip("the compiled CPU kernels do not build here")
    g = torch.Generator().manual_seed(3)
    w_q, w_s = quantize_weight(torch.randn(2048, 1152, generator=g))  # 2.4M elements: a row split
    xs = [torch.randn(1, 1152, generator=g, dtype=torch.bfloat16) for _ in range(5)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        serial = [cpu_fp8_linear(x, w_q, w_s, "block") for x in xs]
        together = []
        runner = threading.Thread(target=lambda: together.extend(
            cpu_native.run_split([lambda x=x: cpu_fp8_linear(x, w_q, w_s, "block") for x in xs])), daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive(), "run_split did not finish: a worker waited on its own pool"
    finally:
        torch.set_num_threads(before)
    assert len(together) == len(xs) and all(torch.equal(a, b) for a, b in zip(together, serial))
    assert cpu_native.run_split([]) == []


@pytest.mark.parametrize("granularity", ["block", "tensor"])
def test_cpu_path_follows_in_place_weight_loads(granularity, monkeypatch):
    """The CPU path's prepared expert weights are made again when the weights and scales change in
    place (a tensor scale is folded into the prepared weight)."""
    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    ex = _experts("mixtral")
    f = Fp8Experts.from_experts(ex, granularity=granularity)
    ref = Fp8Experts.from_experts(ex, granularity=granularity, backend="reference")
    x, idx, w = _inputs(ex, t=3, top_k=2)
    names = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    with torch.no_grad():
        f(x, idx, w)
        for name in names:  # the experts in reverse order, loaded in place
            flipped = getattr(f, name).flip(0)
            getattr(f, name).copy_(flipped)
            getattr(ref, name).copy_(flipped)
        assert rel(f(x, idx, w), ref(x, idx, w)) < 1e-5


# ----------------------------------------------------------------------------- module API
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_state_dict_and_scale_shapes(granularity):
    f = Fp8Experts.from_experts(_experts("qwen2_moe"), granularity=granularity)
    sd = f.state_dict()
    assert set(sd) == {"gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"}
    assert sd["gate_up_proj"].shape == (8, 384, 320) and sd["gate_up_proj"].dtype == torch.float8_e4m3fn
    assert sd["down_proj"].shape == (8, 320, 192)
    expected = {"block": ((8, 3, 3), (8, 3, 2)), "row": ((8, 384, 3), (8, 320, 2)), "tensor": ((8,), (8,))}
    assert tuple(sd["gate_up_proj_scale_inv"].shape) == expected[granularity][0]
    assert tuple(sd["down_proj_scale_inv"].shape) == expected[granularity][1]
    assert all(sd[k].dtype == torch.float32 for k in sd if k.endswith("_scale_inv"))
    assert f.granularity == granularity

    # A state dict of another granularity loads into a fresh module (the scale shape is adopted).
    other = Fp8Experts(8, 320, 192, granularity="block" if granularity != "block" else "row")
    other.load_state_dict(sd)
    assert other.granularity == granularity
    assert torch.equal(other.down_proj.view(torch.uint8), f.down_proj.view(torch.uint8))


def test_gpt_oss_biases_and_transposed_roundtrip():
    ex = _experts("gpt_oss")
    f = Fp8Experts.from_experts(ex, granularity="row")
    assert set(f.state_dict()) == {
        "gate_up_proj", "gate_up_proj_scale_inv", "gate_up_proj_bias",
        "down_proj", "down_proj_scale_inv", "down_proj_bias",
    }
    assert f.gate_up_proj.shape == (8, 384, 256)  # stored (E, out, in) whatever the source layout
    back = f.to_experts(torch.float32)
    assert type(back) is type(ex)
    assert back.gate_up_proj.shape == ex.gate_up_proj.shape and back.down_proj.shape == ex.down_proj.shape
    assert rel(back.gate_up_proj, ex.gate_up_proj) < 0.05
    torch.testing.assert_close(back.down_proj_bias, ex.down_proj_bias)


@pytest.mark.parametrize("name", MAIN_MODELS)
def test_to_experts_restores_the_class(name):
    ex = _experts(name)
    f = Fp8Experts.from_experts(ex, granularity="block")
    back = f.to_experts(torch.bfloat16)
    assert type(back) is type(ex)
    assert {n for n, _ in back.named_parameters()} == {n for n, _ in ex.named_parameters()}
    assert back.gate_up_proj.dtype == torch.bfloat16
    deq = f.dequantized_weights(torch.float32)
    torch.testing.assert_close(back.down_proj.float(), deq["down_proj"].bfloat16().float())
    assert not any(isinstance(m, Fp8Experts) for m in back.modules())
    # the original module is untouched
    assert ex.gate_up_proj.dtype == torch.float32


def test_constructed_module_to_experts_uses_eager_fallback():
    f = Fp8Experts(4, 256, 128, granularity="row", act_fn="silu")
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            from fp8linear import quantize_weight

            w = torch.randn(getattr(f, name).shape) * 0.05
            q, s = quantize_weight(w, "row")
            getattr(f, name).copy_(q)
            getattr(f, f"{name}_scale_inv").copy_(s)
    back = f.to_experts(torch.float32)
    x, idx, w = _inputs(f, t=5, top_k=2)
    with torch.no_grad():
        assert rel(f(x, idx, w), back(x, idx, w)) < ACT_QUANT_TOL


def test_meta_module_gives_empty_fp8_shell():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **SPECS["deepseek_v3"]))
    ex = model.model.layers[1].mlp.experts
    assert is_fused_experts_module(ex)
    f = Fp8Experts.from_experts(ex, granularity="block", fp8_dtype="e4m3fnuz")
    assert f.gate_up_proj.device.type == "meta" and f.gate_up_proj.dtype == torch.float8_e4m3fnuz
    assert tuple(f.gate_up_proj_scale_inv.shape) == (8, 3, 2) and tuple(f.down_proj_scale_inv.shape) == (8, 2, 2)


def test_dtype_casts_keep_fp8_weights_and_scales():
    f = Fp8Experts.from_experts(_experts("gpt_oss"))
    f.to(torch.bfloat16)
    assert f.gate_up_proj.dtype == torch.float8_e4m3fn and f.gate_up_proj_scale_inv.dtype == torch.float32
    assert f.down_proj_bias.dtype == torch.bfloat16  # high-precision parameters do follow
    f.float()
    assert f.down_proj.dtype == torch.float8_e4m3fn and f.down_proj_bias.dtype == torch.float32


def test_extra_repr():
    f = Fp8Experts.from_experts(_experts("mixtral"), granularity="row")
    text = repr(f)
    for part in ("num_experts=8", "hidden_dim=320", "intermediate_dim=192", "granularity=row",
                 "fp8_dtype=float8_e4m3fn", "gate_up_proj=(8, 384, 320)"):
        assert part in text, text


def test_bad_input():
    ex = _experts("deepseek_v3")
    with pytest.raises(TypeError, match="fused experts module.*got Linear"):
        Fp8Experts.from_experts(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="granularity must be one of"):
        Fp8Experts.from_experts(ex, granularity="channel")
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        Fp8Experts(0, 256, 128)
    with pytest.raises(ValueError, match="unknown FP8 dtype"):
        Fp8Experts(4, 256, 128, fp8_dtype="e5m2")
    f = Fp8Experts.from_experts(ex, backend="reference")
    x, idx, w = _inputs(ex, t=3, top_k=2)
    with pytest.raises(ValueError, match=r"hidden_states must have shape \(\.\.\., H=256\), got \(3, 128\)"):
        f(x[:, :128], idx, w)
    with pytest.raises(ValueError, match=r"top_k_index must have shape \(T=3, top_k\), got \(2, 2\)"):
        f(x, idx[:2], w)
    with pytest.raises(ValueError, match="top_k_weights must have the shape of top_k_index"):
        f(x, idx, w[:, :1])
    with pytest.raises(TypeError, match="hidden_states must be bfloat16, float16 or float32, got torch.int64"):
        f(x.long(), idx, w)
    with pytest.raises(TypeError, match="top_k_index must be a torch.Tensor, got list"):
        f(x, idx.tolist(), w)


# ----------------------------------------------------------------------------- Triton path
@needs_kernel
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_kernel_path_matches_reference_path(granularity):
    ex = _experts("deepseek_v3").to(KERNEL_DEVICE)
    f = Fp8Experts.from_experts(ex, granularity=granularity, backend="triton")
    x, idx, w = (t.to(KERNEL_DEVICE) for t in _inputs(ex, t=7, top_k=2))
    with torch.no_grad():
        y = f(x, idx, w)
        f.backend = "reference"
        ref = f(x, idx, w)
    assert rel(y, ref) < KERNEL_TOL


@needs_kernel
@pytest.mark.parametrize(
    "name,t", [("gpt_oss", 5), ("qwen2_moe", 1), ("mixtral", 2)], ids=["gpt_oss-bias-gate", "single-token", "experts>pairs"]
)
def test_kernel_path_other_models(name, t):
    ex = _experts(name).to(KERNEL_DEVICE)
    f = Fp8Experts.from_experts(ex, backend="triton")
    x, idx, w = (v.to(KERNEL_DEVICE) for v in _inputs(ex, t=t, top_k=_top_k(name)))
    with torch.no_grad():
        y = f(x, idx, w)
        assert rel(y, _emulate(f, x.cpu(), idx.cpu(), w.cpu()).to(y.device)) < KERNEL_TOL
        assert rel(y, ex(x, idx, w)) < FP8_EXPERTS_TOL


def _unplanned(f: Fp8Experts, *args) -> torch.Tensor:
    f.clear_plans()  # every call a first sight: the functional ops, no plan
    return f(*args)


@needs_kernel
@pytest.mark.parametrize("name,t,dtype,kernel_align", [
    ("deepseek_v3", 1, torch.bfloat16, True), ("gpt_oss", 5, torch.float32, True),
    ("qwen2_moe", 3, torch.float16, False)],
    ids=["ds-1-bf16", "gpt_oss-bias-custom-gate-fp32", "qwen-torch-align-fp16"])
def test_kernel_path_plans_give_the_same_bits(name, t, dtype, kernel_align, monkeypatch):
    """From a signature's second call the module runs its ExpertsPlan: the functional path's bits,
    with the alignment kernel or the torch-ops alignment; replacing a parameter drops the plans."""
    if not kernel_align:
        monkeypatch.setattr(_router, "ALIGN_KERNEL_MAX_WORK", 0)
    ex = _experts(name).to(KERNEL_DEVICE)
    f = Fp8Experts.from_experts(ex, backend="triton").to(dtype)
    ref = copy.deepcopy(f)
    inputs = [tuple(v.to(KERNEL_DEVICE) for v in _inputs(ex, t=t, top_k=_top_k(name), seed=s, dtype=dtype))
              for s in range(3)]
    with torch.no_grad():
        for i, (x, idx, w) in enumerate(inputs):
            y = f(x, idx, w)
            assert len(f._plans) == (1 if i >= 1 else 0)
            assert torch.equal(y, _unplanned(ref, x, idx, w)), i
        f.has_post_expert_norm = False  # an attribute plans are made from: they go
        assert not f._plans
        f(*inputs[0])
        f(*inputs[0])
        assert f._plans
        f.down_proj_scale_inv = nn.Parameter(f.down_proj_scale_inv.detach() * 2, requires_grad=False)
        ref.down_proj_scale_inv = nn.Parameter(ref.down_proj_scale_inv.detach() * 2, requires_grad=False)
        assert not f._plans
        for x, idx, w in inputs[:2]:
            assert torch.equal(f(x, idx, w), _unplanned(ref, x, idx, w))


@needs_kernel
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"], ids=["ds", "gpt_oss-custom-gate"])
def test_module_with_plans_is_freed_when_deleted(name):
    """A planned module holds no reference cycle: deleting it frees its weights at once, without
    Python's cyclic garbage collector (whose timing is unknown: GPU memory a deleted model still
    holds is memory `torch.cuda.empty_cache` cannot hand back)."""
    import weakref

    from _utils import without_cyclic_gc

    ex = _experts(name).to(KERNEL_DEVICE)
    f = Fp8Experts.from_experts(ex, backend="triton")
    x, idx, w = (v.to(KERNEL_DEVICE) for v in _inputs(ex, t=3, top_k=_top_k(name)))
    with without_cyclic_gc(), torch.no_grad():
        for _ in range(3):
            f(x, idx, w)
        assert f._plans
        weight, module = weakref.ref(f.down_proj), weakref.ref(f)
        del f
        assert module() is None and weight() is None


@needs_kernel
def test_kernel_path_torch_compile_fullgraph():
    """The custom op's fake implementation and the routing ops trace without graph breaks."""
    ex = _experts("deepseek_v3").to(KERNEL_DEVICE)
    f = Fp8Experts.from_experts(ex, backend="triton")
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (3, 5):  # symbolic T: the fake implementations size their outputs from shapes only
        x, idx, w = (v.to(KERNEL_DEVICE) for v in _inputs(ex, t=t, top_k=2))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, idx, w), f(x, idx, w), rtol=0, atol=0)


@pytest.mark.skipif(KERNEL_DEVICE is not None, reason="kernel tests already run in this session")
@pytest.mark.skipif(_gg is None, reason="Triton not installed")
def test_interpreter_subprocess():
    """Run this file's kernel tests under TRITON_INTERPRET=1 in a fresh interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", FP8LINEAR_BACKEND="auto")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "test_kernel_",
           "-m", "not gpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-6000:] + proc.stderr[-3000:])


# ----------------------------------------------------------------------------- GPU
DS_SMALL = dict(hidden=2048, inter=1408, experts=64, top_k=6)  # DeepSeek-V3-like small dims


def _ds_experts(hidden: int, inter: int, experts: int, top_k: int, dtype=torch.bfloat16) -> nn.Module:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = DeepseekV3Config(
        hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts, num_experts_per_tok=top_k,
        n_group=1, topk_group=1,
    )
    ex = DeepseekV3Experts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.02)
        ex.down_proj.normal_(0, 0.02)
    ex = ex.to("cuda", dtype)
    # transformers' default experts implementation, where this version and GPU have it
    cfg._experts_implementation = "grouped_mm"
    try:
        with torch.no_grad():
            ex(*_ds_inputs(2, hidden, experts, top_k))
    except (KeyError, RuntimeError, ValueError, NotImplementedError):
        cfg._experts_implementation = "eager"
    return ex


def _ds_inputs(t: int, hidden: int, experts: int, top_k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, hidden, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, experts, device="cuda", generator=g)
    w, idx = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, idx, w


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("t", [1, 7, 64, 2048])
def test_gpu_experts_deepseek_dims(granularity, t):
    ex = _ds_experts(**DS_SMALL)
    f = Fp8Experts.from_experts(ex, granularity=granularity)
    x, idx, w = _ds_inputs(t, DS_SMALL["hidden"], DS_SMALL["experts"], DS_SMALL["top_k"])
    with torch.no_grad():
        y = f(x, idx, w)
        ref_path = Fp8Experts.from_experts(ex, granularity=granularity, backend="reference")(x, idx, w)
        orig = ex(x, idx, w)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert rel(y, ref_path) < 1e-2  # bf16 intermediates and output
    assert rel(y, orig) < FP8_EXPERTS_TOL + 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("t", [1, 16])
def test_gpu_cuda_graph_capture(t):
    ex = _ds_experts(**DS_SMALL)
    f = Fp8Experts.from_experts(ex)
    x, idx, w = _ds_inputs(t, DS_SMALL["hidden"], DS_SMALL["experts"], DS_SMALL["top_k"])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            f(x, idx, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = f(x, idx, w)
    x2, idx2, w2 = _ds_inputs(t, DS_SMALL["hidden"], DS_SMALL["experts"], DS_SMALL["top_k"], seed=5)
    x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager = f(x2, idx2, w2)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def experts_speed(
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 2048),
    hidden: int = 2048,
    inter: int = 1408,
    experts: int = 64,
    top_k: int = 6,
    iters: int = 30,
    cuda_graph: bool = True,
) -> list[dict[str, float]]:
    """Fp8Experts vs the BF16 transformers experts module (its default grouped_mm path) on this GPU.

    Not an assertion: prints one line per batch size and returns the rows. With `cuda_graph`,
    both sides are captured in a CUDA graph (decode-style launch cost); the BF16 grouped_mm
    path is graph-safe in transformers 5.x.
    """
    ex = _ds_experts(hidden, inter, experts, top_k)
    f = Fp8Experts.from_experts(ex)
    rows = []
    for t in tokens:
        x, idx, w = _ds_inputs(t, hidden, experts, top_k)
        row = {"tokens": t}
        for label, mod in (("bf16", ex), ("fp8", f)):
            row[f"{label}_us"] = _time_module(mod, x, idx, w, iters, cuda_graph)
        row["speedup"] = row["bf16_us"] / row["fp8_us"]
        rows.append(row)
        print(f"T={t:5d}  bf16 {row['bf16_us']:9.1f} us  fp8 {row['fp8_us']:9.1f} us  speedup {row['speedup']:.2f}x")
    return rows


def _time_module(mod: nn.Module, x, idx, w, iters: int, cuda_graph: bool) -> float:
    with torch.no_grad():
        fn = lambda: mod(x, idx, w)  # noqa: E731
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        if cuda_graph:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    fn()
                fn = graph.replay
            except RuntimeError:  # a path that cannot be captured is timed eagerly
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000.0 / iters


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm device")
def test_gpu_experts_speed_report():
    """Not a timed assertion: prints Fp8Experts vs BF16 experts (run with -s)."""
    start = time.perf_counter()
    rows = experts_speed(tokens=(1, 8, 64, 2048), iters=20)
    assert all(r["fp8_us"] > 0 for r in rows)
    print(f"speed report took {time.perf_counter() - start:.1f}s")
