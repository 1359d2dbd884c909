"""fp8linear.integrations.transformers on small real-architecture models built from configs.

CPU (reference backend) unless marked gpu. The network is blocked for every test here.
Tolerance: FP8 weights (e4m3, 3 mantissa bits) and 1x128 activation quantization give each
linear layer ~3-5% relative error on random weights; random-weight models amplify it and a
perturbed MoE router picks other experts for some tokens. Measured over seeds on these 2-3
layer models: logits relative L2 error vs BF16 0.05-0.30, cosine > 0.95, top-1 agreement
0.69-0.91. We assert relative error < 0.35 and cosine > 0.93. Exactness of loading is checked
bit for bit separately.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    LlamaConfig,
    Qwen2MoeConfig,
)

from fp8linear import Fp8BlockLinear, dequantize_weight, quantize_weight  # noqa: E402
from _utils import rel_err  # noqa: E402
from fp8linear.integrations.experts import Fp8Experts  # noqa: E402
from fp8linear.integrations.transformers import (  # noqa: E402
    Fp8LinearConfig,
    QuantizeReport,
    from_pretrained,
    quantize_model_,
    save_pretrained,
)

# Logits tolerance of FP8 vs BF16 on these random tiny models (see module docstring).
REL_TOL = 0.35
COS_TOL = 0.93


@pytest.fixture(autouse=True)
def _offline(no_network):
    """Every test here runs without network (conftest.no_network)."""


# ----------------------------------------------------------------------------- models
def ds3_config(moe_intermediate: int = 96) -> DeepseekV3Config:
    # hidden 320 and moe intermediate 96 are not multiples of 128 (ragged scale grids).
    return DeepseekV3Config(
        vocab_size=256, hidden_size=320, intermediate_size=448, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=128, tie_word_embeddings=False,
    )


def ds2_config() -> DeepseekV2Config:
    return DeepseekV2Config(
        vocab_size=256, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=128, topk_method="greedy", n_group=1, topk_group=1,
    )


def llama_config() -> LlamaConfig:
    # SmolLM2-like: hidden 192, intermediate 300 (not multiples of 128), tied embeddings.
    return LlamaConfig(
        vocab_size=256, hidden_size=192, intermediate_size=300, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )


def qwen2_moe_config() -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        vocab_size=256, hidden_size=192, intermediate_size=320, moe_intermediate_size=96,
        shared_expert_intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )


CONFIGS = {"deepseek_v3": ds3_config, "deepseek_v2": ds2_config, "llama": llama_config, "qwen2_moe": qwen2_moe_config}
# (Linear layers replaced, experts modules replaced, modules kept) for each model above.
EXPECTED_COUNTS = {
    # layer 0 dense: q_a,q_b,kv_a,kv_b,o + gate/up/down; layers 1-2: 5 attention + 3 shared expert
    "deepseek_v3": (24, 2, ["lm_head"]),
    # no q_lora: q_proj,kv_a,kv_b,o + 3 mlp (layer 0) / 3 shared (layer 1)
    "deepseek_v2": (14, 1, ["lm_head"]),
    "llama": (14, 0, ["lm_head"]),
    # per layer: q,k,v,o + shared gate/up/down; kept: shared_expert_gate x2 + lm_head
    "qwen2_moe": (14, 2, ["lm_head", "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert_gate"]),
}


def build(name: str, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](**kw), dtype=torch.bfloat16)
    # As transformers' from_pretrained does (`_keep_in_fp32_modules_strict`): the router bias stays fp32.
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias = mod.e_score_correction_bias.float()
    return model.eval()


def ids(n: int = 16, batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)


@torch.no_grad()
def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits.float()


def assert_close_logits(out: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((out - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    assert rel < REL_TOL and cos > COS_TOL, f"FP8 logits too far from BF16: rel {rel:.3f}, cos {cos:.4f}"


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        x, y = sa[k], sb[k]
        assert x.shape == y.shape and x.dtype == y.dtype, f"{k}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
        if x.element_size() == 1:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), f"{k} differs after reload"


def grouped_names(model: nn.Module) -> list[list[str]]:
    """The model's FP8 linears that share their input quantization, by group."""
    groups: dict[int, list[str]] = {}
    for n, m in model.named_modules():
        if isinstance(m, Fp8BlockLinear) and m._input_share is not None:
            groups.setdefault(id(m._input_share), []).append(n)
    return sorted(groups.values())


