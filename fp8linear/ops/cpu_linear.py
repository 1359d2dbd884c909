"""Fast CPU forward of the FP8 linear in pure PyTorch (no compiled extension, no Triton).

Same numerics contract as :mod:`fp8linear.reference`: the activations are quantized per token in
1x128 groups to the same FP8 values and scales as ``quantize_activation_ref`` (bit-exact; the
FP8 cast itself is skipped, the GEMM reads the grid values as fp32), and the GEMM sums the same
quantized products in fp32, in another order and with the scales folded differently.

What makes it fast, without a BF16/fp32 copy of the weight:

* **Weight decode in tiles, with integer ops.** torch's FP8 -> float cast is scalar code on the
  CPU (~2 ns an element, 30x a BF16 GEMV). Instead each FP8 code, read as int8, is widened to
  int16 and moved into the bit layout of a float16 (sign to bit 15, exponent and mantissa to
  bits 13..7): four vectorised ops (int8 -> int16 copy, ``* 128``, ``& 0xBF80``, float16 -> fp32
  copy).
  That float16 is the FP8 value times 2^-8 (e4m3fn: exponent bias 7 against 15) or 2^-7
  (e4m3fnuz: bias 8), subnormals included; the power of two goes into the activation scales.
  Tiles of rows are decoded into buffers that stay in cache and are reused for every tile.
* **Scales folded where they cost least.** 'tensor': one scalar on the activations. 'block' with
  few rows of x: on the activations, once per 128-row block (a batched GEMM over the blocks).
  'row', and 'block' with many rows: one multiply over the decoded tile (row-expanded scales,
  N*K/128 floats, prepared once per weight).
* **One fp32 GEMM per tile** (MKL), with the bias added by ``addmm``/``baddbmm`` (after the
  GEMMs for M = 2..8, where the GEMM writes y rather than y.T).

The codes that are NaN (e4m3fn 0x7F/0xFF, e4m3fnuz 0x80) do not decode to NaN this way; the rows
holding one are found once per weight and their outputs set to NaN, as the reference gives.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..formats import GROUP_SIZE, activation_max, fp8_min_exponent
from ..reference import AMAX_FLOOR

__all__ = ["CpuFp8Weight", "prepare_cpu_weight", "quantize_activation_grid", "cpu_fp8_linear"]

# A decoded tile holds about this many weight elements per intra-op thread (rows = elements // K),
# so each core's share stays in its L2. M=1 (benchmarks/cpu_linear.py --tile-sweep), 1 thread:
# 2^17 fastest on 2048x7168 (5.9 ms; 2^16 7.8, 2^19 8.0), 7168x2048 (6.2 ms; 2^19 11.7), 576x1536
# (0.44 ms; 2^19 0.80); 2 threads: 2^18 in all (3.6 / 3.8 / 0.36 ms; 2^17 4.9 / 4.7 / 0.38).
TILE_ELEMS = 1 << 17
# Above XFOLD_MAX_M rows of x the GEMM dominates and MKL repacks x for every tile: bigger tiles.
# 2048x7168, 1 thread: M=512 351 ms at 2^17, 166 ms at 2^20; M=128 140 ms -> 63 ms.
TILE_ELEMS_LARGE_M = 1 << 20
# 'block' weights fold their scales into the activations (instead of the decoded tile) up to this M:
# per 128-row block that costs M*K multiplies against 128*K on the tile (a bound, not tuned).
XFOLD_MAX_M = 32
# Up to this M the GEMM writes y (M, N), not y.T (measured: 3-4x faster MKL calls at M=2..4).
M_MAJOR_MAX_M = 8

# int16 mask keeping bit 15 (sign) and bits 13..7 (FP8 exponent and mantissa): 0xBF80.
_MASK = -16512
# float16 value of a decoded code = FP8 value * 2**-shift (exponent bias 15 against 7 or 8).
_DECODE_SHIFT = {torch.float8_e4m3fn: 8, torch.float8_e4m3fnuz: 7}
_FP32_EXP = 0x7F800000
# Adding 1.5 * 2**(e + 20) to a float of exponent e rounds it to 3 mantissa bits (ties to even).
_ROUND_OFFSET = (20 << 23) | (1 << 22)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- activations
def quantize_activation_grid(x2d: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 quantization of `x2d` (M, K) -> (grid (M, G, 128) fp32, x_s (M, G) fp32).

    `grid` holds the FP8 values of ``quantize_activation_ref`` as fp32 (0 in the padding past K),
    `x_s` its scales, bit for bit. The reference rounds with explicit powers of two; here the
    rounding to 3 mantissa bits is one add and one subtract of c = 1.5 * 2**(e + 20), e the
    exponent of the value floored at the FP8 subnormal exponent: the float ulp of c is the FP8
    ulp at e, so the add rounds half to even at exactly that ulp and the subtract is exact.
    -0.0 comes out +0.0, NaN stays NaN.
    """
    m, k = x2d.shape
    groups = _cdiv(k, GROUP_SIZE)
    if groups * GROUP_SIZE != k:  # zero padding (F.pad costs ~40 us a call here)
        xf = torch.zeros(m, groups * GROUP_SIZE, dtype=torch.float32)
        xf[:, :k] = x2d
    else:
        xf = x2d.float()
    xg = xf.reshape(m, groups, GROUP_SIZE)
    qmax = activation_max(fp8_dtype)
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp_(min=AMAX_FLOOR)
    scale = amax / torch.full_like(amax, qmax)  # a tensor divisor, as the reference
    q = (xg / scale).clamp_(-qmax, qmax)
    emin_bits = (127 + fp8_min_exponent(fp8_dtype)) << 23
    c = (q.view(torch.int32) & _FP32_EXP).clamp_(min=emin_bits).add_(_ROUND_OFFSET).view(torch.float32)
    q.add_(c).sub_(c)
    return q, scale.squeeze(-1)


