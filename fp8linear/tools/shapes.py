"""Weight-shape lists of the benchmark, the tuner and amd-check: DeepSeek-V3's linear layers and others,
a quick subset, and the shapes of any Hugging Face model config."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Shape", "DSV3_SHAPES", "EXTRA_SHAPES", "QUICK_SHAPES", "QUICK_MS", "default_shapes", "quick_shapes", "parse_shape", "shapes_from_hf_config"]


@dataclass(frozen=True)
class Shape:
    """A linear layer's weight shape: N = out_features, K = in_features."""

    n: int
    k: int
    name: str = ""

    def __post_init__(self) -> None:
        for attr in ("n", "k"):
            v = getattr(self, attr)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Shape.{attr} must be a positive int, got {v!r}")

    @property
    def label(self) -> str:
        return f"{self.n}x{self.k}" + (f" {self.name}" if self.name else "")


# DeepSeek-V3 (671B) linear shapes.
DSV3_SHAPES = (
    (1536, 7168, "dsv3 q_a_proj"),
    (576, 7168, "dsv3 kv_a_proj_with_mqa"),
    (24576, 1536, "dsv3 q_b_proj"),
    (32768, 512, "dsv3 kv_b_proj"),
    (7168, 16384, "dsv3 o_proj"),
    (18432, 7168, "dsv3 mlp gate/up"),
    (7168, 18432, "dsv3 mlp down"),
    (2048, 7168, "dsv3 expert gate/up"),
    (7168, 2048, "dsv3 expert down"),
)
# Other shapes: odd K (256, 2304: cuBLAS blockwise refuses), small N, other models.
EXTRA_SHAPES = (
    (3072, 1536, "extra"),
    (7168, 256, "extra K=256"),
    (4608, 7168, "extra"),
    (7168, 2304, "extra K=2304"),
    (512, 7168, "extra"),
    (4096, 512, "extra"),
)
# `--quick`: one shape per regime (tall-K, tiny-N, small-K, big-N, cuBLAS-refused K) x 5 Ms.
QUICK_SHAPES = ((576, 7168), (24576, 1536), (32768, 512), (18432, 7168), (7168, 2304))
QUICK_MS: tuple[int, ...] = (1, 16, 64, 1024, 4096)


def default_shapes() -> list[Shape]:
    """The default shape list: the 9 DeepSeek-V3 linear shapes and 6 others."""
    return [Shape(n, k, name) for n, k, name in DSV3_SHAPES + EXTRA_SHAPES]


def quick_shapes() -> list[Shape]:
    by_nk = {(s.n, s.k): s for s in default_shapes()}
    return [by_nk[nk] for nk in QUICK_SHAPES]


def parse_shape(text: str) -> Shape:
    """'N,K' or 'NxK' -> Shape(N, K)."""
    parts = text.replace("x", ",").replace("X", ",").split(",")
    if len(parts) != 2:
        raise ValueError(f"a shape is 'N,K' (out_features,in_features), got {text!r}")
    try:
        n, k = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"a shape is 'N,K' with integer N and K, got {text!r}") from None
    if n < 1 or k < 1:
        raise ValueError(f"N and K must be positive, got {text!r}")
    return Shape(n, k, "user")


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        v = cfg.get(name)
        if v is not None:
            return v
    return default


def shapes_from_hf_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> list[Shape]:
    """The distinct linear-layer weight shapes (N, K) of a Hugging Face decoder config.

    Covers attention (q/k/v/o, or MLA's q_a/q_b/kv_a/kv_b/o with or without q_lora_rank),
    the dense MLP (gate/up/down), routed experts (moe_intermediate_size, or
    intermediate_size for Mixtral-style configs) and shared experts. Embeddings and lm_head
    are left out (not FP8 in DeepSeek-V3-style checkpoints). Accepts a dict, a config.json
    path or a model folder; a multimodal config's "text_config" is used when present.
    """
    if not isinstance(config, Mapping):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    cfg: Mapping[str, Any] = config
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    h = _get(cfg, "hidden_size", "d_model", "n_embd")
    if not h:
        raise ValueError("config has no hidden_size: is it a decoder LLM's config.json?")
    nh = _get(cfg, "num_attention_heads", "n_head")
    if not nh:
        raise ValueError("config has no num_attention_heads")
    out: dict[tuple[int, int], list[str]] = {}

    def add(n: int | None, k: int | None, name: str) -> None:
        if n and k:
            names = out.setdefault((int(n), int(k)), [])
            if name not in names:
                names.append(name)

    kv_lora = cfg.get("kv_lora_rank")
    if kv_lora:  # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, ...)
        nope = _get(cfg, "qk_nope_head_dim", default=128)
        rope = _get(cfg, "qk_rope_head_dim", default=64)
        v_hd = _get(cfg, "v_head_dim", default=nope)
        q_lora = cfg.get("q_lora_rank")
        if q_lora:
            add(q_lora, h, "q_a_proj")
            add(nh * (nope + rope), q_lora, "q_b_proj")
        else:
            add(nh * (nope + rope), h, "q_proj")
        add(kv_lora + rope, h, "kv_a_proj_with_mqa")
        add(nh * (nope + v_hd), kv_lora, "kv_b_proj")
        add(h, nh * v_hd, "o_proj")
    else:
        nkv = _get(cfg, "num_key_value_heads", default=nh)
        hd = _get(cfg, "head_dim", default=h // nh)
        add(nh * hd, h, "q_proj")
        add(nkv * hd, h, "k_proj/v_proj")
        add(h, nh * hd, "o_proj")

    inter = _get(cfg, "intermediate_size", "ffn_dim", "n_inner")
    n_experts = _get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    moe_inter = cfg.get("moe_intermediate_size")
    if n_experts:
        e_inter = moe_inter or inter
        add(e_inter, h, "expert gate/up")
        add(h, e_inter, "expert down")
        shared = _get(cfg, "shared_expert_intermediate_size")
        if not shared and cfg.get("n_shared_experts") and e_inter:
            shared = cfg["n_shared_experts"] * e_inter
        if shared:
            add(shared, h, "shared expert gate/up")
            add(h, shared, "shared expert down")
        has_dense = bool(
            moe_inter
            and (
                (cfg.get("first_k_dense_replace") or 0) > 0
                or cfg.get("mlp_only_layers")
                or (cfg.get("decoder_sparse_step") or 1) > 1
                or (cfg.get("moe_layer_freq") or 1) > 1
            )
        )
    else:
        has_dense = True
    if has_dense and inter:
        add(inter, h, "mlp gate/up")
        add(h, inter, "mlp down")
    return [Shape(n, k, ", ".join(names)) for (n, k), names in out.items()]