def sibling_names(model: nn.Module) -> list[list[str]]:
    """The FP8 linears that are children of one module with one input width, by group of 2 or more."""
    out = []
    for pn, parent in model.named_modules():
        by_width: dict[int, list[str]] = {}
        for cn, child in parent.named_children():
            if isinstance(child, Fp8BlockLinear):
                by_width.setdefault(child.in_features, []).append(f"{pn}.{cn}" if pn else cn)
        out += [g for g in by_width.values() if len(g) > 1]
    return sorted(out)


# ----------------------------------------------------------------------------- quantize_model_
@pytest.mark.parametrize("name", list(CONFIGS))
def test_replacement_counts_and_logits(name):
    model = build(name)
    x = ids()
    ref = logits(model, x)
    report = quantize_model_(model)
    n_linear, n_experts, kept = EXPECTED_COUNTS[name]
    assert isinstance(report, QuantizeReport)
    assert report.replaced.get("Linear", 0) == n_linear
    assert sum(v for k, v in report.replaced.items() if k != "Linear") == n_experts
    assert sorted(report.kept) == sorted(kept)
    assert sum(isinstance(m, Fp8BlockLinear) for m in model.modules()) == n_linear
    assert sum(isinstance(m, Fp8Experts) for m in model.modules()) == n_experts
    assert not any(type(m) is nn.Linear and n not in kept for n, m in model.named_modules())
    assert report.bytes_after < report.bytes_before
    assert report.quantized_bytes_after < 0.55 * report.quantized_bytes_before
    assert "replaced" in str(report) and "Linear" in str(report)
    assert model.config.quantization_config["quant_method"] == "fp8"
    groups = grouped_names(model)  # q / k / v and gate / up quantize their common input once
    assert groups and groups == sibling_names(model)
    assert any(any(n.endswith("q_proj") or n.endswith("q_a_proj") for n in g) for g in groups)
    assert_close_logits(logits(model, x), ref)


def test_share_inputs_off_and_bad():
    model = build("llama")
    quantize_model_(model, share_inputs=False)
    assert grouped_names(model) == [] and sibling_names(model)
    with pytest.raises(TypeError, match="share_inputs must be a bool"):
        quantize_model_(build("llama"), share_inputs="yes")
    with pytest.raises(TypeError, match="share_inputs must be a bool"):
        from_pretrained(".", share_inputs=1)


def test_routers_embeddings_head_kept_and_ignore():
    model = build("deepseek_v3")
    router_dtype = model.model.layers[1].mlp.gate.weight.dtype  # bf16, or fp32 where transformers keeps routers so
    report = quantize_model_(model, granularity="row", ignore=[r"layers\.0\.mlp\.", r"\.kv_b_proj$"])
    assert type(model.lm_head) is nn.Linear
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert type(model.model.layers[1].mlp.gate).__name__ == "DeepseekV3TopkRouter"
    assert model.model.layers[1].mlp.gate.weight.dtype == router_dtype  # kept as it was
    assert type(model.model.layers[0].mlp.gate_proj) is nn.Linear
    assert type(model.model.layers[2].self_attn.kv_b_proj) is nn.Linear
    assert isinstance(model.model.layers[2].self_attn.q_b_proj, Fp8BlockLinear)
    assert model.model.layers[2].self_attn.q_b_proj.granularity == "row"
    assert "model.layers.0.mlp.gate_proj" in report.kept
    assert model.config.quantization_config["weight_block_size"] == [1, 128]


def test_bad_input():
    with pytest.raises(ValueError, match="granularity"):
        quantize_model_(build("llama"), granularity="blocks")
    with pytest.raises(TypeError, match="nn.Module"):
        quantize_model_("not a model")
    with pytest.raises(ValueError, match="regex"):
        quantize_model_(build("llama"), ignore=["("])
    with pytest.raises(ValueError, match="granularity"):
        Fp8LinearConfig(granularity="channel")
    with pytest.raises(ValueError, match="FP8 dtype"):
        Fp8LinearConfig(fp8_dtype="e5m2")
    with pytest.raises(TypeError, match="dtype"):
        from_pretrained(".", dtype="bf16")


