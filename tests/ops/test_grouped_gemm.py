"""Grouped FP8 MoE GEMM: routing alignment, Triton kernel vs a float64 reference, validation.

Kernel tests (``test_kernel_*``) run the Triton kernel either on a CUDA device or on the CPU
under Triton's interpreter. ``TRITON_INTERPRET`` is read when a ``@triton.jit`` kernel is
defined, i.e. when its module is first imported. ``tests/conftest.py`` sets it at session start
on machines without CUDA; this file checks that the kernel really is interpreted (the kernel
object's type, not the variable), and if it is not (the kernels were imported before the
variable was set), :func:`test_interpreter_subprocess` re-runs the kernel tests in a fresh
``python -m pytest`` process with ``TRITON_INTERPRET=1`` set from the start.

Tolerance (kernel vs float64 product of the dequantized operands, fp32 output):
``|y - ref| <= rtol * |ref| + rtol * max|ref|`` with rtol = 1e-5 under the interpreter (fp32
accumulation in another order) and 1e-3 on GPUs (Hopper's FP8 tensor cores accumulate each
128-wide K step with ~14 mantissa bits before the fp32 promotion).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fp8linear import quantize_activation, quantize_weight
from fp8linear.functional import grouped_fp8_matmul
from fp8linear.reference import dequantize_activation_ref, dequantize_weight_ref

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz

try:
    from fp8linear.ops import grouped_gemm as gg

    _KERNEL_INTERPRETED = type(gg._grouped_fp8_gemm_kernel).__name__ == "InterpretedFunction"
except ImportError:  # no Triton: only the reference-path tests run
    gg = None
    _KERNEL_INTERPRETED = False

if _KERNEL_INTERPRETED:
    KERNEL_DEVICE: str | None = "cpu"
elif CUDA and gg is not None:
    KERNEL_DEVICE = "cuda"
else:
    KERNEL_DEVICE = None

# fp32 accumulation in another order than the float64 reference: 1e-5. On Hopper, FP8 wgmma
# accumulates inside each 128-wide K step with ~14 mantissa bits before the fp32 promotion
# (DeepSeek-V3 report, sec. 3.3.2; ~1.3e-4 relative measured on H100), so 1e-3 on GPUs.
RTOL = 1e-3 if KERNEL_DEVICE == "cuda" else 1e-5

needs_kernel = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="needs CUDA, or TRITON_INTERPRET=1 (see test_interpreter_subprocess)"
)


def _routing(t: int, e: int, top_k: int, *, skip_expert: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    choices = [i for i in range(e) if i != skip_expert]
    rows = [torch.tensor(choices)[torch.randperm(len(choices), generator=g)[:top_k]] for _ in range(t)]
    return torch.stack(rows) if rows else torch.empty((0, top_k), dtype=torch.int64)


def _operands(t, k, n, e, top_k, gran, fp8, device, per_token=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = t if per_token else t * top_k
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(e, n, k, generator=g) * 0.05
    w[0, : min(n, 3)] *= 40.0  # a few large rows: blocks with very different scales
    x_q, x_s = quantize_activation(x.to(device), fp8_dtype=fp8, backend="reference")
    w_q, w_s = quantize_weight(w.to(device), gran, fp8)
    return x_q, x_s, w_q, w_s


def _float64_reference(x_q, x_s, w_q, w_s, idx, per_token, bias=None, topk_w=None):
    """Per pair, in float64 from the dequantized operands; ids outside [0, E) give zero rows."""
    a = dequantize_activation_ref(x_q.cpu(), x_s.cpu()).double()
    w = dequantize_weight_ref(w_q.cpu(), w_s.cpu()).double()
    e, n, _ = w.shape
    t, top_k = idx.shape
    out = torch.zeros(t * top_k, n, dtype=torch.float64)
    for p, ex in enumerate(idx.reshape(-1).tolist()):
        if not 0 <= ex < e:
            continue
        y = a[p // top_k if per_token else p] @ w[ex].T
        if bias is not None:
            y = y + bias[ex].double().cpu()
        if topk_w is not None:
            y = y * topk_w.reshape(-1)[p].double().cpu()
        out[p] = y
    return out


def _assert_close64(y: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    y = y.double().cpu()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (y - ref).abs()
    bound = rtol * ref.abs() + rtol * scale
    assert bool((err <= bound).all()), f"max err {err.max().item():.3e} > bound (rtol={rtol}, max|ref|={scale:.3e})"


# ----------------------------------------------------------------------------- alignment
ALIGN_CASES = [(1, 8, 2, 16), (7, 6, 2, 16), (3, 16, 4, 16), (40, 4, 2, 32), (0, 4, 2, 16), (64, 64, 6, 64),
               (5, 300, 8, 16)]


def _sentinel_routing(t: int, e: int, top_k: int) -> torch.Tensor:
    idx = _routing(t, e, top_k, skip_expert=1 if e > 2 else None)
    if t:
        idx[0, 0] = e + 5  # expert-parallel sentinels: go to the null expert
        idx[-1, -1] = -1
    return idx


@pytest.mark.parametrize("t,e,top_k,block_m", ALIGN_CASES)
def test_align_block_size_layout(t, e, top_k, block_m):
    if gg is None:
        pytest.skip("Triton not installed")
    idx = _sentinel_routing(t, e, top_k)
    r = gg.moe_align_block_size(idx, e, block_m, method="torch")
    s = t * top_k
    ids, blocks = r.sorted_pair_ids.long(), r.block_expert.long()
    assert r.num_pairs == s and r.block_m == block_m and r.top_k == top_k
    assert ids.numel() == blocks.numel() * block_m
    assert ids.numel() >= s + min(s, e + 1) * (block_m - 1)  # static capacity bound
    real = ids[ids < s]
    assert sorted(real.tolist()) == list(range(s))  # every pair exactly once
    flat = idx.reshape(-1)
    expect = torch.where((flat >= 0) & (flat < e), flat, torch.full_like(flat, e))
    for b in range(blocks.numel()):
        rows = ids[b * block_m : (b + 1) * block_m]
        valid = rows[rows < s]
        if blocks[b] > e:  # unused tail block: pure padding
            assert valid.numel() == 0
        else:
            assert (expect[valid] == blocks[b]).all()
    assert (blocks[1:] >= blocks[:-1]).all()  # blocks ordered by expert
    assert 1 not in blocks.tolist() or e <= 2  # the expert with no tokens owns no block


@needs_kernel
@pytest.mark.parametrize("t,e,top_k,block_m", ALIGN_CASES + [(300, 64, 6, 16)])
def test_kernel_align_matches_torch_ops(t, e, top_k, block_m):
    """The one-launch align kernel (decode) and the torch-ops path (prefill) agree exactly."""
    idx = _sentinel_routing(t, e, top_k).to(KERNEL_DEVICE)
    a = gg.moe_align_block_size(idx, e, block_m, method="kernel")
    b = gg.moe_align_block_size(idx, e, block_m, method="torch")
    assert torch.equal(a.sorted_pair_ids, b.sorted_pair_ids)
    assert torch.equal(a.block_expert, b.block_expert)
    assert a.sorted_pair_ids.dtype == a.block_expert.dtype == torch.int32


def test_align_block_size_rejects_bad_input():
    if gg is None:
        pytest.skip("Triton not installed")
    with pytest.raises(ValueError, match="2-D"):
        gg.moe_align_block_size(torch.zeros(4, dtype=torch.int64), 4, 16)
    with pytest.raises(TypeError, match="int32 or int64"):
        gg.moe_align_block_size(torch.zeros(4, 2), 4, 16)
    with pytest.raises(ValueError, match="num_experts"):
        gg.moe_align_block_size(torch.zeros(4, 2, dtype=torch.int64), 0, 16)
    with pytest.raises(ValueError, match="method"):
        gg.moe_align_block_size(torch.zeros(4, 2, dtype=torch.int64), 4, 16, method="cub")


# ----------------------------------------------------------------------------- kernel
KERNEL_CASES = [
    # (T, K, N, E, top_k, per_token_rows, bias, topk_weights, skip_expert)
    pytest.param(1, 256, 384, 8, 2, True, False, False, None, id="single-token"),
    pytest.param(5, 300, 576, 6, 2, True, True, True, None, id="ragged-K300-N576"),
    pytest.param(3, 576, 300, 16, 4, False, False, True, None, id="experts>tokens-pair-rows"),
    pytest.param(40, 128, 256, 4, 2, True, True, False, 3, id="expert-with-zero-tokens-bm32"),
]


@needs_kernel
@pytest.mark.parametrize("gran", ["block", "row", "tensor"])
@pytest.mark.parametrize("t,k,n,e,top_k,per_token,use_bias,use_w,skip", KERNEL_CASES)
def test_kernel_matches_float64(gran, t, k, n, e, top_k, per_token, use_bias, use_w, skip):
    dev = KERNEL_DEVICE
    idx = _routing(t, e, top_k, skip_expert=skip).to(dev)
    x_q, x_s, w_q, w_s = _operands(t, k, n, e, top_k, gran, FP8, dev, per_token)
    bias = torch.randn(e, n).to(dev) if use_bias else None
    topk_w = torch.rand(t, top_k).to(dev) if use_w else None
    y = grouped_fp8_matmul(
        x_q, x_s, w_q, w_s, idx, torch.float32, per_token_rows=per_token, bias=bias, topk_weights=topk_w,
        backend="triton",
    )
    assert y.shape == (t * top_k, n) and y.dtype == torch.float32
    _assert_close64(y, _float64_reference(x_q, x_s, w_q, w_s, idx.cpu(), per_token, bias, topk_w))


@needs_kernel
@pytest.mark.parametrize("gran", ["block", "tensor"])
def test_kernel_e4m3fnuz(gran):
    dev = KERNEL_DEVICE
    if dev == "cuda" and torch.version.hip is None:
        pytest.skip("float8_e4m3fnuz GEMMs need an AMD MI300 (gfx94x) on real hardware")
    idx = _routing(5, 6, 2).to(dev)
    x_q, x_s, w_q, w_s = _operands(5, 300, 200, 6, 2, gran, FNUZ, dev)
    y = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.float32, backend="triton")
    _assert_close64(y, _float64_reference(x_q, x_s, w_q, w_s, idx.cpu(), True))


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_kernel_out_dtypes_match_reference_path(out_dtype):
    dev = KERNEL_DEVICE
    idx = _routing(6, 8, 2).to(dev)
    x_q, x_s, w_q, w_s = _operands(6, 256, 192, 8, 2, "row", FP8, dev)
    topk_w = torch.rand(6, 2).to(dev)
    y = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, out_dtype, topk_weights=topk_w, backend="triton")
    ref = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, out_dtype, topk_weights=topk_w, backend="reference")
    assert y.dtype == out_dtype
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.float().abs().max().item())


@needs_kernel
def test_kernel_sentinel_experts_give_zero_rows():
    dev = KERNEL_DEVICE
    idx = _routing(4, 6, 2)
    idx[1, 0] = 6  # == E: expert-parallel sentinel
    idx[2, 1] = -1
    idx = idx.to(dev)
    x_q, x_s, w_q, w_s = _operands(4, 128, 128, 6, 2, "block", FP8, dev)
    bias = torch.randn(6, 128).to(dev)
    y = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.float32, bias=bias, backend="triton")
    assert (y[2] == 0).all() and (y[5] == 0).all()
    _assert_close64(y, _float64_reference(x_q, x_s, w_q, w_s, idx.cpu(), True, bias))


@needs_kernel
def test_kernel_block_k_64_config():
    """BLOCK_K = 64: two K steps share one 128-wide scale group."""
    from fp8linear.ops.configs import GemmConfig

    dev = KERNEL_DEVICE
    idx = _routing(3, 4, 2).to(dev)
    x_q, x_s, w_q, w_s = _operands(3, 300, 96, 4, 2, "block", FP8, dev)
    r = gg.moe_align_block_size(idx, 4, 16)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=2)
    y = gg.grouped_fp8_gemm(
        x_q, x_s, w_q, w_s, r.sorted_pair_ids, r.block_expert, 6, 2, "block", torch.float32, config=cfg
    )
    _assert_close64(y, _float64_reference(x_q, x_s, w_q, w_s, idx.cpu(), True))
    with pytest.raises(ValueError, match="block_m"):
        gg.grouped_fp8_gemm(
            x_q, x_s, w_q, w_s, r.sorted_pair_ids, r.block_expert, 6, 2, "block", torch.float32,
            config=GemmConfig(block_m=32, block_n=32),
        )


@needs_kernel
def test_kernel_no_tokens():
    dev = KERNEL_DEVICE
    x_q, x_s, w_q, w_s = _operands(0, 256, 128, 4, 2, "block", FP8, dev)
    idx = torch.empty((0, 2), dtype=torch.int64, device=dev)
    y = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.bfloat16, backend="triton")
    assert y.shape == (0, 128)


# ----------------------------------------------------------------------------- reference path
@pytest.mark.parametrize("gran", ["block", "row", "tensor"])
def test_reference_path_matches_float64(gran):
    idx = _routing(5, 6, 2, skip_expert=2)
    x_q, x_s, w_q, w_s = _operands(5, 300, 200, 6, 2, gran, FP8, "cpu")
    bias, topk_w = torch.randn(6, 200), torch.rand(5, 2)
    y = grouped_fp8_matmul(
        x_q, x_s, w_q, w_s, idx, torch.float32, bias=bias, topk_weights=topk_w, backend="reference"
    )
    _assert_close64(y, _float64_reference(x_q, x_s, w_q, w_s, idx, True, bias, topk_w))


def test_grouped_matmul_validation():
    idx = _routing(3, 4, 2)
    x_q, x_s, w_q, w_s = _operands(3, 256, 128, 4, 2, "block", FP8, "cpu")
    call = lambda **kw: grouped_fp8_matmul(  # noqa: E731
        kw.get("x_q", x_q), kw.get("x_s", x_s), kw.get("w_q", w_q), kw.get("w_s", w_s), kw.get("idx", idx),
        kw.get("out_dtype", torch.float32), bias=kw.get("bias"), topk_weights=kw.get("topk_w"),
        per_token_rows=kw.get("per_token", True), backend="reference",
    )
    with pytest.raises(ValueError, match=r"a_q must have shape \(T, K\) = \(3, 256\), got \(3, 128\)"):
        call(x_q=x_q[:, :128], x_s=x_s[:, :1])
    with pytest.raises(ValueError, match=r"T \* top_k"):
        call(per_token=False)
    with pytest.raises(ValueError, match="matches no granularity"):
        call(w_s=w_s[:, :1, :1].expand(4, 1, 3).contiguous())
    with pytest.raises(TypeError, match="w_q must be float8"):
        call(w_q=w_q.float())
    with pytest.raises(ValueError, match="3-D"):
        call(w_q=w_q[0], w_s=w_s[0])
    with pytest.raises(TypeError, match="same FP8 dtype"):
        call(w_q=w_q.view(torch.uint8).view(FNUZ))
    with pytest.raises(ValueError, match=r"bias must have shape \(E, N\) = \(4, 128\)"):
        call(bias=torch.zeros(128))
    with pytest.raises(ValueError, match="topk_weights must have T \\* top_k = 6"):
        call(topk_w=torch.ones(3))
    with pytest.raises(TypeError, match="out_dtype"):
        call(out_dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k_index"):
        call(idx=idx.float())
    with pytest.raises(TypeError, match="float32"):
        call(x_s=x_s.double())


# ----------------------------------------------------------------------------- subprocess
@pytest.mark.skipif(KERNEL_DEVICE is not None, reason="kernel tests already run in this session")
@pytest.mark.skipif(gg is None, reason="Triton not installed")
def test_interpreter_subprocess():
    """Run this file's kernel tests under TRITON_INTERPRET=1 in a fresh interpreter (CPU CI)."""
    run_interpreter_subprocess(Path(__file__))


