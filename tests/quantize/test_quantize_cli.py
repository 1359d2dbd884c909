"""Tests of the offline checkpoint tool: `fp8linear quantize / dequantize / inspect`.

Real checkpoints are written by transformers' `save_pretrained` from tiny configs (DeepSeek-V3
with MLA + MoE, per-expert and fused experts; Llama; Qwen2 with tied embeddings and biases),
sharded, with dims that are not multiples of 128. Every output byte is checked against
`fp8linear.quantize_weight`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _checkpoints import (
    MODEL_KINDS,
    file_digests,
    make_model,
    read_tensors,
    save_model,
    synthetic_checkpoint,
    tensor_shards,
    write_checkpoint,
)

from fp8linear import dequantize_weight, e4m3fn_to_e4m3fnuz, quantize_weight
from fp8linear.cli import main
from fp8linear.quantize import (
    CheckpointError,
    QuantizeOptions,
    default_should_quantize,
    dequantize_checkpoint,
    fp8_quantization_config,
    inspect_checkpoint,
    open_checkpoint,
    quantization_error,
    quantize_checkpoint,
)
from fp8linear.quantize.convert import STATE_FILE
from fp8linear.quantize.inspection import _measure

REPO = Path(__file__).resolve().parents[2]
GRANULARITIES = ("block", "row", "tensor")
FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
BLOCK_SIZE = {"block": [128, 128], "row": [1, 128], "tensor": None}


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread):
    """Every test here runs on one intra-op thread (conftest.single_thread)."""


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (model, source folder)."""
    out = {}
    root = tmp_path_factory.mktemp("src")
    for kind in MODEL_KINDS:
        base = "deepseek_v3" if kind.startswith("deepseek_v3") else kind
        model = out[base][0] if base in out else make_model(base)
        out[kind] = (model, save_model(model, root / kind, fused=kind.endswith("_fused")))
    return out


