"""CUTLASS's Hopper blockwise-scaled FP8 GEMM against cuBLAS blockwise, ours, per-tensor and BF16.

Loads the library `fp8linear build-cutlass` builds (or another built from
`fp8linear/ops/cutlass/blockwise_gemm.cu` with other tiles or clusters), checks each named kernel
(its ``fp8l_<name>_run`` entry point) against the float64 reference on fresh data, then times every
method with CUDA graphs over operand sets rotated past L2, interleaved (fp8linear.tools.timing).

    python benchmarks/cutlass_probe.py --lib "$(fp8linear build-cutlass --print-path)" \
        --configs p64x128 c128x128 s128x128 k2_128x128 --shapes 7168x2048 2112x7168 --ms 77 512 4096 --csv out.csv

(Config names as ``CutlassConfig.name``: ``kS_128x128`` is the stream-K kernel with S split-K parts;
``p64x64`` and ``c128x64`` get the weight scale per 64 rows, as CutlassCall gives it. A ``row_`` prefix runs the
1x128-weight kernel of that name, ``fp8l_row_<name>``, on the 128x128 weights' scales expanded to
one per weight row, N-major: what a tile whose width is no multiple of 128 reads.)

The results in docs/results/cutlass_probe_h100.csv came from a first build of the source (entry
points without the device, SM-count and split arguments, and more tile and cluster shapes: c128x128_1x1 /
_1x2 / _2x1, p64x128_1x1 / _1x2 / _2x1, c128x128_sk, c256x128_1x1).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import sys

import torch

from fp8linear.functional import quantize_activation
from fp8linear.ops.cublas_gemm import cublas_weight_scale
from fp8linear.ops.cutlass_gemm import narrow_block_scale
from fp8linear.reference import block_fp8_matmul_ref
from fp8linear.tools.bench import BenchConfig, _make_shape_operands, _method_setup
from fp8linear.tools.shapes import Shape
from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

BASE_METHODS = ("bf16", "cublas_tensor", "cublas_block", "ours_block", "triton_block")


def load(lib_path: str, names: list[str]):
    """Entry points per config name (`CutlassConfig.name`): "kS_128x128" runs the stream-K kernel
    (s128x128) with S split-K parts."""
    lib = ctypes.CDLL(lib_path)
    fns = {}
    for label in names:
        row, base = label.startswith("row_"), label.removeprefix("row_")
        split = re.fullmatch(r"k(\d+)_(\d+)x128", base)
        name, splits = (f"s{split.group(2)}x128", split.group(1)) if split else (base, "")
        name = f"row_{name}" if row else name
        run = getattr(lib, f"fp8l_{name}_run")
        run.restype = ctypes.c_int
        run.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_void_p]
        can = getattr(lib, f"fp8l_{name}_can_implement")
        can.restype = ctypes.c_int
        can.argtypes = [ctypes.c_int] * 3
        ws = getattr(lib, f"fp8l_{name}_workspace_size")
        ws.restype = ctypes.c_size_t
        ws.argtypes = [ctypes.c_int] * 6
        fns[label] = (run, can, ws, int(splits or 1))
    return fns


def cutlass_fn(run, ws_size, m, n, k, device, splits=1):
    index, sms = device.index or 0, torch.cuda.get_device_properties(device).multi_processor_count

    def call(a, sa, b, sb):
        y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        w = torch.empty(max(ws_size, 1), dtype=torch.uint8, device=device)
        rc = run(a.data_ptr(), sa.data_ptr(), b.data_ptr(), sb.data_ptr(), y.data_ptr(), None, m, n, k, index, sms,
                 splits, w.data_ptr(), torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"cutlass run failed: {rc}")
        return y
    return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--configs", nargs="+", required=True)
    p.add_argument("--shapes", nargs="+", required=True)
    p.add_argument("--ms", nargs="+", type=int, required=True)
    p.add_argument("--csv", default=None)
    p.add_argument("--replays", type=int, default=7)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    fns = load(args.lib, args.configs)
    gen = torch.Generator(device=device).manual_seed(0)
    cfg = BenchConfig(shapes=(Shape(1, 16),), ms=(1,), methods=BASE_METHODS, bias=False)
    rows = []
    for text in args.shapes:
        n, k = (int(v) for v in text.split("x"))
        shape = Shape(n, k)
        ops = _make_shape_operands(shape, device, gen, torch.float8_e4m3fn, BASE_METHODS)
        w_q, w_s = ops.quant["block"]
        for m in args.ms:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            rounds = {}
            for method in BASE_METHODS:
                try:
                    fn, a, nbytes, _ = _method_setup(method, x, ops, torch.float8_e4m3fn, cfg)
                    fn(*a)
                    rounds[method], _ = prepare_cuda(fn, rotation_sets(a, nbytes, device), 3, True)
                except RuntimeError as e:
                    print(f"  {method} {m}x{n}x{k}: {str(e).splitlines()[0][:90]}", file=sys.stderr)
            x_q, x_s = quantize_activation(x)
            x_s = x_s.contiguous()
            # the first and last 128 rows (the last tile of a ragged M included)
            sel = torch.cat([torch.arange(0, min(m, 128)), torch.arange(max(m - 128, 0), m)]).unique().to(device)
            ref = block_fp8_matmul_ref(x_q[sel].cpu(), x_s[sel].cpu(), w_q.cpu(), w_s.cpu(), torch.float32).double()
            errs = {}
            for name, (run, can, ws, splits) in fns.items():
                if can(m, n, k) != 0:
                    print(f"  {name} cannot implement {m}x{n}x{k}", file=sys.stderr)
                    continue
                fn = cutlass_fn(run, ws(m, n, k, device.index or 0,
                                        torch.cuda.get_device_properties(device).multi_processor_count, splits),
                                m, n, k, device, splits)
                # the 64-column tiles read the grid per 64 rows (what CutlassCall passes them)
                sb = (cublas_weight_scale(w_q, w_s, "block", as_rows=True) if name.startswith("row_")
                      else narrow_block_scale(w_s, n, 64) if name.endswith("x64") else w_s)
                y = fn(x_q, x_s, w_q, sb)[sel].double().cpu()
                errs[name] = ((y - ref).norm() / ref.norm()).item()
                a = (x_q, x_s, w_q, sb)
                nbytes = m * k + n * k + x_s.numel() * 4 + sb.numel() * 4 + m * n * 2
                rounds[name], _ = prepare_cuda(fn, rotation_sets(a, nbytes, device), 3, True)
            times = time_rounds(rounds, args.replays)
            line = f"{n:6d}x{k:<6d} M={m:<5d} " + " ".join(f"{k_}={v:8.1f}" for k_, v in times.items())
            print(line + "  err " + " ".join(f"{k_}={v:.1e}" for k_, v in errs.items()), flush=True)
            for method, us in times.items():
                rows.append({"n": n, "k": k, "m": m, "method": method, "us": us, "rel_err": errs.get(method, "")})
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["n", "k", "m", "method", "us", "rel_err"])
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
