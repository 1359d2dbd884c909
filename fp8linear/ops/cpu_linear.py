"""Fast CPU forward of the FP8 linear: torch ops, and a compiled kernel at decode sizes.

Where the router sends a call to the compiled kernels (:func:`fp8linear.ops.router.use_cpu_native`:
up to ``CPU_NATIVE_MAX_M`` rows of x) and the system C compiler and the CPU allow them,
:mod:`fp8linear.ops.cpu_native` runs it in one pass over the FP8 weight (decoded in registers);
everything below describes the torch-ops path, which runs all other calls, and those where the
kernel is not available.

Same numerics contract as :mod:`fp8linear.reference`: the activations are quantized per token in
1x128 groups to the same FP8 values and scales as ``quantize_activation_ref`` (bit-exact; the
FP8 cast itself is skipped, the GEMM reads the grid values as fp32), and the GEMM sums the same
quantized products in fp32, in another order and with the scales folded differently. One
exception, for speed, where the compiled kernel is not available: a single row of bf16 x with
'block' or 'tensor' scales (decode at batch 1; :func:`fp8linear.ops.router.use_cpu_half_gemv`)
runs float16 tiles through torch's float16 GEMV, which sums in fp32 but rounds the scaled
activations and each output to float16 (11 significant bits) before the bf16 output (8 bits).

What makes it fast, without a BF16/fp32 copy of the weight:

* **Weight decode in tiles, with integer ops.** torch's FP8 -> float cast is scalar code on the
  CPU (~2-4 ns an element, 30x a BF16 GEMV). Instead each FP8 code, read as int8, is widened to
  int16 and moved into the bit layout of a float16 (sign to bit 15, exponent and mantissa to
  bits 13..7): three vectorised ops (int8 -> int16 copy, ``* 128``, ``& 0xBF80``), then a
  float16 -> fp32 copy, except on the float16 GEMV path, which reads the float16 tile itself.
  That float16 is the FP8 value times 2^-8 (e4m3fn: exponent bias 7 against 15) or 2^-7
  (e4m3fnuz: bias 8), subnormals included; the power of two goes into the activation scales.
  Tiles of rows are decoded into buffers that stay in cache, kept per thread between calls.
* **Tiles that follow the intra-op threads.** An elementwise op gives each thread a contiguous
  run of the tile's rows; the GEMMs read the rows that the same core decoded: float16 tiles of
  several 128-row blocks are decoded interleaved (each block's GEMV splits its rows as the
  decode split the tile), and the fp32 path's tiles of blocks come in multiples of the thread
  count.
* **Scales folded where they cost least.** 'tensor': one scalar on the activations. 'block' with
  few rows of x: on the activations, once per 128-row block (a batched GEMM over the blocks, or
  a GEMV per block on the float16 path). 'row', and 'block' with many rows: one multiply over
  the decoded tile (row-expanded scales, N*K/128 floats, prepared once per weight).
* **One fp32 GEMM per tile** (MKL), with the bias added by ``addmm``/``baddbmm`` (after the
  GEMMs for M = 1..8, where the GEMM writes y rather than y.T).

The codes that are NaN (e4m3fn 0x7F/0xFF, e4m3fnuz 0x80) do not decode to NaN this way; the rows
holding one are found once per weight and their outputs set to NaN, as the reference gives.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..formats import GROUP_SIZE, activation_max, fp8_min_exponent
from ..reference import AMAX_FLOOR
from . import cpu_native, router

__all__ = ["CpuFp8Weight", "prepare_cpu_weight", "prepared_in", "quantize_activation_grid", "cpu_fp8_linear",
           "native_linear_plan"]

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
# 'block' up to XFOLD_MAX_M: the scaled activations of all 128-row blocks are made at once up to this
# many floats (else per tile).
A_ALL_MAX = 1 << 18
# Elements per intra-op thread of a float16 tile: whole 128-row blocks (one at least where this
# budget holds half a block), else a power of two. M=1, 2 threads, ms (rows per tile): 7168x2048
# 2.42 (128), 2.32 (256), 2.29 (512), 2.77 (1024); 2048x2048 0.76 (128), 0.72 (256), 0.77 (512);
# 576x1536 0.230 (128), 0.234 (256), 0.239 (512); 1536x576 0.302 (128), 0.258 (256), 0.244 (512),
# 0.245 (768), 0.290 (1024); 2048x7168 2.13 (128), 2.33 (64).
HALF_TILE_ELEMS = 1 << 18

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
_I32_EXP = torch.tensor(_FP32_EXP, dtype=torch.int32)
_I32_ROUND = torch.tensor(_ROUND_OFFSET, dtype=torch.int32)
_QMAX: dict[torch.dtype, torch.Tensor] = {}


def _qmax_tensor(fp8_dtype: torch.dtype, qmax: float) -> torch.Tensor:
    t = _QMAX.get(fp8_dtype)
    if t is None:
        t = _QMAX[fp8_dtype] = torch.tensor(qmax, dtype=torch.float32)
    return t


def quantize_activation_grid(
    x2d: torch.Tensor, fp8_dtype: torch.dtype, pad_buf: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 quantization of `x2d` (M, K) -> (grid (M, G, 128) fp32, x_s (M, G) fp32).

    `grid` holds the FP8 values of ``quantize_activation_ref`` as fp32 (0 in the padding past K),
    `x_s` its scales, bit for bit. The reference rounds with explicit powers of two; here the
    rounding to 3 mantissa bits is one add and one subtract of c = 1.5 * 2**(e + 20), e the
    exponent of the value floored at the FP8 subnormal exponent: the float ulp of c is the FP8
    ulp at e, so the add rounds half to even at exactly that ulp and the subtract is exact.
    -0.0 comes out +0.0, NaN stays NaN. `pad_buf`: optional (M, Kp) fp32 zeros past K, used for the
    padded copy of x when K is not a multiple of 128 (its first K columns are overwritten).
    """
    m, k = x2d.shape
    groups = _cdiv(k, GROUP_SIZE)
    if groups * GROUP_SIZE != k:  # zero padding (F.pad costs ~40 us a call here)
        xf = torch.zeros(m, groups * GROUP_SIZE, dtype=torch.float32) if pad_buf is None else pad_buf
        xf[:, :k] = x2d
    else:
        xf = x2d.float()
    xg = xf.reshape(m, groups, GROUP_SIZE)
    qmax = activation_max(fp8_dtype)
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp_(min=AMAX_FLOOR)
    scale = amax / _qmax_tensor(fp8_dtype, qmax)  # a tensor divisor, as the reference (true division)
    q = (xg / scale).clamp_(-qmax, qmax)
    emin_bits = (127 + fp8_min_exponent(fp8_dtype)) << 23
    # 0-d int32 operands: a Python int would be wrapped into a new tensor on every call
    c = torch.bitwise_and(q.view(torch.int32), _I32_EXP).clamp_(min=emin_bits).add_(_I32_ROUND).view(torch.float32)
    q.add_(c).sub_(c)
    return q, scale.squeeze(-1)