@pytest.fixture(scope="module")
def quantized(models, tmp_path_factory):
    """(kind, granularity, fp8 dtype) -> quantized folder (computed once)."""
    cache: dict[tuple[str, str, str], Path] = {}
    root = tmp_path_factory.mktemp("q")

    def get(kind: str, gran: str = "block", dtype: str = "e4m3fn") -> Path:
        key = (kind, gran, dtype)
        if key not in cache:
            dst = root / f"{kind}-{gran}-{dtype}"
            quantize_checkpoint(models[kind][1], dst, granularity=gran, fp8_dtype=dtype, progress=False)
            cache[key] = dst
        return cache[key]

    return get


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------------ format and bytes
@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_quantize_matches_reference(models, quantized, kind, gran):
    src = models[kind][1]
    dst = quantized(kind, gran)
    before, after = read_tensors(src), read_tensors(dst)
    expected_q = {n for n, t in before.items() if default_should_quantize(n, t)}
    assert set(after) == set(before) | {n + "_scale_inv" for n in expected_q}
    for name, t in before.items():
        if name in expected_q:
            q, s = quantize_weight(t, gran, torch.float8_e4m3fn)
            assert _same_bytes(after[name], q), name
            assert _same_bytes(after[name + "_scale_inv"], s), name
        else:
            assert _same_bytes(after[name], t), name
    # the index lists every tensor in the shard that holds it; scales sit next to their weight
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == tensor_shards(dst)
    for name in expected_q:
        assert index["weight_map"][name + "_scale_inv"] == index["weight_map"][name]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in after.values())
    # config: HF quant_method "fp8" keys, exact
    config = json.loads((dst / "config.json").read_text())
    original = json.loads((src / "config.json").read_text())
    qcfg = config.pop("quantization_config")
    assert config == original
    assert qcfg == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": BLOCK_SIZE[gran], "modules_to_not_convert": qcfg["modules_to_not_convert"]}  # fmt: skip
    # everything else is copied unchanged, nothing of ours is left behind
    src_files, dst_files = file_digests(src), file_digests(dst)
    for rel in ("tokenizer.json", "generation_config.json", "extras/notes.txt"):
        assert dst_files[rel] == src_files[rel]
    assert not [f for f in dst_files if f.startswith(".") or "fp8linear" in f]

    # family-specific naming rules (DeepSeek-V3 official FP8 layout)
    kept = set(qcfg["modules_to_not_convert"])
    if kind.startswith("deepseek_v3"):
        assert "model.layers.1.mlp.gate" in kept and "model.embed_tokens" in kept and "lm_head" in kept
        bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert bias_name not in after or _same_bytes(after[bias_name], before[bias_name])  # copied as it was
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert f"model.layers.0.self_attn.{proj}.weight" in expected_q
        assert "model.layers.1.mlp.shared_experts.down_proj.weight" in expected_q
        if kind.endswith("_fused"):
            w, s = after["model.layers.1.mlp.experts.gate_up_proj"], after["model.layers.1.mlp.experts.gate_up_proj_scale_inv"]
            assert w.shape == (4, 400, 320) and w.dtype == torch.float8_e4m3fn
            assert s.shape == {"block": (4, 4, 3), "row": (4, 400, 3), "tensor": (4,)}[gran]
        else:
            assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in after
        if gran == "block":
            assert after["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (3, 2)  # (320, 200)
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in before and "model.layers.0.self_attn.q_proj.bias" not in expected_q
        assert "lm_head.weight" not in after  # tied
    if gran == "tensor":
        assert after["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == ()


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_round_trip_and_forward(models, quantized, tmp_path, kind):
    """quantize -> dequantize -> load with transformers: same logits as the model with dequantized weights."""
    from transformers import AutoModelForCausalLM

    model, src = models[kind]
    deq = tmp_path / "deq"
    summary = dequantize_checkpoint(quantized(kind, "block"), deq, progress=False)
    assert summary.tensors_dequantized > 0
    config = json.loads((deq / "config.json").read_text())
    assert "quantization_config" not in config
    before, after = read_tensors(src), read_tensors(deq)
    assert set(after) == set(before)
    reference = {}
    for name, t in before.items():
        if default_should_quantize(name, t):
            reference[name] = dequantize_weight(*quantize_weight(t, "block"), torch.bfloat16)
            assert _same_bytes(after[name], reference[name]), name
        else:
            assert _same_bytes(after[name], t), name

    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    expected = make_model(kind.removesuffix("_fused"))  # same seed -> same weights as `model`
    expected.load_state_dict(_fake_quantized_state(model, "block", per_expert=not kind.endswith("_fused")))
    with torch.no_grad():
        original_logits = model(ids).logits.float()
        loaded = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.bfloat16).eval()
        loaded_logits = loaded(ids).logits.float()
        expected_logits = expected(ids).logits.float()
    torch.testing.assert_close(loaded_logits, expected_logits, rtol=0, atol=0)
    rel = (loaded_logits - original_logits).norm() / original_logits.norm()
    assert rel < 0.08, f"FP8 round trip moved the logits by {rel:.3f}"


def _fake_quantized_state(model: torch.nn.Module, gran: str, per_expert: bool) -> dict[str, torch.Tensor]:
    """The model's state with every quantized weight replaced by dequant(quant(w)), computed here.

    In memory transformers fuses experts ([E, 2I, H] = gate ; up); a per-expert checkpoint
    quantizes each expert's gate/up/down matrix separately, so the reference does the same.
    """

    def fake(w: torch.Tensor) -> torch.Tensor:
        return dequantize_weight(*quantize_weight(w, gran), torch.bfloat16)

    state = {}
    for name, t in model.state_dict().items():
        if not default_should_quantize(name, t):
            state[name] = t
        elif t.dim() == 3 and per_expert:
            if name.endswith("gate_up_proj"):
                half = t.shape[1] // 2
                state[name] = torch.stack([torch.cat([fake(e[:half]), fake(e[half:])]) for e in t])
            else:
                state[name] = torch.stack([fake(e) for e in t])
        else:
            state[name] = fake(t)
    return state


def test_dequantized_state_dict_matches_reference(models, quantized, tmp_path):
    """The loaded dequantized model's parameters are exactly dequant(quant(w)) (fused experts included)."""
    from transformers import AutoModelForCausalLM

    model, _ = models["deepseek_v3_fused"]
    deq = tmp_path / "deq"
    dequantize_checkpoint(quantized("deepseek_v3_fused", "row"), deq, progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.bfloat16)
    state, expected = loaded.state_dict(), _fake_quantized_state(model, "row", per_expert=False)
    assert set(state) == set(expected)
    for name, t in model.state_dict().items():
        if default_should_quantize(name, t):
            assert _same_bytes(state[name], expected[name]), name
        else:  # transformers may load buffers such as e_score_correction_bias in fp32
            assert torch.equal(state[name].to(t.dtype), t), name


def test_fnuz_direct_and_converted(models, quantized, tmp_path):
    src = models["deepseek_v3_fused"][1]
    before = read_tensors(src)
    fn, fnuz = read_tensors(quantized("deepseek_v3_fused", "block")), read_tensors(quantized("deepseek_v3_fused", "block", "e4m3fnuz"))
    qcfg = json.loads((quantized("deepseek_v3_fused", "block", "e4m3fnuz") / "config.json").read_text())["quantization_config"]
    assert qcfg["fp8_dtype"] == "e4m3fnuz" and qcfg["fmt"] == "e4m3"
    for name, t in before.items():
        if default_should_quantize(name, t):
            q, s = quantize_weight(t, "block", torch.float8_e4m3fnuz)
            assert _same_bytes(fnuz[name], q) and _same_bytes(fnuz[name + "_scale_inv"], s), name
    # e4m3fn FP8 checkpoint -> fnuz without BF16: `quantize --fp8-dtype e4m3fnuz` on the FP8 folder
    conv = tmp_path / "conv"
    summary = quantize_checkpoint(quantized("deepseek_v3_fused", "block"), conv, fp8_dtype="e4m3fnuz", progress=False)
    assert summary.tensors_converted > 0 and summary.tensors_quantized == 0
    converted = read_tensors(conv)
    assert set(converted) == set(fn)
    for name, t in fn.items():
        if t.dtype == torch.float8_e4m3fn:
            w, s = e4m3fn_to_e4m3fnuz(t, fn[name + "_scale_inv"])
            assert _same_bytes(converted[name], w) and _same_bytes(converted[name + "_scale_inv"], s), name
            assert torch.equal(dequantize_weight(w, s), dequantize_weight(t, fn[name + "_scale_inv"]))
        elif not name.endswith("_scale_inv"):
            assert _same_bytes(converted[name], t)
    qcfg = json.loads((conv / "config.json").read_text())["quantization_config"]
    assert qcfg["fp8_dtype"] == "e4m3fnuz" and qcfg["weight_block_size"] == [128, 128]
    # and back: dequantizing the fnuz checkpoint gives the same BF16 as dequantizing the fn one
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    dequantize_checkpoint(conv, d1, progress=False)
    dequantize_checkpoint(quantized("deepseek_v3_fused", "block"), d2, progress=False)
    a, b = read_tensors(d1), read_tensors(d2)
    assert all(_same_bytes(a[n], b[n]) for n in a)


def test_dequantize_official_layout_scales_in_other_shard(quantized, tmp_path):
    """DeepSeek-V3's official checkpoints may store a weight's scale in a different shard."""
    q = quantized("deepseek_v3", "block")
    tensors, shards = read_tensors(q), tensor_shards(q)
    layout: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        shard = "model-scales.safetensors" if name.endswith("_scale_inv") else shards[name]
        layout.setdefault(shard, {})[name] = t
    official = write_checkpoint(tmp_path / "official", layout, json.loads((q / "config.json").read_text()))
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    dequantize_checkpoint(official, d1, progress=False)
    dequantize_checkpoint(q, d2, progress=False)
    a, b = read_tensors(d1), read_tensors(d2)
    assert set(a) == set(b) and all(_same_bytes(a[n], b[n]) for n in a)


def test_deterministic_across_runs_and_workers(models, quantized, tmp_path):
    ref = file_digests(quantized("llama", "block"))
    for workers in (1, 3):
        dst = tmp_path / f"w{workers}"
        quantize_checkpoint(models["llama"][1], dst, workers=workers, progress=False)
        assert file_digests(dst) == ref


def test_single_file_checkpoint(models, tmp_path):
    model = models["qwen2"][0]
    src = tmp_path / "single"
    model.save_pretrained(src)  # one model.safetensors, no index
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, progress=False)
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model.safetensors"]
    assert not (dst / "model.safetensors.index.json").exists()
    out = read_tensors(dst)
    assert out["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn


def test_ignore_and_only(models, tmp_path):
    src = models["llama"][1]
    dst = tmp_path / "ign"
    rc = main(["quantize", str(src), str(dst), "-q", "--ignore", r"layers\.0\.", "--ignore", "o_proj"])
    assert rc == 0
    out = read_tensors(dst)
    assert out["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    kept = json.loads((dst / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.up_proj" in kept and "model.layers.1.self_attn.o_proj" in kept and "lm_head" in kept
    dst2 = tmp_path / "only"
    quantize_checkpoint(src, dst2, only=("mlp",), progress=False)
    out = read_tensors(dst2)
    assert out["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "name,shape,dtype,expected",
    [
        ("model.layers.0.self_attn.q_proj.weight", (320, 320), torch.bfloat16, True),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (128, 320), torch.float16, True),
        ("model.layers.3.mlp.experts.7.gate_proj.weight", (200, 320), torch.bfloat16, True),
        ("model.layers.3.mlp.experts.gate_up_proj", (8, 400, 320), torch.bfloat16, True),
        ("model.layers.3.mlp.experts.down_proj", (8, 320, 200), torch.float32, True),
        ("model.layers.3.mlp.experts.gate_up_proj_bias", (8, 400), torch.bfloat16, False),
        ("model.layers.3.mlp.gate.weight", (8, 320), torch.bfloat16, False),
        ("model.layers.3.mlp.gate.e_score_correction_bias", (8,), torch.float32, False),
        ("model.layers.3.mlp.router.weight", (8, 320), torch.bfloat16, False),
        ("model.layers.3.mlp.shared_expert_gate.weight", (1, 320), torch.bfloat16, False),
        ("model.layers.3.mlp.gate_proj.weight", (200, 320), torch.bfloat16, True),
        ("model.embed_tokens.weight", (384, 320), torch.bfloat16, False),
        ("lm_head.weight", (384, 320), torch.bfloat16, False),
        ("model.norm.weight", (320,), torch.bfloat16, False),
        ("model.layers.0.self_attn.q_proj.bias", (320,), torch.bfloat16, False),
        ("model.layers.0.self_attn.q_proj.weight", (320, 320), torch.float8_e4m3fn, False),
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", (3, 3), torch.float32, False),
        ("model.layers.0.conv1d.weight", (320, 1, 4), torch.bfloat16, False),
    ],
)
def test_default_should_quantize(name, shape, dtype, expected):
    assert default_should_quantize(name, shape, dtype) is expected
    assert default_should_quantize(name, torch.empty(shape, dtype=dtype)) is expected


def test_quantization_config_helper():
    assert fp8_quantization_config("row", "e4m3fnuz", ["lm_head"]) == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [1, 128],
        "modules_to_not_convert": ["lm_head"], "fp8_dtype": "e4m3fnuz",
    }  # fmt: skip
    assert fp8_quantization_config("tensor")["weight_block_size"] is None
    with pytest.raises(ValueError, match="granularity"):
        fp8_quantization_config("blocks")