# ----------------------------------------------------------------------------- weights
def _weight_key(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> tuple:
    return (weight.data_ptr(), weight._version, weight.shape, weight.stride(), weight.dtype,
            weight_scale_inv.data_ptr(), weight_scale_inv._version, weight_scale_inv.shape)


class CpuFp8Weight:
    """What :func:`cpu_fp8_linear` precomputes per weight: no copy of the weight, N*K/128 floats at most.

    - ``codes``: the weight viewed as int8 (a view, not a copy)
    - ``row_scale``: (N, G, 1) fp32 per-row scales ('row'; 'block' expanded over its 128 rows)
    - ``block_scale``: (N/128, 1, G, 1) fp32 ('block' only), ``tensor_scale``: 0-d ('tensor' only)
    - ``nan_rows``: indices of the rows holding a NaN code, or None
    - ``x_factor``: 2**8 (e4m3fn) or 2**7 (e4m3fnuz), taken by the activation scales
    """

    __slots__ = ("granularity", "n", "k", "groups", "fp8_dtype", "codes", "row_scale", "block_scale",
                 "tensor_scale", "nan_rows", "x_factor", "key", "__weakref__")

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str):
        n, k = weight.shape
        self.granularity, self.n, self.k = granularity, n, k
        self.groups = _cdiv(k, GROUP_SIZE)
        self.fp8_dtype = weight.dtype
        self.key = _weight_key(weight, weight_scale_inv)
        self.codes = weight.view(torch.int8)
        self.x_factor = float(2 ** _DECODE_SHIFT[weight.dtype])
        s = weight_scale_inv.float()
        self.row_scale = self.block_scale = self.tensor_scale = None
        if granularity == "tensor":
            self.tensor_scale = s.reshape(())
        else:
            if granularity == "block":
                self.block_scale = s.reshape(-1, 1, self.groups, 1).contiguous()
                s = s.repeat_interleave(GROUP_SIZE, dim=0)[:n]
            self.row_scale = s.reshape(n, self.groups, 1).contiguous()
        codes = weight.view(torch.uint8)
        bad = (codes & 0x7F) == 0x7F if weight.dtype == torch.float8_e4m3fn else codes == 0x80
        rows = bad.any(dim=1).nonzero().flatten()
        self.nan_rows = rows if rows.numel() else None


