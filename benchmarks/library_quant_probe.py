"""GPU time of the CUTLASS library's own activation quantization against act_quant (Triton).

Under CUDA graphs over inputs rotated past L2, per (M, K): act_quant alone; the library's call
(``CutlassCall.with_quantization``: its quantization, then a 128-row GEMM); act_quant, then the
same prepared GEMM. The library's quantization time is read as ``lib+gemm - (act_quant+gemm -
act_quant)``. Needs a Hopper GPU and ``fp8linear build-cutlass``; sets the router's
``LIB_QUANT_MAX_ELEMENTS``.

    python benchmarks/library_quant_probe.py [--shapes 512x7168 2048x18432]
"""

from __future__ import annotations

import argparse

import torch

from fp8linear import quantize_weight
from fp8linear.ops import cutlass_gemm
from fp8linear.ops.cutlass_gemm import CutlassConfig
from fp8linear.ops.quant import act_quant, act_quant_outputs
from fp8linear.tools.timing import prepare_cuda, time_rounds

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["512x7168", "1024x7168", "2048x7168", "1024x18432",
                                                   "2048x18432", "4096x2048"], help="MxK inputs")
    args = p.parse_args()
    dev = torch.device("cuda")
    if not cutlass_gemm.cutlass_available(dev):
        raise SystemExit("the CUTLASS kernels are not available here: run `fp8linear build-cutlass` on a Hopper GPU")
    print(f"{torch.cuda.get_device_name()}; GPU us per call under CUDA graphs")
    for shape in args.shapes:
        m, k = map(int, shape.split("x"))
        w_q, w_s = quantize_weight((torch.randn(128, k, device=dev) * 0.02).to(BF16), "block", FP8)
        call = cutlass_gemm.CutlassCall(w_q, w_s.contiguous(), None, m, CutlassConfig(128))
        fused = call.with_quantization()
        q, s = act_quant_outputs(m, k, FP8, dev)
        y = torch.empty(m, 128, dtype=BF16, device=dev)

        def act_quant_alone(x):
            act_quant(x, FP8)

        def library(x):
            fused(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr())

        def act_quant_then_gemm(x):
            x_q, x_s = act_quant(x, FP8)
            call(x_q.data_ptr(), x_s.data_ptr(), y.data_ptr(), None)

        sets = [(torch.randn(m, k, device=dev).to(BF16),) for _ in range(max(2, (200 << 20) // (m * k * 2)))]
        methods = {"act_quant": act_quant_alone, "lib+gemm": library, "act_quant+gemm": act_quant_then_gemm}
        t = time_rounds({name: prepare_cuda(fn, sets, 3, True)[0] for name, fn in methods.items()}, 7)
        lib = t["lib+gemm"] - (t["act_quant+gemm"] - t["act_quant"])
        tb_s = m * k * 3 / 1e6 / t["act_quant"]  # bf16 read, fp8 written
        print(f"{m}x{k}: " + " ".join(f"{name} {v:.2f}" for name, v in t.items())
              + f" | library quantization ~{lib:.2f} us ({lib / t['act_quant']:.2f}x act_quant, "
              f"act_quant {tb_s:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