# ------------------------------------------------------------------------ safety on disk
def test_nonempty_dst_overwrite_and_resume_mismatch(models, quantized, tmp_path, capsys):
    src = models["llama"][1]
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "unrelated.txt").write_text("keep me")
    assert main(["quantize", str(src), str(dst), "-q"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert main(["quantize", str(src), str(dst), "-q", "--overwrite"]) == 0
    digests = file_digests(dst)
    assert digests.pop("unrelated.txt") and digests == file_digests(quantized("llama", "block"))
    # an unfinished run with other options is not silently mixed with a new one
    (dst / "config.json").unlink()
    (dst / STATE_FILE).write_text(json.dumps({"command": "quantize", "granularity": "row"}))
    assert main(["quantize", str(src), str(dst), "-q"]) == 1
    assert "unfinished conversion with other options" in capsys.readouterr().err


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import fp8linear.quantize.checkpoint as ck
    from fp8linear.quantize import quantize_checkpoint
    mode, src, dst = sys.argv[1:4]
    commit, write = ck.ShardWriter.commit, ck.ShardWriter.write
    seen = {"commits": 0, "writes": 0}

    def killing_commit(self):
        commit(self)
        seen["commits"] += 1
        if mode == "after-shard" and seen["commits"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    def killing_write(self, *args):
        write(self, *args)
        if mode == "mid-shard" and seen["commits"] == 1:
            seen["writes"] += 1
            if seen["writes"] == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    ck.ShardWriter.commit, ck.ShardWriter.write = killing_commit, killing_write
    quantize_checkpoint(src, dst, granularity="row", progress=False)
    """
)


@pytest.mark.parametrize("mode", ["after-shard", "mid-shard"])
def test_resume_after_kill(models, tmp_path, mode):
    src = models["deepseek_v3"][1]
    ref, dst = tmp_path / "ref", tmp_path / "dst"
    quantize_checkpoint(src, ref, granularity="row", progress=False)
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, mode, str(src), str(dst)], env=_env(), capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    left = {p.name for p in dst.iterdir()}
    assert "config.json" not in left and STATE_FILE in left  # does not look complete
    assert any(n.endswith(".fp8linear-tmp") for n in left) == (mode == "mid-shard")
    summary = quantize_checkpoint(src, dst, granularity="row", progress=False)
    assert summary.shards_resumed == (2 if mode == "after-shard" else 1)
    assert file_digests(dst) == file_digests(ref)


def test_memory_stays_bounded(tmp_path):
    """Peak RSS grows by far less than the largest tensor, let alone the checkpoint (512 MiB)."""
    # 256 MiB tensor in shard 1, 4 x 64 MiB in shard 2; K = 2048 so a chunk is whole 128-row blocks.
    src = synthetic_checkpoint(tmp_path / "big", [[65536], [16384] * 4], cols=2048)
    bound_mib = 128  # peak RSS growth allowed over the warmed-up process (observed: ~80 MiB)
    script = textwrap.dedent(
        """
        import resource, sys, torch
        from fp8linear import quantize_weight
        from fp8linear.quantize import quantize_checkpoint
        quantize_weight(torch.randn(256, 256), "block")  # load everything before the baseline
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        s = quantize_checkpoint(sys.argv[1], sys.argv[2], progress=False, chunk_elements=2**19)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((peak - base) // 1024, s.bytes_in // 2**20)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(src), str(tmp_path / "out")], env=_env(),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth, size = map(int, proc.stdout.split())
    assert size >= 4 * bound_mib
    assert growth < bound_mib, f"peak RSS grew by {growth} MiB quantizing a {size} MiB checkpoint"


# ------------------------------------------------------------------------ bad input
def _small_source(root: Path, **overrides: torch.Tensor) -> Path:
    g = torch.Generator().manual_seed(0)
    a = {"model.layers.0.mlp.up_proj.weight": torch.randn(200, 320, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(320, dtype=torch.bfloat16)}  # fmt: skip
    b = {"model.layers.1.mlp.up_proj.weight": torch.randn(200, 320, generator=g).bfloat16()}
    for k, v in overrides.items():
        (a if k in a else b)[k] = v
    return write_checkpoint(root, {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b})


def _edit_index(src: Path, tensor: str, shard: str) -> None:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][tensor] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _bad_missing_shard(src: Path) -> None:
    (src / "model-00002-of-00002.safetensors").unlink()


def _bad_truncated_shard(src: Path) -> None:
    p = src / "model-00002-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])


def _bad_garbage_shard(src: Path) -> None:
    (src / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)


def _bad_parent_path(src: Path) -> None:
    _edit_index(src, "model.layers.1.mlp.up_proj.weight", "../model-00002-of-00002.safetensors")


def _bad_absolute_path(src: Path) -> None:
    _edit_index(src, "model.layers.1.mlp.up_proj.weight", str(src / "model-00002-of-00002.safetensors"))


def _bad_wrong_shard(src: Path) -> None:
    _edit_index(src, "model.layers.1.mlp.up_proj.weight", "model-00001-of-00002.safetensors")


def _bad_pickle(src: Path) -> None:
    for p in src.glob("*.safetensors*"):
        p.unlink()
    torch.save({"w": torch.zeros(2)}, src / "pytorch_model.bin")


BAD_INPUTS = {
    # case: (how to break the source, extra CLI args, text the one-line error must contain)
    "missing-shard": (_bad_missing_shard, [], "lists missing shard 'model-00002-of-00002.safetensors'"),
    "truncated-shard": (_bad_truncated_shard, [], "model-00002-of-00002.safetensors: not a valid safetensors file"),
    "garbage-shard": (_bad_garbage_shard, [], "model-00002-of-00002.safetensors: not a valid safetensors file"),
    "index-parent-path": (_bad_parent_path, [], "points outside the checkpoint folder"),
    "index-absolute-path": (_bad_absolute_path, [], "points outside the checkpoint folder"),
    "index-wrong-shard": (_bad_wrong_shard, [], "'model.layers.1.mlp.up_proj.weight' is listed in"),
    "pickle-checkpoint": (_bad_pickle, [], "pytorch_model.bin: pickle checkpoints"),
    "bad-regex": (lambda src: None, ["--ignore", "(unclosed"], "invalid --ignore regex"),
    "nothing-to-quantize": (lambda src: None, ["--only", "no_such_tensor"], "no tensor to quantize"),
    "workers-zero": (lambda src: None, ["--workers", "0"], "workers must be an integer >= 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_line_error(tmp_path, capsys, case):
    breaker, extra, message = BAD_INPUTS[case]
    src = _small_source(tmp_path / "src")
    breaker(src)
    dst = tmp_path / "dst"
    rc = main(["quantize", str(src), str(dst), "-q", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert len(err) == 1 and err[0].startswith("fp8linear: error: "), err
    assert message in err[0]
    assert not (dst / "config.json").exists() and not list(dst.glob("*.safetensors")) if dst.exists() else True


@pytest.mark.parametrize("gran", ["block", "tensor"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weight_refused_unless_allowed(tmp_path, capsys, value, gran):
    w = torch.randn(200, 320).bfloat16()
    w[150, 7] = value
    src = _small_source(tmp_path / "src", **{"model.layers.1.mlp.up_proj.weight": w})
    dst = tmp_path / "dst"
    assert main(["quantize", str(src), str(dst), "-q", "--granularity", gran]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'model.layers.1.mlp.up_proj.weight' contains" in err[0] and "[150, 7]" in err[0]
    assert "--allow-nonfinite" in err[0]
    assert not (dst / "config.json").exists() and not list(dst.glob(".*tmp"))
    assert main(["quantize", str(src), str(tmp_path / "ok"), "-q", "--allow-nonfinite"]) == 0


def test_already_quantized_and_other_refusals(models, quantized, tmp_path, capsys):
    q = quantized("llama", "block")
    cases = [
        (["quantize", str(q), str(tmp_path / "a")], "already quantized"),
        (["quantize", str(q), str(tmp_path / "b"), "--fp8-dtype", "e4m3fnuz", "--granularity", "row"], "--granularity cannot change"),
        (["quantize", str(quantized("llama", "block", "e4m3fnuz")), str(tmp_path / "c"), "--fp8-dtype", "e4m3fnuz"], "only e4m3fn FP8 checkpoints"),
        (["dequantize", str(models["llama"][1]), str(tmp_path / "d")], "not an FP8 checkpoint"),
        (["quantize", str(models["llama"][1]), str(models["llama"][1] / "out")], "must not be the input folder"),
        (["quantize", str(tmp_path / "nope"), str(tmp_path / "e")], "no such checkpoint folder"),
        (["inspect", str(q), "--error"], "already FP8"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main([*argv, "-q"]) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fp8linear: error: ") and message in err[0], (argv, err)
    # an FP8 weight without its scale
    tensors = read_tensors(q)
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    broken = write_checkpoint(tmp_path / "noscale", {"model.safetensors": tensors}, index=False)
    assert main(["dequantize", str(broken), str(tmp_path / "f"), "-q"]) == 1
    assert "has no scale 'model.layers.0.mlp.up_proj.weight_scale_inv'" in capsys.readouterr().err


def test_unknown_granularity(models, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(models["llama"][1]), str(tmp_path / "x"), "--granularity", "blocks"])
    assert exc.value.code == 2 and "invalid choice: 'blocks'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown granularity 'blocks'"):
        QuantizeOptions(granularity="blocks")
    with pytest.raises(CheckpointError):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "y")


# ------------------------------------------------------------------------ inspect, entry points
def test_inspect(models, quantized, capsys):
    src = models["deepseek_v3_fused"][1]
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "quantized: none" in out and "after quantize: block" in out and "quantization_config: none" in out
    report = inspect_checkpoint(src, error=True)
    names = [e.name for e in report.errors]
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.gate.weight" not in names
    for e in report.errors:
        assert set(e.rel_error) == set(GRANULARITIES)
        assert 0 < e.rel_error["row"] <= e.rel_error["tensor"] * 1.05 and 20 < e.sqnr_db["block"] < 40
    assert report.total_error["row"]["sqnr_db"] >= report.total_error["tensor"]["sqnr_db"]
    assert main(["inspect", str(src), "--error", "--limit", "3", "-q"]) == 0
    out = capsys.readouterr().out
    assert "block rel err / SQNR" in out and "row rel err / SQNR" in out and "tensor rel err / SQNR" in out
    assert "all (energy-weighted)" in out and " dB" in out
    assert main(["inspect", str(quantized("deepseek_v3_fused", "block")), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["quantized_weights"] == data["scale_tensors"] > 0
    assert data["granularity"] == "block" and data["fp8_dtype"] == "e4m3fn"
    assert data["quantization_config"]["quant_method"] == "fp8"
    assert main(["inspect", str(quantized("llama", "row")), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "F8_E4M3" in out and "model.layers.0.mlp.up_proj.weight_scale_inv" in out


def test_entry_points_without_transformers(models, quantized, tmp_path):
    """`python -m fp8linear.quantize` works and the tool never imports transformers."""
    dst = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "fp8linear.quantize", str(models["qwen2"][1]), str(dst), "-q"],
                          env=_env(), capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "quantize: quantized" in proc.stdout and "MiB/s" in proc.stdout
    assert file_digests(dst) == file_digests(quantized("qwen2", "block"))
    script = textwrap.dedent(
        """
        import sys
        from fp8linear.cli import main
        d = sys.argv[2]
        for argv in (["dequantize", sys.argv[1], d, "-q"], ["inspect", d, "--error", "-q"], ["inspect", sys.argv[1]]):
            assert main(argv) == 0, argv
        assert "transformers" not in sys.modules, "the checkpoint tool imported transformers"
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(dst), str(tmp_path / "d")], env=_env(),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_inspect_chunked_error_equals_whole_matrix(tmp_path):
    """--error reads row chunks; the numbers equal quantizing each whole matrix (incl. per-tensor scale)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(700, 300, generator=g) * torch.linspace(0.1, 3, 700)[:, None]).bfloat16()
    src = write_checkpoint(tmp_path / "src", {"model.safetensors": {"a.weight": w}}, index=False)
    report = inspect_checkpoint(src)
    _measure(open_checkpoint(src), report, ["a.weight"], torch.float8_e4m3fn, "cpu", False, chunk_elements=128 * 300)
    whole = quantization_error(w)
    for gran in GRANULARITIES:
        assert report.errors[0].rel_error[gran] == pytest.approx(whole[gran][0], rel=1e-9)
        assert report.errors[0].sqnr_db[gran] == pytest.approx(whole[gran][1], rel=1e-9)


def test_in_out_fused_experts_are_kept(tmp_path, capsys):
    """gpt-oss / Llama-4 store fused experts as [E, in, out]: not the format's [E, out, in], so kept."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 320, 400, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(320, 320, generator=g).bfloat16(),
    }
    src = write_checkpoint(tmp_path / "src", {"model.safetensors": tensors}, {"model_type": "gpt_oss"}, index=False)
    assert main(["quantize", str(src), str(tmp_path / "dst"), "-q"]) == 0
    out = read_tensors(tmp_path / "dst")
    assert out["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "kept 1 fused [E, in, out] expert tensors" in capsys.readouterr().err
    kept = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in kept


@pytest.mark.parametrize("gran", GRANULARITIES)
def test_small_chunks_give_identical_bytes(models, quantized, tmp_path, gran):
    """Quantizing in 128-row chunks (per-tensor scales included) equals quantizing whole matrices."""
    dst = tmp_path / "chunked"
    quantize_checkpoint(models["deepseek_v3_fused"][1], dst, granularity=gran, chunk_elements=128 * 128, progress=False)
    assert file_digests(dst) == file_digests(quantized("deepseek_v3_fused", gran))


def test_never_writes_through_symlinks(models, tmp_path, capsys):
    """A symlinked folder inside DST (with --overwrite) is refused instead of written through."""
    src = tmp_path / "src"
    tensors = {"a.weight": torch.randn(200, 320).bfloat16()}
    write_checkpoint(src, {"model.safetensors": tensors}, index=False)
    (src / "sub").mkdir()
    (src / "sub" / "vocab.txt").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "sub").symlink_to(outside, target_is_directory=True)
    assert main(["quantize", str(src), str(dst), "-q", "--overwrite"]) == 1
    assert "is a symlink; refusing to write 'sub/vocab.txt'" in capsys.readouterr().err
    assert list(outside.iterdir()) == []


def test_disk_full_then_resume(models, quantized, tmp_path, capsys, monkeypatch):
    import errno

    import fp8linear.quantize.checkpoint as ck

    src, dst = models["llama"][1], tmp_path / "dst"
    real_pwrite, calls = ck.os.pwrite, {"n": 0}

    def full_disk(fd, data, pos):
        calls["n"] += 1
        if calls["n"] == 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(ck.os, "pwrite", full_disk)
    assert main(["quantize", str(src), str(dst), "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ".safetensors: write failed (No space left on device)" in err[0]
    assert not list(dst.glob(".*fp8linear-tmp")) and not (dst / "config.json").exists()
    monkeypatch.setattr(ck.os, "pwrite", real_pwrite)
    assert main(["quantize", str(src), str(dst), "-q"]) == 0
    assert file_digests(dst) == file_digests(quantized("llama", "block"))


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["block", "row", "tensor"])
def test_device_cuda_gives_the_same_bytes(tmp_path, gran):
    """--device cuda quantizes on the GPU; the files are byte-identical to a CPU run."""
    src = synthetic_checkpoint(tmp_path / "src", [[300, 1000], [576]], cols=2112)
    outs = {}
    for device in ("cpu", "cuda"):
        outs[device] = tmp_path / device
        quantize_checkpoint(src, outs[device], granularity=gran, device=device, progress=False)
    assert file_digests(outs["cpu"]) == file_digests(outs["cuda"])
