"""Kernel-development experiment: a Gluon (Triton 3.6) blockwise FP8 GEMM for Hopper prefill.

The shipped `tl` kernel (fp8linear/ops/gemm.py) waits for every K group's WGMMA before promoting
its product into the fp32 accumulator (`wgmma.wait_group 0`), and at prefill it runs at about
BF16 speed, 1.45x cuBLAS blockwise. Gluon exposes the asynchronous WGMMA, so this kernel can
issue group k's product and promote group k-1's while it runs. It streams 128x128 FP8 tiles of x
and w through a TMA ring (zero-filled past M, N, K) and stores through shared memory and TMA.
MODE picks the schedule:

    0  overlapped: issue P_k (landing in P_{k-1}'s C-operand registers), promote P_{k-1}, wait P_k
    3  overlapped, P_k in fresh registers
    1  serial: issue P_k, wait, promote P_k (the `tl` kernel's schedule)
    2  no promotion: the tensor cores accumulate every group (wrong scales: a speed bound only)

`python benchmarks/gluon_prefill.py` checks modes 0/1 against the float64 reference (ragged
shapes, every granularity, bias, output dtypes) and times them at M in {1024, 4096} on the
DeepSeek-V3 shapes against our `tl` kernel, cuBLAS blockwise, per-tensor cuBLAS FP8 and BF16 (the benchmark's
CUDA-graph timer, operands rotated past the L2); `GLUON_VARIANTS=1` times every mode and tile
width on five large shapes. Results (H100) are in docs/benchmarks.md: with
promotion no schedule reaches cuBLAS, because the register file caps the tile at 128x128 (the
accumulator plus one product per thread) and 128x128 tiles without any promotion already top out
at 1.25 PFLOP/s against cuBLAS blockwise's 1.34. Not shipped. Needs a Hopper GPU and a Triton
with Gluon; elsewhere it says so and exits.

    python benchmarks/gluon_prefill.py [--m 1024 4096] [--quick] [--no-check]
"""
import argparse
import csv
import math
import os
import sys

import torch
import triton

from fp8linear import quantize_activation, quantize_weight
from fp8linear.tools.bench import rel_err as rel
from fp8linear.tools.shapes import default_shapes
from fp8linear.tools.timing import rotation_sets, time_graph
from fp8linear.formats import GROUP_SIZE
from fp8linear.ops.cublas_gemm import cublas_accepts, cublas_fp8_gemm
from fp8linear.ops.gemm import block_fp8_gemm
from fp8linear.reference import block_fp8_matmul_ref

try:  # Gluon: Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from fp8linear.ops.ws_gemm import _promote  # gemm_common.promote's arithmetic in Gluon

    HAS_GLUON = True
except ImportError:
    HAS_GLUON = False

# 128 rows over 8 warps (two warpgroups of 64 rows); K steps of one 128-wide scale group.
BLOCK_M = BLOCK_K = 128
NUM_WARPS = 8
# Tiles of GROUP_M row-blocks walk each column block of W together while it is in L2.
GROUP_M = 8

