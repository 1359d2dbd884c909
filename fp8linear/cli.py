"""The `fp8linear` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; they are
imported only when chosen, so `fp8linear quantize` does not import transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("fp8linear.tools.demo", "quantize one linear layer, run it, print error (and speed vs BF16 on a GPU)"),
    "quantize": ("fp8linear.quantize.cli_quantize", "convert a BF16/FP16 safetensors checkpoint to FP8"),
    "dequantize": ("fp8linear.quantize.cli_dequantize", "convert an FP8 checkpoint back to BF16"),
    "inspect": ("fp8linear.quantize.cli_inspect", "summarise a checkpoint's tensors and quantization error"),
    "bench": ("fp8linear.tools.bench_cli", "time the FP8 GEMM against BF16 and cuBLAS FP8 on this GPU"),
    "tune": ("fp8linear.tools.tune", "tune GEMM launch configs for a model's shapes and write a table"),
    "tune-routes": ("fp8linear.tools.route_tune", "time every kernel the router could pick per shape and M; "
                    "write this GPU's routes table"),
    "build-cutlass": ("fp8linear.tools.cutlass_build", "compile the optional CUTLASS Hopper GEMM kernels (nvcc) "
                      "into the cache"),
    "plan-memory": ("fp8linear.tools.plan_memory", "per-GPU memory of a model's config in FP8 under tensor parallelism"),
    "amd-check": ("fp8linear.tools.amd_check", "compile every kernel and AMD config for MI300X (gfx942) without a GPU; "
                  "report registers, spills, LDS, occupancy, MFMAs"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp8linear", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