# ----------------------------------------------------------------------------- weights
def _weight_key(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> tuple:
    return (weight.data_ptr(), weight._version, weight.shape, weight.stride(), weight.dtype,
            weight_scale_inv.data_ptr(), weight_scale_inv._version, weight_scale_inv.shape)


_ONE = torch.ones(1, dtype=torch.float32)  # the compiled kernel's weight scale for 'tensor' weights (their scale is on x)


class CpuFp8Weight:
    """What :func:`cpu_fp8_linear` precomputes per weight: no copy of the weight, N*K/128 floats at most.

    - ``codes``: the weight viewed as int8 (a view, not a copy)
    - ``row_scale``: (N, G, 1) fp32 per-row scales ('row'; 'block' expanded over its 128 rows)
    - ``block_scale``: (N/128, 1, G, 1) fp32 ('block' only), ``tensor_scale``: 0-d ('tensor' only)
    - ``nan_rows``: indices of the rows holding a NaN code, or None
    - ``x_factor``: 2**8 (e4m3fn) or 2**7 (e4m3fnuz), taken by the activation scales
    - ``act_scale`` (0-d: x_factor, times the tensor scale), ``block_scale_x`` (block
      scales * x_factor as (N/128, 1, G), 'block' only): what the activation scales are multiplied by
    """

    __slots__ = ("granularity", "n", "k", "groups", "fp8_dtype", "codes", "row_scale", "block_scale",
                 "tensor_scale", "nan_rows", "x_factor", "act_scale", "block_scale_x", "tiles", "key", "native_scales",
                 "__weakref__")

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
        # what the activations' scales are multiplied by: 2**shift ('row', 'block' above XFOLD_MAX_M),
        # times the tensor scale ('tensor'); 'block' up to XFOLD_MAX_M: 2**shift * each block's scales
        self.act_scale = torch.tensor(self.x_factor)
        if self.tensor_scale is not None:
            self.act_scale = self.act_scale * self.tensor_scale
        self.block_scale_x = self.block_scale.view(-1, 1, self.groups) * self.x_factor if granularity == "block" else None
        # the compiled kernel's scale arguments: (activation scale factor, weight scales, row stride,
        # group stride, rows per scale row), see fp8linear.ops.cpu_native.native_gemv
        if granularity == "tensor":
            self.native_scales = (float(self.act_scale), _ONE, 0, 0, 1)
        else:
            ws = self.block_scale if granularity == "block" else self.row_scale
            self.native_scales = (float(self.act_scale), ws, self.groups, 1, GROUP_SIZE if granularity == "block" else 1)
        self.tiles: dict = {}  # tile rows (or ("half", rows)) -> the tiles, see _tiles and _half_tiles
        codes = weight.view(torch.uint8)
        bad = (codes & 0x7F) == 0x7F if weight.dtype == torch.float8_e4m3fn else codes == 0x80
        rows = bad.any(dim=1).nonzero().flatten()
        self.nan_rows = rows if rows.numel() else None


def prepare_cpu_weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str) -> CpuFp8Weight:
    """Precompute what :func:`cpu_fp8_linear` needs per weight (one pass over the weight's bytes)."""
    return CpuFp8Weight(weight, weight_scale_inv, granularity)


