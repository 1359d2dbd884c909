"""Helpers for the checkpoint-tool tests: small real models saved by transformers, file comparisons."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "MODEL_KINDS",
    "make_model",
    "save_model",
    "read_tensors",
    "tensor_shards",
    "file_digests",
    "write_checkpoint",
    "synthetic_checkpoint",
]

# Small models with dims that are not multiples of 128 (hidden 320, intermediate 200).
MODEL_KINDS = ("deepseek_v3", "deepseek_v3_fused", "llama", "qwen2")
# Shard size limit for save_pretrained: small, so every model spans several shards.
MAX_SHARD_SIZE = "400KB"


def make_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny randomly initialised causal LM (bf16) of the given family."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=384, hidden_size=320, intermediate_size=200, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    if kind.startswith("deepseek_v3"):
        cfg = DeepseekV3Config(
            **common, moe_intermediate_size=200, first_k_dense_replace=1, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, num_key_value_heads=4,
            q_lora_rank=160, kv_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=48,
        )  # fmt: skip
    elif kind == "llama":
        cfg = LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # non-trivial norms and router biases, so "kept" tensors are not all ones
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.05)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.add_(torch.randn_like(b) * 0.05)
    return model.eval()


def save_model(model: torch.nn.Module, path: Path, fused: bool = False) -> Path:
    """save_pretrained with small shards; `fused` keeps transformers' fused 3-D expert tensors."""
    model.save_pretrained(path, max_shard_size=MAX_SHARD_SIZE, save_original_format=not fused)
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (path / "extras").mkdir()
    (path / "extras" / "notes.txt").write_text("copied unchanged\n")
    return path


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def tensor_shards(path: Path) -> dict[str, str]:
    out = {}
    for f in sorted(path.rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = f.relative_to(path).as_posix()
    return out


def file_digests(path: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `path` (hidden files included)."""
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def write_checkpoint(path: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict | None = None,
                     index: bool = True) -> Path:  # fmt: skip
    """Write {shard file: {name: tensor}} as a checkpoint folder (with index and config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
    if index:
        index_data = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index_data))
    (path / "config.json").write_text(json.dumps(config if config is not None else {"model_type": "llama"}))
    return path


def synthetic_checkpoint(path: Path, shard_rows: list[list[int]], cols: int, seed: int = 0) -> Path:
    """Linear weights (rows_i, cols) BF16, shard by shard, without holding more than one shard."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    layer = 0
    for i, rows_list in enumerate(shard_rows):
        shard = f"model-{i + 1:05d}-of-{len(shard_rows):05d}.safetensors"
        tensors = {}
        for rows in rows_list:
            tensors[f"model.layers.{layer}.mlp.up_proj.weight"] = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
            layer += 1
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(cols, dtype=torch.bfloat16)
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path
