"""Decode-step time of a SmolLM2-135M-shaped stack of linears on the CPU: BF16 vs FP8.

One "token" runs, for each of the 30 layers, the model's 7 linears at M rows (--m, default 1; the
main job decodes 2 prompts at once: M=2) (q 576x576,
k/v 192x576, o 576x576, gate/up 1536x576, down 576x1536; N x K); attention, norms and the
LM head are left out, so this bounds the linears' share of a decode step. FP8 runs through
`cpu_fp8_linear` (weights prepared once), through `Fp8BlockLinear` modules (what a model runs:
their per-shape plan calls `cpu_fp8_linear`) and, for scale, the reference path on a few layers.
Rounds interleave BF16 and FP8; medians are printed.

    python benchmarks/cpu_decode.py [--threads 2] [--m 1] [--layers 30] [--granularity block] [--rounds 7]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from fp8linear.ops.cpu_linear import cpu_fp8_linear, prepare_cpu_weight
from fp8linear.reference import block_fp8_matmul_ref, quantize_activation_ref, quantize_weight_ref

HIDDEN, INTER, KV = 576, 1536, 192
# (name, N, K, input): the input is the hidden state, the attention output or the MLP activation.
LINEARS = (("q", HIDDEN, HIDDEN, "h"), ("k", KV, HIDDEN, "h"), ("v", KV, HIDDEN, "h"), ("o", HIDDEN, HIDDEN, "h"),
           ("gate", INTER, HIDDEN, "h"), ("up", INTER, HIDDEN, "h"), ("down", HIDDEN, INTER, "a"))


def build(layers: int, granularity: str):
    from fp8linear.module import Fp8BlockLinear

    bf16, fp8, mods = [], [], []
    for _ in range(layers):
        for _name, n, k, src in LINEARS:
            w = torch.randn(n, k) / math.sqrt(k)
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(w)
            w_q, w_s = quantize_weight_ref(w, granularity, torch.float8_e4m3fn)
            bf16.append((lin, src))
            fp8.append((w_q, w_s, prepare_cpu_weight(w_q, w_s, granularity), src))
            mods.append((Fp8BlockLinear.from_linear(lin, granularity=granularity), src))
    return bf16, fp8, mods


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--m", type=int, default=1, help="rows of x (tokens decoded at once)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--granularity", default="block", choices=("block", "row", "tensor"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ref-layers", type=int, default=2, help="layers the reference path is timed on (scaled up)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bf16, fp8, mods = build(args.layers, args.granularity)
    h = torch.randn(args.m, HIDDEN, dtype=torch.bfloat16)
    a = torch.randn(args.m, INTER, dtype=torch.bfloat16)
    gran = args.granularity

    def step_bf16():
        for lin, src in bf16:
            lin(h if src == "h" else a)

    def step_fp8():
        for w_q, w_s, prep, src in fp8:
            cpu_fp8_linear(h if src == "h" else a, w_q, w_s, gran, None, prep)

    def step_module():
        for mod, src in mods:
            mod(h if src == "h" else a)

    ref_part = fp8[: args.ref_layers * len(LINEARS)]

    def step_ref():
        for w_q, w_s, _prep, src in ref_part:
            x = h if src == "h" else a
            x_q, x_s = quantize_activation_ref(x, w_q.dtype)
            block_fp8_matmul_ref(x_q, x_s, w_q, w_s, x.dtype, None)

    times = {"bf16": [], "fp8": [], "module": [], "ref": []}
    with torch.inference_mode():
        step_bf16(), step_fp8(), step_module(), step_ref()
        for _ in range(args.rounds):
            for name, fn in (("bf16", step_bf16), ("fp8", step_fp8), ("module", step_module), ("ref", step_ref)):
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                times[name].append(dt * (args.layers / args.ref_layers if name == "ref" else 1))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = statistics.median(b / f for b, f in zip(times["bf16"], times["fp8"]))
    ratio_mod = statistics.median(b / f for b, f in zip(times["bf16"], times["module"]))
    print(f"SmolLM2-135M-shaped linears, {args.layers} layers x {len(LINEARS)}, M={args.m}, {gran}, "
          f"{args.threads} threads, torch {torch.__version__}")
    print(f"  bf16 nn.Linear   {med['bf16']:8.2f} ms/token")
    print(f"  fp8 cpu_linear   {med['fp8']:8.2f} ms/token   (bf16/fp8 time: {ratio:.2f}x BF16 speed)")
    print(f"  fp8 modules      {med['module']:8.2f} ms/token   (bf16/fp8 time: {ratio_mod:.2f}x BF16 speed)")
    print(f"  fp8 reference    {med['ref']:8.2f} ms/token   (timed on {args.ref_layers} layers, scaled)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