def prepare_cpu_weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str) -> CpuFp8Weight:
    """Precompute what :func:`cpu_fp8_linear` needs per weight (one pass over the weight's bytes)."""
    return CpuFp8Weight(weight, weight_scale_inv, granularity)


# Weights prepared on the fly (no `prepared` given): id(weight) -> (weak reference, prepared), the
# entry dropped with the tensor and checked against its data pointer and version counter, so
# in-place loads re-prepare. (Tensors compare elementwise, so they cannot key a WeakKeyDictionary.)
_PREPARED: dict[int, tuple[weakref.ref, CpuFp8Weight]] = {}


def _prepared_for(weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str) -> CpuFp8Weight:
    key = id(weight)
    entry = _PREPARED.get(key)
    if entry is not None:
        ref, p = entry
        if ref() is weight and p.granularity == granularity and p.key == _weight_key(weight, weight_scale_inv):
            return p
    p = CpuFp8Weight(weight, weight_scale_inv, granularity)
    _PREPARED[key] = (weakref.ref(weight, lambda _, key=key: _PREPARED.pop(key, None)), p)
    return p


# ----------------------------------------------------------------------------- forward
def _decode(p: CpuFp8Weight, n0: int, n1: int, h: torch.Tensor, f: torch.Tensor) -> None:
    """Weight rows [n0, n1) -> `f` (rows, Kp) fp32 = FP8 value * 2**-shift; `h` int16 scratch (0 past K)."""
    hk = h[:, : p.k] if h.shape[1] != p.k else h
    hk.copy_(p.codes[n0:n1])  # int8 -> int16 sign-extends
    h.mul_(128)  # code at bits 14..7, sign at 15 (and 14); bitwise_left_shift has no vectorised int16 path
    h.bitwise_and_(_MASK)  # bit 14 cleared: a float16
    f.copy_(h.view(torch.float16))


