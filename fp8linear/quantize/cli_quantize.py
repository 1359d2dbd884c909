"""``fp8linear quantize SRC DST``: convert a BF16/FP16/FP32 safetensors checkpoint to FP8."""

from __future__ import annotations

import argparse

from ..formats import GRANULARITIES
from ._cli_common import add_runtime_arguments, run_guarded, user_options
from .convert import QuantizeOptions, quantize_checkpoint

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="Hugging Face model folder (config.json + *.safetensors)")
    parser.add_argument("dst", metavar="DST", help="output folder (created; must be empty unless --overwrite)")
    parser.add_argument("--granularity", choices=GRANULARITIES, default=None,
                        help="weight scales: block = 128x128 (default, DeepSeek-V3), row = 1x128, tensor = one per weight")  # fmt: skip
    parser.add_argument("--fp8-dtype", default="e4m3fn", choices=("e4m3fn", "e4m3fnuz"),
                        help="e4m3fn (NVIDIA, default) or e4m3fnuz (AMD MI300); on an e4m3fn FP8 checkpoint, "
                        "e4m3fnuz converts it directly without BF16")  # fmt: skip
    parser.add_argument("--ignore", action="append", default=[], metavar="REGEX",
                        help="keep tensors whose name matches REGEX in high precision (repeatable)")  # fmt: skip
    parser.add_argument("--only", action="append", default=[], metavar="REGEX",
                        help="quantize only tensors whose name matches REGEX (repeatable)")  # fmt: skip
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="quantize weights that contain NaN/Inf instead of refusing")  # fmt: skip
    add_runtime_arguments(parser)


def run(args: argparse.Namespace) -> int:
    def go() -> int:
        options = user_options(lambda: QuantizeOptions(
            granularity=args.granularity,
            fp8_dtype=args.fp8_dtype,
            ignore=tuple(args.ignore),
            only=tuple(args.only),
            device=args.device,
            workers=args.workers,
            overwrite=args.overwrite,
            allow_nonfinite=args.allow_nonfinite,
            progress=not args.quiet,
        ))
        print(quantize_checkpoint(args.src, args.dst, options))
        return 0

    return run_guarded(go)