def run_interpreter_subprocess(path: Path, selector: str = "test_kernel_", timeout_s: int = 600) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", FP8LINEAR_BACKEND="auto")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), "-k", selector, "-m", "not gpu"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout[-6000:] + "\n" + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, f"interpreter run failed (rc={proc.returncode}):\n{tail}"
    print(f"[interpreter subprocess {time.perf_counter() - start:.1f}s] {tail.splitlines()[-1]}")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("gran", ["block", "row", "tensor"])
@pytest.mark.parametrize("t", [1, 16, 257, 2048])
def test_gpu_grouped_gemm_deepseek_dims(gran, t):
    """DeepSeek-V3-like expert dims (H=2048, I=1408, E=64, top-6) on the real compiler."""
    e, top_k, h, n = 64, 6, 2048, 2 * 1408
    torch.manual_seed(0)
    idx = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)]).cuda()
    x_q, x_s = quantize_activation(torch.randn(t, h, device="cuda"), fp8_dtype=None)
    w_q, w_s = quantize_weight(torch.randn(e, n, h, device="cuda") * 0.02, gran)
    y = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.float32, backend="triton")
    ref = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.float32, backend="reference")
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < 5e-4, rel  # Hopper FP8 accumulation (see RTOL); measured ~1.3e-4 on the core GEMM


