"""Kernel-development experiment: prefill GEMM variants the shipped kernel was chosen against.

Variants of the 128x128x128 (8 warps) blockwise kernel, each checked against the shipped kernel's
output and timed with triton.testing.do_bench at M=4096 on DeepSeek-V3 shapes and 8192^3:
pointer loads (shipped: `cur`), pointer loads with the previous K group's product promoted while
the next one runs (`ptrlag`), TMA descriptor loads with/without that lag and with/without
`tl.range(warp_specialize=True)`, and a persistent TMA kernel with/without loop flattening (the
shipped short-K path). Results (H100, 2026-11-22) are summarised in fp8linear/ops/gemm.py and
docs/benchmarks.md. Without a GPU it runs one small shape in the Triton interpreter (correctness
only).

    python benchmarks/prefill_variants.py [number of shapes] [variant prefixes, e.g. splitn,twogroup]
"""
import collections
import math
import re
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from fp8linear import quantize_activation, quantize_weight
from fp8linear.ops.configs import GemmConfig
from fp8linear.ops.gemm import block_fp8_gemm
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per = GROUP_M * num_pid_n
    gid = pid // per
    first_m = gid * GROUP_M
    gm = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per) % gm, (pid % per) // gm


@triton.jit
def ptr_lag_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, G, stride_wsn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = x_ptr + safe_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * K + offs_k[:, None]
    xs_ptrs = xs_ptr + safe_m * G
    ws_ptrs = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ps = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(x_ptrs)
        w = tl.load(w_ptrs)
        s = tl.load(xs_ptrs + k_step) * tl.load(ws_ptrs + k_step)
        d = tl.dot(x, w)
        acc += prev * ps[:, None]
        prev = d
        ps = s
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc += prev * ps[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(tl.bfloat16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def ptr_splitn_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, G, stride_wsn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Two tensor-core products per K group, one per half of the tile's columns, so the first
    half's promotion can run while the second half's MMA is still in flight."""
    HALF: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = pid_n * BLOCK_N + tl.arange(0, HALF)
    offs_n1 = offs_n0 + HALF
    offs_k = tl.arange(0, BLOCK_K)
    safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    safe_n0 = tl.where(offs_n0 < N, offs_n0, 0).to(tl.int64)
    safe_n1 = tl.where(offs_n1 < N, offs_n1, 0).to(tl.int64)
    x_ptrs = x_ptr + safe_m[:, None] * K + offs_k[None, :]
    w0_ptrs = w_ptr + safe_n0[None, :] * K + offs_k[:, None]
    w1_ptrs = w_ptr + safe_n1[None, :] * K + offs_k[:, None]
    xs_ptrs = xs_ptr + safe_m * G
    ws_ptrs = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
    acc0 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(x_ptrs)
        w0 = tl.load(w0_ptrs)
        w1 = tl.load(w1_ptrs)
        s = (tl.load(xs_ptrs + k_step) * tl.load(ws_ptrs + k_step))[:, None]
        d0 = tl.dot(x, w0)
        d1 = tl.dot(x, w1)
        acc0 += d0 * s
        acc1 += d1 * s
        x_ptrs += BLOCK_K
        w0_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
    mask_m = offs_m[:, None] < M
    y0 = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n0[None, :]
    tl.store(y0, acc0.to(tl.bfloat16), mask=mask_m & (offs_n0[None, :] < N))
    tl.store(y0 + HALF, acc1.to(tl.bfloat16), mask=mask_m & (offs_n1[None, :] < N))


@triton.jit
def ptr_twogroup_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, G, stride_wsn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Two 128-wide K groups per iteration (K a multiple of 256): both products are issued before
    the first promotion, so one group's promotion can overlap the other group's MMA."""
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = x_ptr + safe_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + safe_n[None, :] * K + offs_k[:, None]
    xs_ptrs = xs_ptr + safe_m * G
    ws_ptrs = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k2 in range(0, K // 256):
        x0 = tl.load(x_ptrs)
        w0 = tl.load(w_ptrs)
        x1 = tl.load(x_ptrs + 128)
        w1 = tl.load(w_ptrs + 128)
        s0 = tl.load(xs_ptrs + 2 * k2) * tl.load(ws_ptrs + 2 * k2)
        s1 = tl.load(xs_ptrs + 2 * k2 + 1) * tl.load(ws_ptrs + 2 * k2 + 1)
        d0 = tl.dot(x0, w0)
        d1 = tl.dot(x1, w1)
        acc += d0 * s0[:, None]
        acc += d1 * s1[:, None]
        x_ptrs += 256
        w_ptrs += 256
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(tl.bfloat16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def tma_kernel(x_desc, xs_ptr, w_desc, ws_ptr, y_ptr, M, N, K, G, stride_wsn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               LAG: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_m = tl.where(offs_m < M, offs_m, 0)
    xs_ptrs = xs_ptr + safe_m * G
    ws_ptrs = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ps = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k_step in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES, warp_specialize=WS):
        x = x_desc.load([pid_m * BLOCK_M, k_step * BLOCK_K])
        w = w_desc.load([pid_n * BLOCK_N, k_step * BLOCK_K])
        s = tl.load(xs_ptrs + k_step) * tl.load(ws_ptrs + k_step)
        d = tl.dot(x, w.T)
        if LAG:
            acc += prev * ps[:, None]
            prev = d
            ps = s
        else:
            acc += d * s[:, None]
    if LAG:
        acc += prev * ps[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(tl.bfloat16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def tma_persistent_kernel(x_desc, xs_ptr, w_desc, ws_ptr, y_ptr, M, N, K, G, stride_wsn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        safe_m = tl.where(offs_m < M, offs_m, 0)
        xs_ptrs = xs_ptr + safe_m * G
        ws_ptrs = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_step in tl.range(0, k_tiles, num_stages=STAGES):
            x = x_desc.load([pid_m * BLOCK_M, k_step * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, k_step * BLOCK_K])
            s = tl.load(xs_ptrs + k_step) * tl.load(ws_ptrs + k_step)
            acc += tl.dot(x, w.T) * s[:, None]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(tl.bfloat16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "SMs", sms, flush=True)
    else:
        sms = 4
        global bench
        bench = lambda fn: (fn(), 1.0)[1]
    shapes = [(4096, 18432, 7168), (4096, 7168, 18432), (4096, 24576, 1536), (4096, 32768, 512),
              (4096, 2048, 7168), (4096, 576, 7168), (8192, 8192, 8192)]
    if dev == "cpu":
        shapes = [(256, 384, 512)]
    if len(sys.argv) > 1:
        shapes = shapes[:int(sys.argv[1])]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else []  # variant name prefixes to run
    for (m, n, k) in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
        x_q, x_s = quantize_activation(x)
        w_q, w_s = quantize_weight(w, "block")
        G = x_s.shape[1]
        flops = 2 * m * n * k
        one = torch.ones((), device=dev)
        res = {}
        res["bf16"] = (bench(lambda: x @ w.T), None)
        res["pertensor"] = (float("nan") if dev == "cpu" else bench(lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), None)
        base = block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16, None, GemmConfig(128, 128, 128, 8, 8, 4))
        ref = base.float()
        def err(y):
            return ((y.float() - ref).norm() / ref.norm()).item()
        for st in (3, 4):
            cfg = GemmConfig(128, 128, 128, 8, 8, st)
            res[f"cur_s{st}"] = (bench(lambda: block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16, None, cfg)), 0.0)
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        grid = (triton.cdiv(m, 128) * triton.cdiv(n, 128),)
        variants = []
        for st in (3, 4):
            variants.append((f"splitn_s{st}", lambda st=st: ptr_splitn_kernel[grid](x_q, x_s, w_q, w_s, y, m, n, k, G, w_s.stride(0),
                                                                    BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=st)))
            if k % 256 == 0:
                variants.append((f"twogroup_s{st}", lambda st=st: ptr_twogroup_kernel[grid](x_q, x_s, w_q, w_s, y, m, n, k, G, w_s.stride(0),
                                                                    BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=st)))
        for st in (3, 4):
            variants.append((f"ptrlag_s{st}", lambda st=st: ptr_lag_kernel[grid](x_q, x_s, w_q, w_s, y, m, n, k, G, w_s.stride(0),
                                                                    BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=st)))
        if TensorDescriptor is not None:
            xd = TensorDescriptor.from_tensor(x_q, [128, 128])
            wd = TensorDescriptor.from_tensor(w_q, [128, 128])
            for lag in (False, True):
                for ws in (False, True):
                    for st in (3, 4):
                        nw = 8
                        variants.append((f"tma_lag{int(lag)}_ws{int(ws)}_s{st}", lambda lag=lag, ws=ws, st=st, nw=nw: tma_kernel[grid](
                            xd, x_s, wd, w_s, y, m, n, k, G, w_s.stride(0), BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8,
                            LAG=lag, WS=ws, STAGES=st, num_warps=nw, num_stages=st)))
            for fl in (False, True):
                for ws in (False, True):
                    variants.append((f"pers_fl{int(fl)}_ws{int(ws)}", lambda fl=fl, ws=ws: tma_persistent_kernel[(min(sms, grid[0]),)](
                        xd, x_s, wd, w_s, y, m, n, k, G, w_s.stride(0), BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8,
                        NUM_SMS=sms, FLATTEN=fl, WS=ws, STAGES=4, num_warps=8, num_stages=4)))
        if only:
            variants = [v for v in variants if any(v[0].startswith(o) for o in only)]
        for name, fn in variants:
            try:
                y.zero_()
                h = fn()
                regs = f"regs={getattr(h, 'n_regs', '?')} spills={getattr(h, 'n_spills', '?')}"
                ptx = getattr(h, "asm", {}).get("ptx", "")
                if ptx:  # how many tensor-core products each wait lets stay in flight
                    waits = re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", ptx)
                    regs += f" wgmma_waits={dict(collections.Counter(waits))}"
                torch.cuda.synchronize() if dev == "cuda" else None
                e = err(y)
                res[name] = (bench(fn), f'{e:.2e} {regs}')
            except Exception as ex:  # noqa: BLE001
                res[name] = (float("nan"), repr(ex).splitlines()[0][:150])
        print(f"\n== M={m} N={n} K={k}", flush=True)
        for name, (t, e) in res.items():
            tf = flops / t / 1e6 if t == t else float("nan")
            print(f"  {name:22s} {t:9.1f} us  {tf:7.1f} TF/s  err={e}", flush=True)


if __name__ == "__main__":
    main()