def prepared_in(cache: dict, key: object, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                granularity: str) -> CpuFp8Weight:
    """The :func:`prepare_cpu_weight` of this weight kept in `cache` under `key` (a caller's own
    dict, e.g. one per MoE layer for its experts' weight views), prepared again where the weight's
    data pointer, version counter, shape or scales changed."""
    p = cache.get(key)
    if not _current(p, weight, weight_scale_inv, granularity):
        p = cache[key] = CpuFp8Weight(weight, weight_scale_inv, granularity)
    return p


def _current(p: CpuFp8Weight | None, weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str) -> bool:
    """Whether `p` is the preparation of this weight as it is now (same data, version, shape, scales)."""
    return p is not None and p.granularity == granularity and p.key == _weight_key(weight, weight_scale_inv)


# Weights prepared on the fly (no `prepared` given): id(weight) -> (weak reference, prepared), the
# entry dropped with the tensor and checked against its data pointer and version counter, so
# in-place loads re-prepare. (Tensors compare elementwise, so they cannot key a WeakKeyDictionary.)
_PREPARED: dict[int, tuple[weakref.ref, CpuFp8Weight]] = {}


def _prepared_for(weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str) -> CpuFp8Weight:
    key = id(weight)
    entry = _PREPARED.get(key)
    if entry is not None:
        ref, p = entry
        if ref() is weight and _current(p, weight, weight_scale_inv, granularity):
            return p
    p = CpuFp8Weight(weight, weight_scale_inv, granularity)
    _PREPARED[key] = (weakref.ref(weight, lambda _, key=key: _PREPARED.pop(key, None)), p)
    return p


# ----------------------------------------------------------------------------- forward
# x, output and bias dtypes the one-call compiled linear reads and writes itself (another bias dtype is
# converted to fp32 first).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 0-d int16 operands of the decode (a Python scalar is wrapped into a new tensor on every call).
_I16_128 = torch.tensor(128, dtype=torch.int16)
_I16_MASK = torch.tensor(_MASK, dtype=torch.int16)


def _decode_bits(codes: torch.Tensor, h: torch.Tensor) -> None:
    """int8 codes (r, K) -> `h` (r, Kp) int16 holding float16 bits of FP8 value * 2**-shift (0 past K)."""
    hk = h[:, : codes.shape[1]] if h.shape[1] != codes.shape[1] else h
    hk.copy_(codes)  # int8 -> int16 sign-extends
    h.mul_(_I16_128)  # code at bits 14..7, sign at 15 (and 14); bitwise_left_shift has no vectorised int16 path
    h.bitwise_and_(_I16_MASK)  # bit 14 cleared: a float16


def _decode(p: CpuFp8Weight, n0: int, n1: int, h: torch.Tensor, f: torch.Tensor) -> None:
    """Weight rows [n0, n1) -> `f` (rows, Kp) fp32 = FP8 value * 2**-shift; `h` int16 scratch (0 past K)."""
    _decode_bits(p.codes[n0:n1], h)
    f.copy_(h.view(torch.float16))