if HAS_GLUON:

    @gluon.jit
    def _gluon_fp8_gemm_kernel(
        x_desc, w_desc, y_desc, xs_ptr, ws_ptr, bias_ptr,
        M, N, K,
        stride_xsm, stride_xsg, stride_wsn, stride_wsk,
        WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
        MODE: gl.constexpr, num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
        )
        rows: gl.constexpr = gl.SliceLayout(1, mma_layout)
        cols: gl.constexpr = gl.SliceLayout(0, mma_layout)

        # Grouped tile order, as fp8linear.ops.gemm._tile_coords.
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_pid_n
        first_m = (pid // per_group) * GROUP_M
        group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        tile_bytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
        k_steps = gl.cdiv(K, BLOCK_K)
        for i in gl.static_range(STAGES - 1):
            pred = i < k_steps
            mbarrier.expect(ready.index(i), tile_bytes, pred=pred)
            tma.async_copy_global_to_shared(x_desc, [off_m, i * BLOCK_K], ready.index(i), a_bufs.index(i), pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, i * BLOCK_K], ready.index(i), b_bufs.index(i), pred=pred)

        # Rows/columns past M/N read row/column 0's scales; their products are zero (TMA zero-fill)
        # and the TMA store clips them.
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=rows)
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=cols)
        xs_ptrs = xs_ptr + gl.where(offs_m < M, offs_m, 0).to(gl.int64) * stride_xsm
        if W_SCALE_UNIFORM:  # one weight scale per K group for the whole tile: a scalar
            ws_ptrs = ws_ptr + (off_n // WS_GROUP_N).to(gl.int64) * stride_wsn
            prev_ws = gl.to_tensor(0.0)
        else:  # row-wise: one per output column
            ws_ptrs = ws_ptr + (gl.where(offs_n < N, offs_n, 0) // WS_GROUP_N).to(gl.int64) * stride_wsn
            prev_ws = gl.zeros([BLOCK_N], gl.float32, layout=cols)

        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
        prev = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)  # product of group k-1
        prev_xs = gl.zeros([BLOCK_M], gl.float32, layout=rows)  # its scales (0 before group 0)
        for k in range(k_steps):
            s = k % STAGES
            mbarrier.wait(ready.index(s), (k // STAGES) & 1)
            if MODE == 0 or MODE == 3:  # overlapped: promote group k-1 while group k runs on the tensor cores
                if MODE == 0:  # the product lands in prev's registers (the C operand, unused)
                    product = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), prev, use_acc=False,
                                            is_async=True)
                else:  # in fresh ones
                    product = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)),
                                            gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout),
                                            use_acc=False, is_async=True)
                acc = _promote(acc, prev, prev_xs, prev_ws, W_SCALE_UNIFORM)
            elif MODE == 1:  # serial: wait for group k, then promote it
                product = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), prev, use_acc=False,
                                        is_async=True)
            else:  # diagnostic: no promotion, the tensor cores accumulate (wrong scales)
                product = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            prev_xs = gl.load(xs_ptrs + k * stride_xsg)
            prev_ws = gl.load(ws_ptrs + k * stride_wsk)
            # Every warpgroup has waited for its product of group k-1 before this barrier, so the
            # slot that group used can be refilled with group k + STAGES - 1.
            gl.thread_barrier()
            nk = k + STAGES - 1
            ns = nk % STAGES
            pred = nk < k_steps
            mbarrier.expect(ready.index(ns), tile_bytes, pred=pred)
            tma.async_copy_global_to_shared(x_desc, [off_m, nk * BLOCK_K], ready.index(ns), a_bufs.index(ns), pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, nk * BLOCK_K], ready.index(ns), b_bufs.index(ns), pred=pred)
            if MODE == 2:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
            else:
                prev = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
                if MODE == 1:
                    acc = _promote(acc, prev, prev_xs, prev_ws, W_SCALE_UNIFORM)
        if MODE == 0 or MODE == 3:
            acc = _promote(acc, prev, prev_xs, prev_ws, W_SCALE_UNIFORM)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + gl.where(offs_n < N, offs_n, 0)).to(gl.float32)[None, :]
        y_smem = gl.allocate_shared_memory(y_desc.dtype, [BLOCK_M, BLOCK_N], y_desc.layout)
        y_smem.store(acc.to(y_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [off_m, off_n], y_smem)
        tma.store_wait(pendings=0)



def gluon_fp8_gemm(x_q, x_s, w_q, w_s, granularity, out_dtype, bias=None, block_n=128, stages=4, mode=1):
    """y (M, N) = dequant(x_q, x_s) @ dequant(w_q, w_s).T (+ bias); TMA needs K and N rows 16-byte aligned."""
    m, k = x_q.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if granularity == "tensor":
        ws_group_n, stride_wsn, stride_wsk = 1, 0, 0
    else:
        ws_group_n = GROUP_SIZE if granularity == "block" else 1
        stride_wsn, stride_wsk = w_s.stride(0), w_s.stride(1)
    uniform = granularity == "tensor" or (granularity == "block" and GROUP_SIZE % block_n == 0)
    gl_out = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[out_dtype]
    xb, wb, yb = [BLOCK_M, BLOCK_K], [block_n, BLOCK_K], [BLOCK_M, block_n]
    x_desc = GluonTensorDescriptor.from_tensor(x_q, xb, gl.NVMMASharedLayout.get_default_for(xb, gl.float8e4nv))
    w_desc = GluonTensorDescriptor.from_tensor(w_q, wb, gl.NVMMASharedLayout.get_default_for(wb, gl.float8e4nv))
    y_desc = GluonTensorDescriptor.from_tensor(y, yb, gl.NVMMASharedLayout.get_default_for(yb, gl_out))
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, block_n),)
    _gluon_fp8_gemm_kernel[grid](
        x_desc, w_desc, y_desc, x_s, w_s, bias if bias is not None else y,
        m, n, k,
        x_s.stride(0), x_s.stride(1), stride_wsn, stride_wsk,
        WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=uniform, HAS_BIAS=bias is not None, GROUP_M=GROUP_M, STAGES=stages,
        MODE=mode, num_warps=NUM_WARPS,
    )
    return y


