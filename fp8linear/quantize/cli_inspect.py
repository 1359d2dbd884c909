"""``fp8linear inspect PATH``: a checkpoint's tensors, sizes, quantization config and (``--error``) FP8 error."""

from __future__ import annotations

import argparse

from ._cli_common import run_guarded
from .inspection import inspect_checkpoint

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="model folder or a single .safetensors file")
    parser.add_argument("--error", action="store_true",
                        help="measure each weight's quantization error (relative error, SQNR) for block, row and "
                        "tensor scales side by side (reads the weights)")  # fmt: skip
    parser.add_argument("--only", action="append", default=[], metavar="REGEX", help="--error: only these weights")
    parser.add_argument("--ignore", action="append", default=[], metavar="REGEX", help="--error: skip these weights")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="--error: the first N weights only")
    parser.add_argument("--fp8-dtype", default="e4m3fn", choices=("e4m3fn", "e4m3fnuz"), help="--error: FP8 format")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="--error: where to compute")
    parser.add_argument("--tensors", action="store_true", help="list every tensor (name, dtype, shape, shard)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    def go() -> int:
        report = inspect_checkpoint(
            args.path,
            error=args.error,
            only=args.only,
            ignore=args.ignore,
            limit=args.limit,
            fp8_dtype=args.fp8_dtype,
            device=args.device,
            progress=args.error and not args.quiet,
        )
        print(report.to_json() if args.json else report.format(list_tensors=args.tensors))
        return 0

    return run_guarded(go)