# Scratch buffers reused across calls (per thread: calls from several threads never share one), made
# as zeros. The int16 columns past K stay zero through the decode; rows of a float32 tile past N
# (the last tile of the batched GEMM) keep whatever a previous call decoded there: finite values
# whose outputs are dropped.
_SCRATCH = threading.local()
# Per thread and use, buffers are kept up to this many bytes (the least recently used dropped first):
# a model's layers need several tile shapes (SmolLM2 decode: 8, prefill: more), and a buffer made
# again costs a pass over its bytes (zeros) each call: 10% of a SmolLM2 decode step at 6 entries.
MAX_SCRATCH_BYTES = 48 << 20
# the padded copy of x (K not a multiple of 128) uses a kept buffer up to this M
PAD_SCRATCH_MAX_M = 64


def _scratch(rows: int, cols: int, dtype: torch.dtype, use: str = "tile", k: int | None = None) -> torch.Tensor:
    """A zero-initialised (rows, cols) buffer kept for this thread (per `use`: 'tile' or 'x').

    `k`: for a buffer whose columns past k must stay zero (callers write only [:, :k]): one buffer
    per k, so that a call with a larger k and the same width leaves nothing there."""
    cache = getattr(_SCRATCH, use, None)
    if cache is None:
        cache = {}
        setattr(_SCRATCH, use, cache)
    key = (rows, cols, dtype, k)
    buf = cache.pop(key, None)  # re-inserted below: the dict's order is the order of use
    if buf is None:
        kept = sum(t.numel() * t.element_size() for t in cache.values())
        need = rows * cols * dtype.itemsize
        while cache and kept + need > MAX_SCRATCH_BYTES:
            old = cache.pop(next(iter(cache)))
            kept -= old.numel() * old.element_size()
        with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
            buf = torch.zeros(rows, cols, dtype=dtype)
    cache[key] = buf
    return buf


