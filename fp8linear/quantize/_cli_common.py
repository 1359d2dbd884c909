"""Shared pieces of the quantize / dequantize / inspect command-line front ends."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

from .checkpoint import CheckpointError

__all__ = ["add_runtime_arguments", "run_guarded", "user_options", "EXIT_ERROR", "EXIT_INTERRUPTED"]

T = TypeVar("T")

# Exit status for a reported error (argparse uses 2 for usage errors).
EXIT_ERROR = 1
# Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the per-tensor math runs (cuda: GPU when available; default: cpu)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="convert N shards in parallel (threads; default 1)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the checkpoint files of a non-empty DST (other files there are left alone)")  # fmt: skip
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def user_options(factory: Callable[[], T]) -> T:
    """Build an options dataclass; its validation errors (ValueError) are user errors."""
    try:
        return factory()
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def run_guarded(fn: Callable[[], int]) -> int:
    """Run `fn`, turning our errors into one line on stderr and exit status 1."""
    try:
        return fn()
    except CheckpointError as exc:
        print(f"fp8linear: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # e.g. permission denied or disk full outside the checked paths
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fp8linear: error: {where}{_one_line(exc.strerror or str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("fp8linear: interrupted; re-run the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
