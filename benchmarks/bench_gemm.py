"""Time the FP8 GEMM against BF16 and cuBLAS FP8 on this GPU: the same as `fp8linear bench`.

    python benchmarks/bench_gemm.py --quick          # ~1 minute
    python benchmarks/bench_gemm.py --out results/   # the default shapes and Ms, < 6 minutes on an H100

Needs the package importable: `pip install -e .` (or run `python -m fp8linear bench` from the repo root).
See docs/benchmarks.md for reading the output.
"""

from __future__ import annotations

import argparse
import sys

try:
    from fp8linear.tools import bench_cli
except ImportError as e:  # not installed and not run from the repo root
    sys.exit(f"cannot import fp8linear ({e}); run `pip install -e .` first, or `python -m fp8linear bench`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_gemm.py", description=__doc__.splitlines()[0])
    bench_cli.add_arguments(parser)
    return bench_cli.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
