"""Fusing transformers models' RMSNorm modules (fp8linear.norm.fuse_rms_norms_) through every route
that builds an FP8 model: quantize_model_, from_pretrained and the hf quantizer config.

CPU: the fused modules compute the replaced formula in ATen ops there, so logits must be bit for
bit those of the unfused model. GPU (marked): the kernel path, against the unfused model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, Gemma2Config, Qwen3Config  # noqa: E402

from fp8linear.integrations.transformers import Fp8LinearConfig, from_pretrained, quantize_model_  # noqa: E402
from fp8linear.norm import FusedRMSNorm, fuse_rms_norms_  # noqa: E402

from _checkpoints import make_model, save_model  # noqa: E402
from conftest import HAS_CUDA  # noqa: E402

# Norm modules per tiny model (tests/_checkpoints.py, 2 layers): input + post-attention per layer
# and the final norm; DeepSeek-V3 adds q_a / kv_a per layer; Qwen3 adds q / k per layer.
EXPECTED = {"deepseek_v3": 9, "llama": 5, "qwen2": 5, "qwen3": 9}


@pytest.fixture(autouse=True)
def _offline(no_network):
    """Every test here runs without network (conftest.no_network)."""


def _model(kind: str, seed: int = 0) -> nn.Module:
    if kind == "qwen3":
        torch.manual_seed(seed)
        cfg = Qwen3Config(vocab_size=384, hidden_size=320, intermediate_size=200, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=80, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.05)
        return model
    return make_model(kind, seed)


def _norms(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, FusedRMSNorm)]


def _logits(model: nn.Module, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids.to(next(model.parameters()).device)).logits.float()


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_quantize_fuses_norms_and_keeps_logits_bits(kind):
    base = _model(kind)
    fused, plain = copy.deepcopy(base), copy.deepcopy(base)
    weights = {n: m.weight for n, m in fused.named_modules() if "norm" in type(m).__name__.lower()}
    report = quantize_model_(fused)
    quantize_model_(plain, fuse_norms=False)
    assert report.fused_norms == EXPECTED[kind] == len(_norms(fused)) and "RMSNorm modules fused" in str(report)
    assert _norms(plain) == [] and sorted(weights) == sorted(_norms(fused))
    assert fused.state_dict().keys() == plain.state_dict().keys()
    for name in _norms(fused):  # the model's own Parameter, not a copy
        assert fused.get_submodule(name).weight is weights[name]
    assert torch.equal(_logits(fused), _logits(plain))


def test_norms_that_compute_another_formula_are_left_alone():
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=384, hidden_size=256, intermediate_size=200, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    # Gemma's RMSNorm multiplies by (1 + weight) in float32: not the Llama formula.
    assert fuse_rms_norms_(model) == 0 and _norms(model) == []
    llama = make_model("llama")
    llama.model.norm.register_forward_hook(lambda *a: None)  # someone else's hook: keep the module
    layer_norm = nn.Module()
    layer_norm.norm = nn.LayerNorm(320)  # two parameters: not an RMSNorm
    assert fuse_rms_norms_(layer_norm) == 0
    assert fuse_rms_norms_(llama) == EXPECTED["llama"] - 1 and "model.norm" not in _norms(llama)
    with pytest.raises(TypeError, match="nn.Module"):
        fuse_rms_norms_("model")


class _Fp32ProductNorm(nn.Module):
    """GPT-OSS / Olmo2 style: the weight multiplies in float32, the product is rounded once."""

    def __init__(self, n: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


class _T5StyleNorm(_Fp32ProductNorm):
    """T5: rounds to the weight's dtype only when that is half precision."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        return self.weight * h


class _ClampedNorm(_Fp32ProductNorm):
    """The Llama formula but with eps as a floor on the mean square, not added to it."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp_min(self.variance_epsilon))
        return self.weight * h.to(x.dtype)


class _LlamaNorm(_Fp32ProductNorm):
    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


@pytest.mark.parametrize("cls", [_Fp32ProductNorm, _T5StyleNorm, _ClampedNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_equal_only_for_some_inputs_or_weights_are_left_alone(cls, dtype):
    """Formulas that agree with the Llama one for some dtypes or for unit weights (a fresh model's):
    the probe tries every input dtype, small rows and a random weight."""
    holder = nn.Module()
    holder.norm = cls(256, dtype)
    assert fuse_rms_norms_(holder) == 0 and isinstance(holder.norm, cls)
    holder.norm = _LlamaNorm(256, dtype)  # the control: the same structure with the Llama formula
    assert fuse_rms_norms_(holder) == 1 and isinstance(holder.norm, FusedRMSNorm)


@pytest.mark.parametrize("hook", ["backward", "state_dict"])
def test_norms_with_hooks_a_swap_would_drop_are_left_alone(hook):
    holder = nn.Module()
    holder.norm = _LlamaNorm(256, torch.bfloat16)
    if hook == "backward":
        holder.norm.register_full_backward_hook(lambda *a: None)
    else:
        holder.norm._register_state_dict_hook(lambda *a: None)
    assert fuse_rms_norms_(holder) == 0


def test_fuse_norms_option_everywhere(tmp_path):
    with pytest.raises(TypeError, match="fuse_norms must be a bool"):
        quantize_model_(make_model("llama"), fuse_norms="yes")
    with pytest.raises(TypeError, match="fuse_norms must be a bool"):
        from_pretrained(".", fuse_norms=1)
    with pytest.raises(TypeError, match="fuse_norms must be a bool"):
        Fp8LinearConfig(fuse_norms=None)
    assert Fp8LinearConfig().to_dict()["fuse_norms"] is True
    with torch.device("meta"):  # nothing to probe on the meta device: left alone
        meta = AutoModelForCausalLM.from_config(make_model("llama").config)
    assert fuse_rms_norms_(meta) == 0


def test_loaders_fuse_norms_and_keep_logits_bits(tmp_path):
    model = make_model("deepseek_v3")
    quantize_model_(model)
    model.save_pretrained(tmp_path / "fp8")
    loaded = from_pretrained(tmp_path / "fp8")
    unfused = from_pretrained(tmp_path / "fp8", fuse_norms=False)
    assert len(_norms(loaded)) == EXPECTED["deepseek_v3"] and _norms(unfused) == []
    assert torch.equal(_logits(loaded), _logits(unfused)) and torch.equal(_logits(loaded), _logits(model))
    bf16 = save_model(make_model("llama"), tmp_path / "bf16")
    on_load = AutoModelForCausalLM.from_pretrained(bf16, quantization_config=Fp8LinearConfig())
    off = AutoModelForCausalLM.from_pretrained(bf16, quantization_config=Fp8LinearConfig(fuse_norms=False))
    assert len(_norms(on_load)) == EXPECTED["llama"] and _norms(off) == []
    assert torch.equal(_logits(on_load), _logits(off))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("kind", ["deepseek_v3", "llama"])
def test_gpu_fused_model_matches_unfused(kind):
    base = _model(kind).cuda()
    fused, plain = copy.deepcopy(base), copy.deepcopy(base)
    quantize_model_(fused)
    quantize_model_(plain, fuse_norms=False)
    for _ in range(3):  # first calls, plans, planned calls
        a, b = _logits(fused), _logits(plain)
    # One rounding step of a norm output may move an FP8 activation: close, not equal.
    scale = b.abs().max()
    assert (a - b).abs().max() <= 0.05 * scale
    assert (a.argmax(-1) == b.argmax(-1)).double().mean() >= 0.9
    ids = torch.randint(0, 384, (1, 5), device="cuda")
    with torch.no_grad():
        out = fused.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11)
