"""``fp8linear dequantize SRC DST``: convert an FP8 checkpoint (ours or DeepSeek-V3's) back to BF16."""

from __future__ import annotations

import argparse

from ._cli_common import add_runtime_arguments, run_guarded, user_options
from .convert import DequantizeOptions, dequantize_checkpoint

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="FP8 model folder (quant_method 'fp8': weight + weight_scale_inv)")
    parser.add_argument("dst", metavar="DST", help="output folder (created; must be empty unless --overwrite)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype of the dequantized weights (default bfloat16)")  # fmt: skip
    add_runtime_arguments(parser)


def run(args: argparse.Namespace) -> int:
    def go() -> int:
        options = user_options(
            lambda: DequantizeOptions(
                dtype=args.dtype, device=args.device, workers=args.workers, overwrite=args.overwrite, progress=not args.quiet
            )
        )
        print(dequantize_checkpoint(args.src, args.dst, options))
        return 0

    return run_guarded(go)