# ----------------------------------------------------------------------------- GPTQ calibration
def _no_hooks_left(model: nn.Module) -> bool:
    return not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@torch.no_grad()
def _linear_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Input rows of every nn.Linear of `model` on `x`."""
    seen: dict[str, torch.Tensor] = {}

    def hook(mod, args, name):
        seen.setdefault(name, args[0].float().reshape(-1, args[0].shape[-1]))

    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: hook(mod, a, n)) for n, m in model.named_modules() if type(m) is nn.Linear]
    model(x)
    for h in handles:
        h.remove()
    return seen


def _assert_gptq_beats_rtn(model: nn.Module, rtn: nn.Module, bf16: nn.Module, held_out: dict[str, torch.Tensor]) -> None:
    """Same scales and format as round-to-nearest; lower output error per layer on held-out inputs.

    Each layer's error, GPTQ / round-to-nearest, measured on the test models: 0.46-1.10 (a
    near-isotropic down_proj overfits its 2,048 calibration rows a little), mean 0.70-0.85.
    Asserted: every layer < 1.15, mean < 0.92. Experts are rounded to nearest: identical.
    """
    rtn_mods, bf16_mods = dict(rtn.named_modules()), dict(bf16.named_modules())
    ratios = []
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8BlockLinear):
            other = rtn_mods[name]
            assert torch.equal(mod.weight_scale_inv, other.weight_scale_inv) and mod.weight.dtype == other.weight.dtype
            xs = held_out[name]
            ref = xs @ bf16_mods[name].weight.float().T
            err = [rel_err(xs @ dequantize_weight(m.weight, m.weight_scale_inv).T, ref) for m in (mod, other)]
            ratios.append(err[0] / err[1])
        elif isinstance(mod, Fp8Experts):
            assert_same_state(mod, rtn_mods[name])
    assert max(ratios) < 1.15 and sum(ratios) / len(ratios) < 0.92, f"GPTQ / RTN error per layer: {ratios}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gptq_calibration(name):
    # Random tokens through random-weight models: calibration and test data from the same distribution.
    # Errors are compared per layer on held-out inputs captured in the BF16 model, not on the logits:
    # in MoE models a perturbed router picks other experts, which swamps the difference.
    bf16 = build(name)
    x = ids(64, 8, seed=1)
    held_out = _linear_inputs(bf16, x)
    rtn = build(name)
    quantize_model_(rtn)
    model = build(name)
    report = quantize_model_(model, calibration_data=[ids(64, 8, seed=s) for s in (11, 12, 13, 14)])
    n_linear, n_experts, kept = EXPECTED_COUNTS[name]
    assert report.replaced.get("Linear", 0) == n_linear and report.gptq_layers == n_linear
    assert sum(isinstance(m, Fp8Experts) for m in model.modules()) == n_experts
    assert sorted(report.kept) == sorted(kept) and "GPTQ" in str(report)
    assert _no_hooks_left(model)
    _assert_gptq_beats_rtn(model, rtn, bf16, held_out)
    assert_close_logits(logits(model, x), logits(bf16, x))


def test_gptq_model_saves_and_reloads(tmp_path):
    model = build("llama")
    quantize_model_(model, granularity="row", calibration_data=[ids(32, 2, seed=5)])
    save_pretrained(model, tmp_path)
    reloaded = from_pretrained(tmp_path)
    assert_same_state(model, reloaded)


def test_gptq_layer_the_data_never_reaches_is_rounded_to_nearest():
    model = build("llama")
    model.model.unused = nn.Linear(192, 64, bias=False, dtype=torch.bfloat16)  # outside any numbered block
    w = model.model.unused.weight.detach().clone()
    report = quantize_model_(model, calibration_data=[ids(32, 2, seed=5)])
    assert report.replaced["Linear"] == 15 and report.gptq_layers == 14
    w_q, w_s = quantize_weight(w, "block")
    assert torch.equal(model.model.unused.weight.view(torch.uint8), w_q.view(torch.uint8))
    assert torch.equal(model.model.unused.weight_scale_inv, w_s)


def test_calibration_groups_and_order():
    from fp8linear.integrations.calibration import calibration_groups

    names = ["model.layers.10.mlp.down_proj", "model.layers.2.self_attn.q_proj", "proj_out", "model.layers.2.mlp.up_proj"]
    assert calibration_groups(names) == {
        "model.layers.10": ["model.layers.10.mlp.down_proj"],
        "model.layers.2": ["model.layers.2.self_attn.q_proj", "model.layers.2.mlp.up_proj"],
        "": ["proj_out"],
    }


def test_gptq_bad_input():
    from fp8linear.gptq import GPTQConfig

    model = build("llama")
    for data, err, msg in [
        ([], ValueError, "empty"),
        (ids(), TypeError, "list or tuple"),
        ([ids().float()], ValueError, r"calibration_data\[0\] must be integer input_ids"),
        ([ids()[0]], ValueError, "shape"),
        ([3], TypeError, r"calibration_data\[0\]"),
    ]:
        with pytest.raises(err, match=msg):
            quantize_model_(model, calibration_data=data)
        assert not any(isinstance(m, Fp8BlockLinear) for m in model.modules()), "bad data must leave the model alone"
    with pytest.raises(ValueError, match="without calibration_data"):
        quantize_model_(model, gptq=GPTQConfig())
    with pytest.raises(TypeError, match="GPTQConfig"):
        quantize_model_(model, calibration_data=[ids()], gptq={"damp": 0.1})
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(llama_config())
    with pytest.raises(ValueError, match="meta device"):
        quantize_model_(meta, calibration_data=[ids()])


# ----------------------------------------------------------------------------- save / load
@pytest.mark.parametrize(
    "name,granularity", [("deepseek_v3", "block"), ("qwen2_moe", "row"), ("llama", "tensor"), ("deepseek_v2", "block")]
)
def test_save_reload_identity(tmp_path, name, granularity):
    model = build(name)
    quantize_model_(model, granularity=granularity)
    save_pretrained(model, tmp_path, max_shard_size="300KB")
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "fp8" and cfg["activation_scheme"] == "dynamic" and cfg["fmt"] == "e4m3"
    assert cfg["weight_block_size"] == {"block": [128, 128], "row": [1, 128], "tensor": None}[granularity]
    assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded
    reloaded = from_pretrained(tmp_path)
    assert_same_state(model, reloaded)
    assert grouped_names(reloaded) == grouped_names(model) == sibling_names(model) != []
    assert grouped_names(from_pretrained(tmp_path, share_inputs=False)) == []
    x = ids()
    assert torch.equal(logits(model, x), logits(reloaded, x))


def test_hf_quantizer_quantizes_while_loading(tmp_path):
    bf16 = build("deepseek_v3")
    bf16.save_pretrained(tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=Fp8LinearConfig(granularity="row"), dtype=torch.bfloat16
    )
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    quantize_model_(expected, granularity="row")
    assert isinstance(model.model.layers[1].mlp.experts, Fp8Experts)
    assert_same_state(model, expected)
    assert grouped_names(model) == sibling_names(model) != []
    assert model.config.quantization_config["quant_method"] == "fp8"
    model.save_pretrained(tmp_path / "fp8")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [1, 128]
    assert_same_state(model, from_pretrained(tmp_path / "fp8"))


def _official_checkpoint(src: nn.Module, path: Path, extra: dict[str, torch.Tensor] | None = None) -> dict:
    """Write `src` as an official DeepSeek-V3 FP8 checkpoint: per-expert tensors, 128x128 blocks, 2 shards."""
    tensors: dict[str, torch.Tensor] = {}
    for key, t in src.state_dict().items():
        t = t.detach()
        if key.endswith("experts.gate_up_proj"):
            prefix = key.removesuffix(".gate_up_proj")
            inter = t.shape[1] // 2
            for j in range(t.shape[0]):
                for proj, part in (("gate_proj", t[j, :inter]), ("up_proj", t[j, inter:])):
                    q, s = quantize_weight(part.contiguous(), "block")
                    tensors[f"{prefix}.{j}.{proj}.weight"], tensors[f"{prefix}.{j}.{proj}.weight_scale_inv"] = q, s
        elif key.endswith("experts.down_proj"):
            prefix = key.removesuffix(".down_proj")
            for j in range(t.shape[0]):
                q, s = quantize_weight(t[j].contiguous(), "block")
                tensors[f"{prefix}.{j}.down_proj.weight"], tensors[f"{prefix}.{j}.down_proj.weight_scale_inv"] = q, s
        elif t.dim() == 2 and key.endswith("proj.weight") or key.endswith("kv_a_proj_with_mqa.weight"):
            q, s = quantize_weight(t, "block")
            tensors[key], tensors[key.removesuffix(".weight") + ".weight_scale_inv"] = q, s
        else:
            tensors[key] = t.contiguous()
    tensors.update(extra or {})
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = src.config.to_dict()
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    }
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def _load_dequantized_(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set `model`'s weights (fp32) to the dequantized official checkpoint, fusing experts."""
    def deq(name: str) -> torch.Tensor:
        scale = tensors.get(name + "_scale_inv")
        return dequantize_weight(tensors[name], scale) if scale is not None else tensors[name].float()

    with torch.no_grad():
        for key, p in model.state_dict().items():
            if key.endswith("experts.gate_up_proj"):
                prefix = key.removesuffix(".gate_up_proj")
                p.copy_(torch.stack([torch.cat([deq(f"{prefix}.{j}.gate_proj.weight"), deq(f"{prefix}.{j}.up_proj.weight")])
                                     for j in range(p.shape[0])]))
            elif key.endswith("experts.down_proj"):
                prefix = key.removesuffix(".down_proj")
                p.copy_(torch.stack([deq(f"{prefix}.{j}.down_proj.weight") for j in range(p.shape[0])]))
            else:
                p.copy_(deq(key))