def grouped_gemm_speed(
    tokens: tuple[int, ...] = (1, 4, 16, 64, 256, 2048),
    hidden: int = 2048,
    n: int = 2 * 1408,
    num_experts: int = 64,
    top_k: int = 6,
    iters: int = 50,
) -> list[dict[str, float]]:
    """Grouped FP8 GEMM vs torch BF16 grouped/looped matmul on the current GPU (prints a table)."""
    rows = []
    for t in tokens:
        idx = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(t)]).cuda()
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(num_experts, n, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        x_q, x_s = quantize_activation(x)
        w_q, w_s = quantize_weight(w, "block")
        fp8 = lambda: grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.bfloat16)  # noqa: E731
        flat = idx.reshape(-1)
        order = torch.argsort(flat)
        counts = torch.bincount(flat, minlength=num_experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x.repeat_interleave(top_k, 0)[order]
        if hasattr(torch, "_grouped_mm"):
            bf16 = lambda: torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)  # noqa: E731
        else:
            bf16 = lambda: torch.bmm(xs[:, None], w[flat[order]].transpose(1, 2))  # noqa: E731
        row = {"tokens": t, "fp8_us": _time_us(fp8, iters), "bf16_us": _time_us(bf16, iters)}
        row["speedup"] = row["bf16_us"] / row["fp8_us"]
        rows.append(row)
        print(f"T={t:5d}  fp8 {row['fp8_us']:8.1f} us  bf16 {row['bf16_us']:8.1f} us  speedup {row['speedup']:.2f}x")
    return rows