def _tile_rows(n: int, kp: int, xfold: bool, m: int) -> int:
    elems = TILE_ELEMS * torch.get_num_threads() if m <= XFOLD_MAX_M else TILE_ELEMS_LARGE_M
    rows = max(1, elems // kp)
    if n * kp <= elems * 3 // 2:  # up to 1.5 tiles: one (fewer ops; measured on 576x576 at M=2)
        rows = n if not xfold else _cdiv(n, GROUP_SIZE) * GROUP_SIZE
    if not xfold:
        return min(rows, n)
    if rows >= GROUP_SIZE:  # whole 128-row blocks, a batched GEMM over them
        blocks, threads, n_blocks = rows / GROUP_SIZE, torch.get_num_threads(), _cdiv(n, GROUP_SIZE)
        if blocks >= n_blocks:  # one tile
            return n_blocks * GROUP_SIZE
        # a multiple of the thread count where it comes to one at least (rounded to the nearest): each
        # thread's share of the elementwise decode is then whole blocks of the batched GEMM's share.
        # 1536x576, M=2, 2 threads: 197 us at 4 blocks, 229 at 2, 271 at 3 (the budget's 3.55).
        blocks = max(threads, round(blocks / threads) * threads) if blocks >= threads else int(blocks)
        return min(blocks, n_blocks) * GROUP_SIZE
    return min(1 << (rows.bit_length() - 1), n)  # a power of two: tiles never straddle a block


def _tiles(p: CpuFp8Weight, rows: int) -> list[tuple[int, int, torch.Tensor]]:
    """(n0, n1, codes[n0:n1]) per tile of `rows` rows, made once per weight and tile size."""
    plan = p.tiles.get(rows)
    if plan is None:
        if len(p.tiles) >= 4:
            p.tiles.clear()
        plan = p.tiles[rows] = [(n0, min(p.n, n0 + rows), p.codes[n0:n0 + rows]) for n0 in range(0, p.n, rows)]
    return plan


def _half_gemv_rows(n: int, k: int) -> int:
    """Rows of a float16 tile: whole 128-row blocks, as many in every tile (the weight's whole blocks
    split into the fewest tiles within the budget), else a power of two."""
    rows = max(1, HALF_TILE_ELEMS * torch.get_num_threads() // k)
    if rows >= GROUP_SIZE // 2 and n >= GROUP_SIZE:
        blocks = n // GROUP_SIZE
        return _cdiv(blocks, _cdiv(blocks, max(1, rows // GROUP_SIZE))) * GROUP_SIZE
    return min(GROUP_SIZE, 1 << (rows.bit_length() - 1))


def _half_tiles(p: CpuFp8Weight, rows: int) -> list[tuple[int, int, torch.Tensor, int]]:
    """(n0, n1, codes, nb) per float16 tile, made once per weight and tile size. A tile of nb >= 2
    whole blocks comes as its codes viewed (128, nb, K), to be decoded interleaved (row i of block b
    at row i * nb + b): each intra-op thread's share of the elementwise decode (a contiguous run of
    rows) is then the share that it takes of every block's GEMV (split by rows), so the GEMVs read
    what the same core decoded. Other tiles: codes[n0:n1], nb = 0."""
    key = ("half", rows)
    plan = p.tiles.get(key)
    if plan is None:
        if len(p.tiles) >= 4:
            p.tiles.clear()
        plan = []
        for n0 in range(0, p.n, rows):
            n1 = min(p.n, n0 + rows)
            codes, nb = p.codes[n0:n1], (n1 - n0) // GROUP_SIZE
            if nb >= 2 and (n1 - n0) % GROUP_SIZE == 0:
                plan.append((n0, n1, codes.unflatten(0, (nb, GROUP_SIZE)).transpose(0, 1), nb))
            else:
                plan.append((n0, n1, codes, 0))
        p.tiles[key] = plan
    return plan


def _half_gemv(p: CpuFp8Weight, grid: torch.Tensor, x_s: torch.Tensor, bias_f: torch.Tensor | None):
    """M=1 with bf16 output, 'block' or 'tensor' scales: y (1, N) bf16, or None where it does not apply.

    The scaled activations (one row per 128-row block) times a power of two 2**-e go to float16,
    the tile stays float16 (no float32 copy), and torch's float16 GEMV accumulates in fp32 and
    rounds each output to float16 (11 bits), then * 2**e (+ bias) in fp32 -> bf16. e puts the
    largest activation in [2**-1, 1) / 2**max(0, log2(Kp) - 14), so no product or output overflows.
    """
    kp, k = grid.shape[1] * GROUP_SIZE, p.k
    # the scales of the activations: (NB, 1, G) per 128-row block ('block'), else (1, G)
    sc = x_s * (p.block_scale_x if p.block_scale is not None else p.act_scale)
    # the largest |grid * sc| from each group's largest |grid| (rounding is monotonic: the same value)
    amax = (grid.abs().amax(dim=-1) * sc.abs()).amax().item()
    if not math.isfinite(amax):
        return None  # NaN/Inf rows: the fp32 path gives the reference's NaNs
    e = math.frexp(amax)[1] + max(0, (kp - 1).bit_length() - 14)
    if abs(e) > 100:  # 2**e or 2**-e would leave fp32's normal range
        return None
    # one row per block: grid * (sc * 2**-e) in fp32, rounded to float16 (K columns used, Kp made)
    a16p = torch.empty(sc.numel() // sc.shape[-1], kp, dtype=torch.float16)
    torch.mul(grid, (sc * 2.0 ** -e).unsqueeze(-1), out=a16p.view(*sc.shape, GROUP_SIZE))
    a16 = a16p[:, :k] if k != kp else a16p
    n = p.n
    rows = _half_gemv_rows(n, k)
    h = _scratch(rows, k, torch.int16)
    hv = h.view(torch.float16)
    hv_t = hv.t()
    y16 = torch.empty(1, n, dtype=torch.float16)
    if p.block_scale is None:  # 'tensor': one activation row for every tile
        for n0, n1, codes in _tiles(p, rows):
            r = n1 - n0
            _decode_bits(codes, h if r == rows else h[:r])
            torch.mm(a16, hv_t if r == rows else hv_t[:, :r], out=y16[:, n0:n1])
    else:  # 'block': one GEMV per 128-row block (or per tile inside one) with that block's row
        a_rows = a16.unsqueeze(1).unbind(0)  # (1, K) each
        views: dict[int, tuple] = {}  # blocks in a tile -> (h as (128, blocks, K), each block's rows .t())
        for n0, n1, codes, nb in _half_tiles(p, rows):
            r = n1 - n0
            if nb:  # interleaved: row i of the tile's block b at row i * nb + b (`codes` is (128, nb, K))
                v = views.get(nb)
                if v is None:
                    hb = h[:r]
                    v = views[nb] = (hb.view(GROUP_SIZE, nb, k), [hb.view(torch.float16)[b::nb].t() for b in range(nb)])
                v[0].copy_(codes)  # int8 -> int16, then the two bit ops of _decode_bits
                hb = h[:r]
                hb.mul_(_I16_128)
                hb.bitwise_and_(_I16_MASK)
                b0 = n0 // GROUP_SIZE
                for b, w_t in enumerate(v[1]):
                    j = n0 + b * GROUP_SIZE
                    torch.mm(a_rows[b0 + b], w_t, out=y16[:, j:j + GROUP_SIZE])
                continue
            _decode_bits(codes, h if r == rows else h[:r])
            if r == rows and rows <= GROUP_SIZE:  # one block, or a tile inside one
                torch.mm(a_rows[n0 // GROUP_SIZE], hv_t, out=y16[:, n0:n1])
                continue
            for j in range(0, r, GROUP_SIZE):  # a last tile's blocks
                j1 = min(r, j + GROUP_SIZE)
                torch.mm(a_rows[(n0 + j) // GROUP_SIZE], hv_t[:, j:j1], out=y16[:, n0 + j:n0 + j1])
    y = torch.empty(1, n, dtype=torch.bfloat16)
    y32 = y16.float()
    if bias_f is None:
        torch.mul(y32, 2.0 ** e, out=y)
    else:
        torch.add(bias_f, y32, alpha=2.0 ** e, out=y)
    if p.nan_rows is not None:
        y[:, p.nan_rows] = float("nan")
    return y


def _m_major_output(y_m: torch.Tensor, bias_f: torch.Tensor | None, dtype: torch.dtype,
                    p: CpuFp8Weight) -> torch.Tensor:
    """y (M, N) in `dtype` from the fp32 sums y_m (M, N): the bias added in fp32 and rounded once,
    NaN in the outputs of weight rows holding a NaN code."""
    if dtype == torch.float32 and y_m.is_contiguous():
        if bias_f is not None:
            y_m += bias_f
    else:
        y = torch.empty(y_m.shape, dtype=dtype)
        if bias_f is None:
            y.copy_(y_m)
        else:  # in fp32, rounded once to x's dtype
            torch.add(y_m, bias_f, out=y)
        y_m = y
    if p.nan_rows is not None:
        y_m[:, p.nan_rows] = float("nan")
    return y_m


def native_linear_plan(weight: torch.Tensor, weight_scale_inv: torch.Tensor, granularity: str,
                       bias: torch.Tensor | None, m: int, x_dtype: torch.dtype) -> Callable | None:
    """:func:`cpu_fp8_linear`'s one-call compiled path prepared for contiguous x of `m` rows and
    `x_dtype` (validated inputs): ``plan(x, out_shape)`` returns y in x's dtype, the bits
    cpu_fp8_linear gives, with the C call's arguments made once; or None when the weight, its scales
    or the bias changed in place or the intra-op thread count changed since (then call
    cpu_fp8_linear, and make a new plan). None where that path does not run this call."""
    if not router.use_cpu_native(m) or x_dtype not in _NATIVE_DTYPES or cpu_native.native_kernel() is None:
        return None
    p = _prepared_for(weight, weight_scale_inv, granularity)
    if (not p.codes.is_contiguous() or len(router.cpu_row_parts(p.n, p.k, m)) != 1
            or (bias is not None and (bias.dtype not in _NATIVE_DTYPES or not bias.is_contiguous()))):
        return None
    act_scale, ws, ws_ld, ws_gs, ws_div = p.native_scales
    call = cpu_native.linear_call(m, p.k, p.groups * GROUP_SIZE, x_dtype, p.fp8_dtype, act_scale, p.codes, ws, ws_ld,
                                  ws_gs, ws_div, bias)
    watched = (weight, weight_scale_inv) if bias is None else (weight, weight_scale_inv, bias)
    versions = tuple(t._version for t in watched)
    threads = torch.get_num_threads()
    nan_rows = p.nan_rows

    def plan(x: torch.Tensor, out_shape: tuple[int, ...]) -> torch.Tensor | None:
        if torch.get_num_threads() != threads or tuple(t._version for t in watched) != versions:
            return None
        y = torch.empty(out_shape, dtype=x_dtype)
        call(x.data_ptr(), y.data_ptr())
        if nan_rows is not None:
            y.view(m, -1)[:, nan_rows] = float("nan")
        return y

    return plan


def cpu_fp8_linear(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    granularity: str,
    bias: torch.Tensor | None = None,
    prepared: CpuFp8Weight | None = None,
    whole: bool = False,
) -> torch.Tensor:
    """y = dequant(quantize(x2d)) @ dequant(weight).T (+ bias) on the CPU; (M, N) in x2d.dtype.

    x2d: (M, K) bf16/fp16/fp32; weight: FP8 (N, K); weight_scale_inv: fp32 at `granularity`
    ('block', 'row' or 'tensor'); inputs are assumed validated. `prepared`: the weight's
    :func:`prepare_cpu_weight`, else one is made and kept per weight tensor (weakly). `whole=True`:
    one compiled-kernel call on this thread at any M where the kernels are built (for callers that
    spread whole calls over the threads, :func:`fp8linear.ops.cpu_native.run_split`); at M up to
    :data:`~fp8linear.ops.router.CPU_NATIVE_MAX_M` the bits are those of a call without it.
    """
    p = prepared if prepared is not None else _prepared_for(weight, weight_scale_inv, granularity)
    m = x2d.shape[0]
    n, k, groups = p.n, p.k, p.groups
    kp = groups * GROUP_SIZE
    if ((whole or router.use_cpu_native(m)) and p.codes.is_contiguous() and x2d.stride(1) == 1
            and cpu_native.native_kernel() is not None):
        # the compiled kernels: quantization (bit-exact with quantize_activation_grid), then the sums
        act_scale, ws, ws_ld, ws_gs, ws_div = p.native_scales
        parts = [(0, n)] if whole else router.cpu_row_parts(n, k, m)
        if len(parts) == 1:  # one C call, the output in x's dtype
            y = torch.empty(m, n, dtype=x2d.dtype)
            if bias is not None and (bias.dtype not in _NATIVE_DTYPES or not bias.is_contiguous()):
                bias = bias.float().contiguous()  # what the other paths add too (fp32)
            cpu_native.native_linear(x2d, kp, p.fp8_dtype, act_scale, p.codes, ws, ws_ld, ws_gs, ws_div, bias, y)
            if p.nan_rows is not None:
                y[:, p.nan_rows] = float("nan")
            return y
        bias_f = bias.float() if bias is not None else None
        f32 = torch.float32  # what the C code reads and writes, whatever torch's default dtype
        xq, xs, y_m = torch.empty(m, kp, dtype=f32), torch.empty(m, groups, dtype=f32), torch.empty(m, n, dtype=f32)
        cpu_native.native_quantize(x2d, kp, p.fp8_dtype, act_scale, xq, xs)
        cpu_native.native_gemv(p.codes, xq, xs, ws, ws_ld, ws_gs, ws_div, y_m, parts)
        return _m_major_output(y_m, bias_f, x2d.dtype, p)
    bias_f = bias.float() if bias is not None else None
    pad_buf = _scratch(m, kp, torch.float32, "x", k) if kp != k and m <= PAD_SCRATCH_MAX_M else None
    grid, x_s = quantize_activation_grid(x2d, p.fp8_dtype, pad_buf)
    if router.use_cpu_half_gemv(m, n, kp, x2d.dtype, p.granularity):
        y = _half_gemv(p, grid, x_s, bias_f)
        if y is not None:
            return y
    xfold = p.block_scale is not None and m <= XFOLD_MAX_M
    # Up to a few rows of x: y (M, N) = x @ tile.T runs 3-4x faster in MKL than y.T = tile @ x.T
    # (at M=1 too for the batched GEMM over blocks: 13 us against 41 us for 3 blocks of 128x640).
    m_major = m <= M_MAJOR_MAX_M
    # Tiles are K wide (the GEMMs read the first K columns of the padded activations), except where
    # the tile is multiplied by its row-expanded scales, which need whole 128-column groups.
    row_scaled = not xfold and p.row_scale is not None
    tw = kp if row_scaled else k
    rows = _tile_rows(n, tw, xfold, m)
    h = _scratch(rows, tw, torch.int16, k=k if tw != k else None)
    f = _scratch(rows, tw, torch.float32, k=k if tw != k else None)
    n_pad = _cdiv(n, GROUP_SIZE) * GROUP_SIZE if xfold and rows >= GROUP_SIZE else n
    # outputs: y_t (N, M) ("N-major"), y_m (M, N), or per-block y_blk (N/128, M, 128) for the batched
    # GEMMs of M <= 8; the bias is added at the end except on the N-major path
    y_blk = y_out = None
    if xfold and rows >= GROUP_SIZE and m_major:
        y_blk = torch.empty(n_pad // GROUP_SIZE, m, GROUP_SIZE, dtype=torch.float32)
    else:
        y_out = torch.empty((m, n_pad) if m_major else (n_pad, m), dtype=torch.float32)
    if xfold:
        # the activations' scales times each 128-row block's scales (times 2**shift): (NB, M, G)
        s_blk = x_s * p.block_scale_x
        a_all = None
        if rows >= GROUP_SIZE and s_blk.numel() * GROUP_SIZE <= A_ALL_MAX:  # all blocks' activations at once
            a_all = (grid * s_blk.unsqueeze(-1)).view(s_blk.shape[0], m, kp)
            if tw != kp:
                a_all = a_all[..., :tw]
    else:
        xd = grid.mul_((x_s * p.act_scale).unsqueeze(-1))  # (M, G, 128) dequantized activations (* 2**shift)
    if xfold and rows >= GROUP_SIZE:
        if bias_f is not None and n_pad != n and not m_major:
            bias_f = F.pad(bias_f, (0, n_pad - n))
        for n0, n1, codes in _tiles(p, rows):
            r = n1 - n0
            blocks = _cdiv(r, GROUP_SIZE)
            if r == rows:
                _decode_bits(codes, h)
                f.copy_(h.view(torch.float16))
            else:
                _decode_bits(codes, h[:r])
                f[:r].copy_(h[:r].view(torch.float16))
            b0 = n0 // GROUP_SIZE
            if a_all is not None:
                a = a_all[b0:b0 + blocks]
            else:
                a = (grid * s_blk[b0:b0 + blocks].unsqueeze(-1)).view(blocks, m, kp)[..., :tw]
            fb = f[: blocks * GROUP_SIZE].view(blocks, GROUP_SIZE, tw)
            if m_major:
                torch.bmm(a, fb.transpose(1, 2), out=y_blk[b0:b0 + blocks])
                continue
            out = y_out[n0:n0 + blocks * GROUP_SIZE].view(blocks, GROUP_SIZE, m)
            if bias_f is None:
                torch.bmm(fb, a.transpose(1, 2), out=out)
            else:
                bcol = bias_f[n0:n0 + blocks * GROUP_SIZE].view(blocks, GROUP_SIZE, 1)
                torch.baddbmm(bcol, fb, a.transpose(1, 2), out=out)
    else:
        block = -1
        hv = h.view(torch.float16)
        f_t = f.t()
        for n0, n1, codes in _tiles(p, rows):
            r = n1 - n0
            if r == rows:
                hr, fr, fr_t = h, f, f_t
            else:
                hr, fr = h[:r], f[:r]
                fr_t = fr.t()
            _decode_bits(codes, hr)
            fr.copy_(hv[:r] if r != rows else hv)
            if xfold:  # a power-of-two tile inside one 128-row block: its scales on the activations
                if n0 // GROUP_SIZE != block:
                    block = n0 // GROUP_SIZE
                    xd2 = (grid * s_blk[block].unsqueeze(-1)).view(m, kp)[:, :tw]
            else:
                xd2 = xd.view(m, kp)[:, :tw]
                if row_scaled:
                    fr.view(r, groups, GROUP_SIZE).mul_(p.row_scale[n0:n1])
            if m_major:
                torch.mm(xd2, fr_t, out=y_out[:, n0:n1])
            elif bias_f is None:
                torch.mm(fr, xd2.t(), out=y_out[n0:n1])
            else:
                torch.addmm(bias_f[n0:n1].view(r, 1), fr, xd2.t(), out=y_out[n0:n1])
    if m_major:
        if y_blk is not None and m > 1:  # (N/128, M, 128) -> (M, N) in one copy (or add, in fp32)
            y = torch.empty(m, n, dtype=x2d.dtype)
            if n == n_pad:
                dst, src = y.view(m, n_pad // GROUP_SIZE, GROUP_SIZE), y_blk.transpose(0, 1)
                b = None if bias_f is None else bias_f.view(-1, GROUP_SIZE)
            else:  # to (M, N_pad) first: one fp32 copy costs less than copying the last block apart
                dst, src, b = y, y_blk.transpose(0, 1).reshape(m, n_pad)[:, :n], bias_f
            if b is None:
                dst.copy_(src)
            else:
                torch.add(src, b, out=dst)
            if p.nan_rows is not None:
                y[:, p.nan_rows] = float("nan")
            return y
        if y_blk is not None:
            y_m = y_blk.view(m, n_pad)
            if n_pad != n:
                y_m = y_m[:, :n]
        else:
            y_m = y_out[:, :n] if n_pad != n else y_out
        return _m_major_output(y_m, bias_f, x2d.dtype, p)
    y_t = y_out[:n]
    if p.nan_rows is not None:
        y_t[p.nan_rows] = float("nan")
    if m == 1 and x2d.dtype == torch.float32:
        return y_t.reshape(1, n)
    y = torch.empty(m, n, dtype=x2d.dtype)
    y.copy_(y_t.t())
    return y