def gluon_ok(x_q, w_q, out_dtype) -> bool:
    row_bytes = w_q.shape[0] * torch.empty((), dtype=out_dtype).element_size()
    return x_q.shape[1] % 16 == 0 and row_bytes % 16 == 0


def check() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for m, n, k in [(300, 576, 7168), (1000, 2112, 7168), (129, 4096, 512), (4096, 7168, 256), (77, 304, 2304),
                    (2048, 1536, 1536), (5, 128, 128), (640, 24576, 1536)]:
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
        bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
        x_q, x_s = quantize_activation(x)
        for gran in ("block", "row", "tensor"):
            w_q, w_s = quantize_weight(w, gran)
            for out_dtype, b in ((torch.bfloat16, None), (torch.bfloat16, bias), (torch.float32, bias), (torch.float16, None)):
                if not gluon_ok(x_q, w_q, out_dtype):
                    print(f"skip {m}x{n}x{k} {gran} {out_dtype}: not TMA-able")
                    continue
                w_s_arg = w_s.reshape(()) if gran == "tensor" else w_s
                y = gluon_fp8_gemm(x_q, x_s, w_q, w_s_arg, gran, out_dtype, b, mode=0)
                y1 = gluon_fp8_gemm(x_q, x_s, w_q, w_s_arg, gran, out_dtype, b, mode=1)
                ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, b)
                tl_y = block_fp8_gemm(x_q, x_s, w_q, w_s.reshape(()) if gran == "tensor" else w_s, gran, out_dtype, b)
                e, e_tl = max(rel(y, ref), rel(y1, ref)), rel(tl_y, ref)
                worst = max(worst, e / max(e_tl, 1e-7))
                # fp32: Hopper's FP8 MMA keeps ~14 bits within a K group (1.3e-4, as the tl kernel)
                tol = {torch.float32: 3e-4, torch.float16: 5e-4, torch.bfloat16: 3e-3}[out_dtype]
                status = "ok" if e < tol and torch.isfinite(y).all() else "FAIL"
                print(f"{status} {m}x{n}x{k} {gran:6} {str(out_dtype):15} bias={b is not None}: rel {e:.2e} (tl {e_tl:.2e})")
    print(f"worst gluon/tl error ratio {worst:.2f} (tl takes mma.sync with exact fp32 sums for tiny M)")


def time_shapes(ms: list[int], quick: bool) -> list[dict]:
    rows = []
    shapes = default_shapes()[:5] if quick else default_shapes()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in shapes:
        n, k = shape.n, shape.k
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
        wq_b, ws_b = quantize_weight(w, "block")
        wq_r, ws_r = quantize_weight(w, "row")
        wq_t, ws_t = quantize_weight(w, "tensor")
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            x_q, x_s = quantize_activation(x)
            xs_mmajor = x_s.t().contiguous().t()
            ref = block_fp8_matmul_ref(x_q[:128], x_s[:128], wq_b, ws_b, torch.float32)
            methods = {
                "bf16": (lambda a, b: a @ b.t(), (x, w)),
                "tensor": (lambda a, b, sa, sb: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16),
                           (x_q, wq_t, torch.ones((), device="cuda"), ws_t)),
                "tl": (lambda a, s, b, t: block_fp8_gemm(a, s, b, t, "block", torch.bfloat16), (x_q, x_s, wq_b, ws_b)),
                "gluon": (lambda a, s, b, t: gluon_fp8_gemm(a, s, b, t, "block", torch.bfloat16, mode=1), (x_q, x_s, wq_b, ws_b)),
                "gluon_ovl": (lambda a, s, b, t: gluon_fp8_gemm(a, s, b, t, "block", torch.bfloat16, mode=3),
                              (x_q, x_s, wq_b, ws_b)),
                "gluon_row": (lambda a, s, b, t: gluon_fp8_gemm(a, s, b, t, "row", torch.bfloat16, mode=1),
                              (x_q, x_s, wq_r, ws_r)),
            }
            if cublas_accepts(n, k, "block", wq_b.dtype, torch.bfloat16, None):
                methods["cublas"] = (lambda a, s, b, t: cublas_fp8_gemm(a, s, b, t, "block", None), (x_q, xs_mmajor, wq_b, ws_b))
            if cublas_accepts(n, k, "row", wq_r.dtype, torch.bfloat16, None):
                methods["cublas_row"] = (lambda a, s, b, t: cublas_fp8_gemm(a, s, b, t, "row", None), (x_q, xs_mmajor, wq_r, ws_r))
            row = {"shape": f"{n}x{k}", "n": n, "k": k, "m": m}
            for name, (fn, args) in methods.items():
                try:
                    if name not in ("bf16", "tensor"):
                        err = rel(fn(*args)[:128], ref) if name not in ("gluon_row", "cublas_row") else float("nan")
                        row[name + "_err"] = err
                    nbytes = sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))
                    row[name] = time_graph(fn, rotation_sets(args, nbytes, x.device), replays=5)
                except Exception as e:  # noqa: BLE001 - report and go on with the next method
                    print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}")
            flops = 2 * m * n * k
            parts = [f"{k_}={v:.1f}" for k_, v in row.items() if k_ in methods]
            tf = flops / row["gluon"] / 1e6 if "gluon" in row else float("nan")
            print(f"{shape.name:28} {n:6}x{k:<6} M={m:5} " + " ".join(parts) + f"  gluon {tf:.0f} TFLOP/s"
                  + f"  err gluon {row.get('gluon_err', float('nan')):.1e}")
            rows.append(row)
    return rows