def _tile_rows(n: int, kp: int, xfold: bool, m: int) -> int:
    elems = TILE_ELEMS * torch.get_num_threads() if m <= XFOLD_MAX_M else TILE_ELEMS_LARGE_M
    rows = max(1, elems // kp)
    if not xfold:
        return min(rows, n)
    if rows >= GROUP_SIZE:  # whole 128-row blocks, a batched GEMM over them
        return min(rows // GROUP_SIZE * GROUP_SIZE, _cdiv(n, GROUP_SIZE) * GROUP_SIZE)
    return min(1 << (rows.bit_length() - 1), n)  # a power of two: tiles never straddle a block


def cpu_fp8_linear(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    granularity: str,
    bias: torch.Tensor | None = None,
    prepared: CpuFp8Weight | None = None,
) -> torch.Tensor:
    """y = dequant(quantize(x2d)) @ dequant(weight).T (+ bias) on the CPU; (M, N) in x2d.dtype.

    x2d: (M, K) bf16/fp16/fp32; weight: FP8 (N, K); weight_scale_inv: fp32 at `granularity`
    ('block', 'row' or 'tensor'); inputs are assumed validated. `prepared`: the weight's
    :func:`prepare_cpu_weight`, else one is made and kept per weight tensor (weakly).
    """
    p = prepared if prepared is not None else _prepared_for(weight, weight_scale_inv, granularity)
    m = x2d.shape[0]
    n, k, groups = p.n, p.k, p.groups
    kp = groups * GROUP_SIZE
    grid, x_s = quantize_activation_grid(x2d, p.fp8_dtype)
    s = x_s * p.x_factor  # exact: a power of two
    if p.tensor_scale is not None:
        s = s * p.tensor_scale
    xd = grid.mul_(s.unsqueeze(-1))  # (M, G, 128) dequantized activations (times x_factor)
    xfold = p.block_scale is not None and m <= XFOLD_MAX_M
    # Up to a few rows of x: y (M, N) = x @ tile.T runs 3-4x faster in MKL than y.T = tile @ x.T
    # (at M=1 too for the batched GEMM over blocks: 13 us against 41 us for 3 blocks of 128x640).
    m_major = m <= M_MAJOR_MAX_M
    rows = _tile_rows(n, kp, xfold, m)
    h = torch.empty(rows, kp, dtype=torch.int16)
    if kp != k:
        h[:, k:].zero_()
    f = torch.empty(rows, kp, dtype=torch.float32)
    bias_f = bias.float() if bias is not None else None
    n_pad = _cdiv(n, GROUP_SIZE) * GROUP_SIZE if xfold and rows >= GROUP_SIZE else n
    # outputs: y_t (N, M) ("N-major"), or y_m (M, N) with the bias added at the end
    y_out = torch.empty((m, n_pad) if m_major else (n_pad, m), dtype=torch.float32)
    if xfold and rows >= GROUP_SIZE:
        if bias_f is not None and n_pad != n:
            bias_f = F.pad(bias_f, (0, n_pad - n))
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            r = n1 - n0
            blocks = _cdiv(r, GROUP_SIZE)
            if r != blocks * GROUP_SIZE:
                f[r:].zero_()  # rows past N: their outputs are dropped, keep them finite
            _decode(p, n0, n1, h[:r], f[:r])
            b0 = n0 // GROUP_SIZE
            a = (xd.unsqueeze(0) * p.block_scale[b0:b0 + blocks]).view(blocks, m, kp)
            fb = f[: blocks * GROUP_SIZE].view(blocks, GROUP_SIZE, kp)
            if m == 1:
                torch.bmm(a, fb.transpose(1, 2), out=y_out.view(-1, 1, GROUP_SIZE)[b0:b0 + blocks])
                continue
            if m_major:
                out = torch.bmm(a, fb.transpose(1, 2))  # (blocks, M, 128)
                y_out.view(m, n_pad // GROUP_SIZE, GROUP_SIZE)[:, b0:b0 + blocks].copy_(out.transpose(0, 1))
                continue
            out = y_out[n0:n0 + blocks * GROUP_SIZE].view(blocks, GROUP_SIZE, m)
            if bias_f is None:
                torch.bmm(fb, a.transpose(1, 2), out=out)
            else:
                bcol = bias_f[n0:n0 + blocks * GROUP_SIZE].view(blocks, GROUP_SIZE, 1)
                torch.baddbmm(bcol, fb, a.transpose(1, 2), out=out)
    else:
        xd2 = xd.view(m, kp)
        block = -1
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            r = n1 - n0
            fr = f[:r]
            _decode(p, n0, n1, h[:r], fr)
            if xfold:  # a power-of-two tile inside one 128-row block: its scales on the activations
                if n0 // GROUP_SIZE != block:
                    block = n0 // GROUP_SIZE
                    xd2 = (xd * p.block_scale[block]).view(m, kp)
            elif p.row_scale is not None:
                fr.view(r, groups, GROUP_SIZE).mul_(p.row_scale[n0:n1])
            if m_major:
                torch.mm(xd2, fr.t(), out=y_out[:, n0:n1])
            elif bias_f is None:
                torch.mm(fr, xd2.t(), out=y_out[n0:n1])
            else:
                torch.addmm(bias_f[n0:n1].view(r, 1), fr, xd2.t(), out=y_out[n0:n1])
    if m_major:
        y_m = y_out[:, :n]
        if bias_f is not None:
            y_m += bias_f[:n]
        if p.nan_rows is not None:
            y_m[:, p.nan_rows] = float("nan")
        if x2d.dtype == torch.float32 and n_pad == n:
            return y_m
        y = torch.empty(m, n, dtype=x2d.dtype)
        y.copy_(y_m)
        return y
    y_t = y_out[:n]
    if p.nan_rows is not None:
        y_t[p.nan_rows] = float("nan")
    if m == 1 and x2d.dtype == torch.float32:
        return y_t.reshape(1, n)
    y = torch.empty(m, n, dtype=x2d.dtype)
    y.copy_(y_t.t())
    return y