@pytest.mark.parametrize("moe_intermediate", [128, 96])
def test_official_deepseek_v3_format(tmp_path, moe_intermediate):
    src = build("deepseek_v3", moe_intermediate=moe_intermediate)
    # The MTP layer of the real checkpoint (layer 61) is ignored by the model class, as in transformers.
    mtp = {"model.layers.61.eh_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    tensors = _official_checkpoint(src, tmp_path, mtp)
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in tensors
    model = from_pretrained(tmp_path)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.granularity == "block"
    p = "model.layers.1.mlp.experts.5"
    gate = dequantize_weight(tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.gate_proj.weight_scale_inv"])
    up = dequantize_weight(tensors[f"{p}.up_proj.weight"], tensors[f"{p}.up_proj.weight_scale_inv"])
    fused = dequantize_weight(experts.gate_up_proj[5], experts.gate_up_proj_scale_inv[5])
    if moe_intermediate % 128 == 0:  # scale grids concatenate: bit-exact
        assert torch.equal(experts.gate_up_proj[5].view(torch.uint8),
                           torch.cat([tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"]]).view(torch.uint8))
        assert torch.equal(fused, torch.cat([gate, up]))
    else:  # a block straddles gate/up: requantized, within FP8 rounding of the original
        ref = torch.cat([gate, up])
        assert ((fused - ref).norm() / ref.norm()).item() < 0.05
    down = dequantize_weight(tensors[f"{p}.down_proj.weight"], tensors[f"{p}.down_proj.weight_scale_inv"])
    assert torch.equal(dequantize_weight(experts.down_proj[5], experts.down_proj_scale_inv[5]), down)
    q_a = model.model.layers[0].self_attn.q_a_proj
    assert torch.equal(q_a.weight.view(torch.uint8), tensors["model.layers.0.self_attn.q_a_proj.weight"].view(torch.uint8))
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert_close_logits(logits(model, ids()), logits(src, ids()))
    # Bit-exact FP8 weights: quantizing the dequantized checkpoint again gives the same bytes.
    expected = build("deepseek_v3", moe_intermediate=moe_intermediate).float()
    _load_dequantized_(expected, tensors)
    quantize_model_(expected)
    got, want = model.state_dict(), expected.state_dict()
    for k, v in got.items():
        if v.element_size() == 1:
            assert torch.equal(v.view(torch.uint8), want[k].view(torch.uint8)), k
        elif k.endswith("_scale_inv"):
            torch.testing.assert_close(v, want[k], rtol=1e-6, atol=0, msg=k)
    # Saved again by us (fused experts), it reloads to the same tensors.
    save_pretrained(model, tmp_path / "resaved")
    assert_same_state(model, from_pretrained(tmp_path / "resaved"))


def test_checkpoint_errors_name_the_tensor(tmp_path):
    model = build("llama")
    quantize_model_(model)
    save_pretrained(model, tmp_path / "ok")
    # config.json that does not match the tensors
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg["intermediate_size"] = 320
    bad = tmp_path / "badshape"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    shutil.copy(tmp_path / "ok" / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(gate|up)_proj\.weight.*shape \(300, 192\).*\(320, 192\)"):
        from_pretrained(bad)
    # a missing and an unexpected tensor
    tensors = load_file(str(tmp_path / "ok" / "model.safetensors"))
    for case, change in (("missing", "drop"), ("unexpected", "add")):
        d = tmp_path / case
        d.mkdir()
        (d / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
        t = dict(tensors)
        if change == "drop":
            del t["model.layers.1.self_attn.o_proj.weight_scale_inv"]
            del t["model.layers.1.self_attn.o_proj.weight"]
            match = r"lacks .*model\.layers\.1\.self_attn\.o_proj\.weight"
        else:
            t["model.layers.1.extra.weight"] = torch.zeros(2)
            match = r"does not use: model\.layers\.1\.extra\.weight"
        save_file(t, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            from_pretrained(d)
    # an index pointing outside the folder
    esc = tmp_path / "escape"
    esc.mkdir()
    (esc / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (esc / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "../ok/model.safetensors"}})
    )
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        from_pretrained(esc)
    link = tmp_path / "link"
    link.mkdir()
    (link / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (link / "model.safetensors").symlink_to(tmp_path / "ok" / "model.safetensors")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        from_pretrained(link)
    # not an FP8 checkpoint, and a pickle-only folder
    build("llama").save_pretrained(tmp_path / "bf16")
    with pytest.raises(ValueError, match="no FP8 tensors"):
        from_pretrained(tmp_path / "bf16")
    pk = tmp_path / "pickle"
    pk.mkdir()
    (pk / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (pk / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pickle checkpoints are not supported"):
        from_pretrained(pk)


def test_generate_cpu(tmp_path):
    bf16 = build("llama")
    quantized = build("llama")
    quantize_model_(quantized)
    save_pretrained(quantized, tmp_path)
    model = from_pretrained(tmp_path, device_map={"": "cpu"})
    prompt = ids(8, batch=1)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, **kwargs)
    assert out.shape == (1, 16) and torch.equal(out[:, :8], prompt)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(out, static)
    ref = bf16.generate(prompt, **kwargs)
    assert (ref[0, 8:] == out[0, 8:]).float().mean() >= 0.5  # random tiny model: loose agreement



def test_per_module_device_map_needs_no_container_entries(tmp_path):
    """A map that names only leaf modules (as accelerate's infer_auto_device_map returns) loads: the
    root, `model` and `model.layers` hold no tensors and need no entry; a tensor left unplaced is an error."""
    quantized = build("deepseek_v3")
    quantize_model_(quantized)
    save_pretrained(quantized, tmp_path)
    layers = {f"model.layers.{i}": "cpu" for i in range(quantized.config.num_hidden_layers)}
    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu", **layers}
    model = from_pretrained(tmp_path, device_map=dmap)
    assert_same_state(model, quantized)
    del dmap["model.norm"]
    with pytest.raises(ValueError, match="device_map does not place 'model.norm'"):
        from_pretrained(tmp_path, device_map=dmap)

# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_generate_static_cache_compiled(tmp_path):
    bf16 = build("deepseek_v3", moe_intermediate=128).cuda()
    quantized = build("deepseek_v3", moe_intermediate=128)
    quantize_model_(quantized)
    save_pretrained(quantized, tmp_path)
    model = from_pretrained(tmp_path, device_map="cuda")
    assert model.model.layers[1].mlp.experts.gate_up_proj.is_cuda
    prompt = ids(12, batch=2).cuda()
    assert_close_logits(logits(model, prompt), logits(bf16, prompt))
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    # Static cache on a GPU: generate() compiles the forward with torch.compile(mode="reduce-overhead")
    # (CUDA graphs) itself; wrapping forward in torch.compile as well nests two compilations, which
    # failed on H100 ("accessing tensor output of CUDAGraphs that has been overwritten").
    eager = model.generate(prompt, **kwargs)
    model.generation_config.cache_implementation = "static"
    compiled = model.generate(prompt, **kwargs)
    compiled2 = model.generate(prompt, **kwargs)  # replays the captured CUDA graphs
    assert getattr(model, "_compiled_call", None) is not None, "generate() did not compile the forward"
    assert torch.equal(compiled, compiled2)
    assert compiled.shape == eager.shape and torch.equal(compiled[:, :12], prompt)
    # Greedy sequences of a random-weight model part ways after the first near-tie that compiled
    # and eager kernels round differently (measured on H100: 66% equal tokens),
    # so compare per position under teacher forcing: eager's choice given compiled's prefix.
    teacher = logits(model, compiled[:, :-1])[:, 11:].argmax(-1)
    assert (teacher == compiled[:, 12:]).float().mean() >= 0.9


@pytest.mark.gpu
def test_gpu_device_map_auto(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    quantized = build("deepseek_v3")
    quantize_model_(quantized)
    save_pretrained(quantized, tmp_path)
    layers = {f"model.layers.{i}": i % 2 for i in range(3)}
    dmap = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1, **layers}
    model = from_pretrained(tmp_path, device_map=dmap)
    assert model.model.layers[1].mlp.experts.down_proj.device.index == 1
    prompt = ids(10, batch=1).cuda()
    ref = quantized.generate(prompt.cpu(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == ref.shape
    # The same values as on one GPU (layers on cuda:1 launch there while cuda:0 is current):
    # first calls, plans and planned calls.
    single = from_pretrained(tmp_path, device_map="cuda:0")
    for _ in range(3):
        with torch.no_grad():  # as generate runs: the norms' kernels, not autograd's ATen path
            a, b = logits(single, prompt), logits(model, prompt).to("cuda:0")
        assert torch.cuda.current_device() == 0
        assert (a - b).abs().max() <= 1e-2 * a.abs().max(), (a - b).abs().max()
    auto = from_pretrained(tmp_path, device_map="auto")
    assert auto.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0).shape == ref.shape


# ----------------------------------------------------------------------------- interop
def test_quantize_cli_output_loads(tmp_path):
    """A checkpoint written by fp8linear.quantize (per-expert BF16 on disk) loads to quantize_model_'s tensors."""
    quantize_checkpoint = pytest.importorskip("fp8linear.quantize").quantize_checkpoint
    src = build("deepseek_v3", moe_intermediate=128)
    src.save_pretrained(tmp_path / "bf16")  # transformers writes experts per expert
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", granularity="row", progress=False)
    model = from_pretrained(tmp_path / "fp8")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    quantize_model_(expected, granularity="row")
    assert_same_state(model, expected)


def test_fp8linear_config_refuses_prequantized(tmp_path):
    model = build("llama")
    quantize_model_(model)
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = Fp8LinearConfig().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="already quantized"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=Fp8LinearConfig())


@pytest.mark.gpu
def test_gpu_gptq_calibration():
    # The calibration passes run through Triton FP8 layers and GPTQ runs on the GPU; same bounds as on the CPU.
    bf16 = build("qwen2_moe").cuda()
    x = ids(64, 8, seed=1).cuda()
    held_out = _linear_inputs(bf16, x)
    rtn = build("qwen2_moe").cuda()
    quantize_model_(rtn)
    model = build("qwen2_moe").cuda()
    report = quantize_model_(model, calibration_data=[ids(64, 8, seed=s) for s in (11, 12, 13, 14)])
    assert report.gptq_layers == EXPECTED_COUNTS["qwen2_moe"][0] and _no_hooks_left(model)
    assert all(m.weight.is_cuda for m in model.modules() if isinstance(m, Fp8BlockLinear))
    _assert_gptq_beats_rtn(model, rtn, bf16, held_out)
    assert_close_logits(logits(model, x), logits(bf16, x))
