"""`fp8linear plan-memory CONFIG.json --tp N`: per-GPU memory of an FP8 model under tensor parallelism.

From the model's config alone: the model is built on the meta device, its linear layers and
fused experts are replaced by FP8 modules as :func:`quantize_model_` does, and the sharding
that :func:`fp8linear.integrations.transformers.from_pretrained` (``tp_plan="auto"``) would
apply is applied to the shapes (no memory is allocated, nothing is read). Prints, per GPU: FP8
weights (sharded and replicated), their scales, the high-precision parts (embeddings, norms,
head, routers) and a KV-cache budget for a given context. Not imported by the forward path.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryPlan", "plan_memory", "load_config", "add_arguments", "run"]

GiB = 1024**3


@dataclass
class MemoryPlan:
    """Bytes per GPU (rank 0; ranks differ only where a dimension does not split evenly, which is refused)."""

    model_type: str
    tp: int
    granularity: str
    param_count: int  # parameters of the model as built (one per weight element, FP8 or not; scales excluded)
    fp8_sharded: int = 0  # FP8 weight bytes of sharded layers, this rank's slices
    fp8_replicated: int = 0  # FP8 weight bytes of layers the plan leaves whole (e.g. MLA attention)
    scales: int = 0  # fp32 weight_scale_inv bytes held by this rank
    high_precision: int = 0  # everything else this rank holds (embeddings, norms, head, routers, biases)
    kv_bytes_per_token: int = 0  # KV cache per token on this rank (all layers), transformers' cache layout
    kv_latent_bytes_per_token: int | None = None  # MLA latent cache per token (kv_lora_rank + rope), if MLA
    sharded_layers: dict[str, int] = field(default_factory=dict)  # kind -> number of modules

    @property
    def weights(self) -> int:
        return self.fp8_sharded + self.fp8_replicated + self.scales + self.high_precision

    def kv_cache(self, context: int, batch: int = 1) -> int:
        return self.kv_bytes_per_token * context * batch


def load_config(path: str | Path) -> Any:
    """A transformers config from a config.json file or a folder holding one (quantization_config dropped)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"expected a config.json file or a folder with one, got {str(path)!r}")
    with open(p, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{p}: expected a JSON object with a 'model_type' (a transformers config.json)")
    data.pop("quantization_config", None)
    data.pop("auto_map", None)
    model_type = data.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{p}: model_type {model_type!r} is not known to the installed transformers")
    return CONFIG_MAPPING[model_type].from_dict(data)


def _granularity_from_config(path: str | Path) -> str | None:
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    q = json.loads(p.read_text(encoding="utf-8")).get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    return {None: "tensor", (128, 128): "block", (1, 128): "row"}.get(tuple(block) if block else None)


def _meta_fp8_model(config: Any, granularity: str) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ..integrations.transformers import quantize_model_

    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantize_model_(model, granularity=granularity, fp8_dtype=torch.float8_e4m3fn, set_config=False)
    return model


def _kv_per_token(config: Any, tp: int, attention_sharded: bool) -> tuple[int, int | None]:
    """(bytes of transformers' KV cache per token and rank at 2 bytes/element, MLA latent bytes per token)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = cfg.num_hidden_layers
    if getattr(cfg, "kv_lora_rank", None):
        heads = cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        per_layer = heads * (qk + cfg.v_head_dim)  # transformers caches the expanded keys and values
        latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * layers
    else:
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_layer = 2 * heads * head_dim
        latent = None
    if attention_sharded:
        per_layer //= tp
    return per_layer * layers * 2, latent


def plan_memory(config: Any, tp: int, granularity: str = "block", model: nn.Module | None = None) -> MemoryPlan:
    """The per-GPU memory of `config`'s model in FP8 at tensor-parallel size `tp` (see module doc).

    ValueError naming the layer when a sharded dimension does not split on 128 boundaries.
    `model`: a meta FP8 model of this config built before (saves rebuilding it for several tp).
    """
    from ..formats import is_fp8_dtype
    from ..integrations.tensor_parallel import check_shardable, module_param_shards, resolve_tp_plan
    from ..formats import check_granularity

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    check_granularity(granularity)
    if model is None:
        model = _meta_fp8_model(config, granularity)
    kinds = resolve_tp_plan(model, "auto") if tp > 1 else {}
    plan = MemoryPlan(getattr(config, "model_type", "?"), tp, granularity,
                      param_count=sum(p.numel() for n, p in model.named_parameters() if not n.endswith("_scale_inv")))
    sharded: dict[str, Any] = {}
    for name, kind in kinds.items():
        module = model.get_submodule(name)
        base = "experts" if kind == "experts" else kind.split("_")[0]
        check_shardable(name, module, base, tp)
        sharded[name] = module_param_shards(module, base)
        plan.sharded_layers[base] = plan.sharded_layers.get(base, 0) + 1
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        specs = sharded.get(mod_name, {})
        for pname, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if id(p) in seen:
                continue  # tied weights count once
            seen.add(id(p))
            spec = specs.get(pname)
            shape = tuple(p.shape) if spec is None else spec.local_shape(tuple(p.shape), tp)
            n = 1
            for d in shape:
                n *= d
            nbytes = n * p.element_size()
            if pname.endswith("_scale_inv"):
                plan.scales += nbytes
            elif is_fp8_dtype(p.dtype):
                if spec is not None and spec.kind != "replicate":
                    plan.fp8_sharded += nbytes
                else:
                    plan.fp8_replicated += nbytes
            else:
                plan.high_precision += nbytes
    attention_sharded = any(n.endswith(("k_proj", "qkv_proj")) for n in kinds)
    plan.kv_bytes_per_token, plan.kv_latent_bytes_per_token = _kv_per_token(config, tp, attention_sharded)
    return plan


def format_plan(plan: MemoryPlan, context: int, batch: int) -> str:
    def gib(b: float) -> str:
        return f"{b / GiB:9.2f} GiB"

    lines = [
        f"{plan.model_type}: {plan.param_count / 1e9:.2f} B parameters, FP8 {plan.granularity} scales, tp={plan.tp}",
        f"sharded modules: {', '.join(f'{k} {v}' for k, v in sorted(plan.sharded_layers.items())) or 'none'}",
        "per GPU:",
        f"  FP8 weights, sharded      {gib(plan.fp8_sharded)}",
        f"  FP8 weights, replicated   {gib(plan.fp8_replicated)}",
        f"  weight scales (fp32)      {gib(plan.scales)}",
        f"  high precision (bf16/fp32){gib(plan.high_precision)}",
        f"  = weights                 {gib(plan.weights)}",
        f"  KV cache, {context} tokens x batch {batch} (bf16, transformers' cache) {gib(plan.kv_cache(context, batch))}"
        f"  ({plan.kv_bytes_per_token / 1024:.1f} KiB/token)",
    ]
    if plan.kv_latent_bytes_per_token is not None:
        lat = plan.kv_latent_bytes_per_token * context * batch
        lines.append(f"  (an MLA latent cache would need {gib(lat)}, {plan.kv_latent_bytes_per_token / 1024:.1f} KiB/token)")
    lines.append(f"  = weights + KV cache      {gib(plan.weights + plan.kv_cache(context, batch))}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a transformers config.json (or a folder holding one)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel size(s)")
    parser.add_argument("--granularity", choices=("block", "row", "tensor"), default=None,
                        help="FP8 scale granularity (default: the config's quantization_config, else block)")
    parser.add_argument("--context", type=int, default=4096, help="tokens of KV cache to budget (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="sequences of that context (default 1)")


def run(args: argparse.Namespace) -> int:
    if args.context < 0 or args.batch < 1:
        raise ValueError(f"--context must be >= 0 and --batch >= 1, got {args.context} and {args.batch}")
    config = load_config(args.config)
    granularity = args.granularity or _granularity_from_config(args.config) or "block"
    model = _meta_fp8_model(config, granularity)
    for i, tp in enumerate(args.tp):
        if i:
            print()
        try:
            print(format_plan(plan_memory(config, tp, granularity, model=model), args.context, args.batch))
        except ValueError as e:
            print(f"tp={tp}: {e}")
    return 0