def _time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm device")
def test_gpu_grouped_gemm_speed_report():
    """Not a timed assertion: prints FP8 grouped GEMM vs BF16 times (run with -s)."""
    rows = grouped_gemm_speed(tokens=(1, 16, 64, 2048), iters=20)
    assert all(r["fp8_us"] > 0 for r in rows)


@pytest.mark.parametrize("pairs,experts,tile", [(6, 64, (16, 64)), (1024, 64, (16, 64)), (2048 * 6, 64, (64, 128)),
                                                (384 * 32, 32, (64, 128)), (2048 * 8, 32, (128, 128))])
def test_grouped_config_follows_rows_per_expert(pairs, experts, tile):
    from fp8linear.ops.router import grouped_config

    cfg = grouped_config(pairs, experts, 4096, 7168)
    assert (cfg.block_m, cfg.block_n) == tile


@needs_kernel
@pytest.mark.parametrize("experts,most_pairs", [(32, 2048), (64, 1024), (128, 512), (256, 256), (7, 16384)])
def test_alignment_runs_on_the_kernel_while_pairs_times_bins_stay_small(experts, most_pairs):
    """The one-program alignment kernel's work grows with pairs x histogram bins: past
    ALIGN_KERNEL_MAX_WORK the torch ops take over (the same result either way, tested above)."""
    from fp8linear.ops.router import align_on_kernel

    assert align_on_kernel(most_pairs, experts)
    assert not align_on_kernel(most_pairs + 1, experts)
    assert not align_on_kernel(0, experts)  # nothing to align: the torch path returns the empty layout


@needs_kernel
@pytest.mark.parametrize("k", [256, 300])  # whole K steps (no K mask on the loads); a ragged last one
def test_kernel_k_mask_same_bits(k, monkeypatch):
    """Where K is a multiple of the K step the grouped kernel loads operands without a K mask
    (EVEN_K): the same bits as with it, and the float64 bound."""
    from fp8linear.ops import grouped_gemm as gg

    dev = KERNEL_DEVICE
    idx = _routing(7, 6, 2).to(dev)
    x_q, x_s, w_q, w_s = _operands(7, k, 192, 6, 2, "block", FP8, dev)
    y = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.float32, backend="triton")
    monkeypatch.setattr(gg, "even_k", lambda k, block_k: False)
    y_masked = grouped_fp8_matmul(x_q, x_s, w_q, w_s, idx, torch.float32, backend="triton")
    assert torch.equal(y.view(torch.int32), y_masked.view(torch.int32))
    _assert_close64(y, _float64_reference(x_q, x_s, w_q, w_s, idx.cpu(), True))