def summarize(rows: list[dict]) -> None:
    def gm(pairs):
        vals = [a / b for a, b in pairs]
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")

    for a, b in [("gluon", "cublas"), ("gluon", "tl"), ("gluon_ovl", "gluon"), ("gluon", "tensor"), ("bf16", "gluon"), ("gluon_row", "gluon"),
                 ("gluon_row", "cublas_row"), ("cublas", "tensor")]:
        pairs = [(r[a], r[b]) for r in rows if a in r and b in r]
        print(f"geomean t({a}) / t({b}) over {len(pairs)} cases: {gm(pairs):.3f}")
    for r in rows:
        if "bf16" in r and "gluon" in r:
            r["x_bf16"] = r["bf16"] / r["gluon"]
    worst = {}
    for r in rows:
        if "x_bf16" in r:
            worst.setdefault(r["shape"], []).append(r["x_bf16"])
    print("speedup vs BF16 per shape (geomean over M):",
          ", ".join(f"{s} {math.exp(sum(map(math.log, v)) / len(v)):.2f}" for s, v in worst.items()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args()
    if not a.no_check:
        check()
    rows = time_shapes(a.m, a.quick)
    summarize(rows)
    out = os.environ.get("OUT", ".")
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "gluon_prefill.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)


def variants() -> None:
    """Where the time goes: overlapped promotion (modes 0, 3), serial promotion (1), no promotion
    (2: the tensor cores accumulate every K group, wrong scales: a speed bound only), at 128x64,
    128x128 and 128x256 tiles (128x256 with promotion spills), against cuBLAS blockwise and
    per-tensor, M=4096."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    m = 4096
    for n, k in [(18432, 7168), (7168, 18432), (4608, 7168), (2048, 7168), (24576, 1536)]:
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        x_q, x_s = quantize_activation(x)
        wq, ws = quantize_weight(w, "block")
        wq_t, ws_t = quantize_weight(w, "tensor")
        out = {}
        cands = {f"g{bn}_m{mode}_s{st}": (lambda a, s, b, t, bn=bn, mode=mode, st=st:
                                          gluon_fp8_gemm(a, s, b, t, "block", torch.bfloat16, None, bn, st, mode))
                 for bn, mode, st in [(128, 0, 4), (128, 3, 4), (128, 1, 4), (128, 2, 4), (128, 1, 3), (64, 1, 4),
                                      (256, 2, 3), (256, 1, 3)]}
        cands["cublas"] = lambda a, s, b, t: cublas_fp8_gemm(a, s.t().contiguous().t(), b, t, "block", None)
        for name, fn in cands.items():
            args = (x_q, x_s, wq, ws)
            nbytes = sum(t.numel() * t.element_size() for t in args)
            try:
                out[name] = time_graph(fn, rotation_sets(args, nbytes, x.device), replays=5)
            except Exception as e:  # noqa: BLE001
                print(f"  {name} failed: {type(e).__name__}: {str(e)[:160]}")
        args = (x_q, wq_t, torch.ones((), device="cuda"), ws_t)
        out["tensor"] = time_graph(lambda a, b, sa, sb: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16),
                                   rotation_sets(args, x_q.numel() + wq_t.numel(), x.device), replays=5)
        tf = {kk: 2 * m * n * k / v / 1e6 for kk, v in out.items()}
        print(f"{n}x{k} M={m}: " + " ".join(f"{kk}={v:.0f}us/{tf[kk]:.0f}TF" for kk, v in out.items()))


if __name__ == "__main__":
    if not (HAS_GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        sys.exit("gluon_prefill.py needs a Hopper GPU and a Triton with Gluon (triton.experimental.gluon)")
    if os.environ.get("GLUON_VARIANTS"):
        variants()
    else:
        main()
