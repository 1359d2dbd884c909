"""Compiled x86 kernels for the CPU FP8 linear at decode sizes: one pass over the FP8 weight.

torch's CPU ops cannot fuse the weight decode into the GEMV, so :mod:`fp8linear.ops.cpu_linear`
decodes tiles with three vectorised integer passes and a float16 GEMV reads them back. These
kernels do it in registers: 16 FP8 codes are widened to int16, moved into float16 bits (``<< 7``,
``& 0xBF80``: the FP8 value times 2^-8 for e4m3fn, 2^-7 for e4m3fnuz, subnormals included) and
converted to fp32 (F16C). Up to GEMV_MAX_M rows of quantized activations a GEMV multiplies them in
with FMA; above, a blocked kernel decodes each weight group into an L1 buffer once and reuses it
across the rows (how many rows run here is the router's choice:
:func:`fp8linear.ops.router.use_cpu_native`). Each 128-wide
group's fp32 sum is scaled by the activation and weight scales. Same numerics contract as the torch
path (the reference's quantized products summed in fp32, in another order). A second function
quantizes the activations per token in 1x128 groups, bit for bit as
:func:`fp8linear.ops.cpu_linear.quantize_activation_grid` (:func:`native_quantize`); a third runs
the whole linear (quantization, sums, bias, output rounding) in one call (:func:`native_linear`,
:func:`linear_call`).

The C source below is compiled once per machine with the system C compiler (``cc``, AVX2 + F16C +
FMA, ``-march=native``) into a cache folder (``FP8LINEAR_CACHE``, default ``~/.cache/fp8linear``),
written under a temporary name and renamed, and loaded with ``ctypes``; rows are split over
torch's intra-op threads with Python threads (``ctypes`` releases the GIL during the call), in the
ranges the router gives (:func:`fp8linear.ops.router.cpu_row_parts`).
No compiler, a CPU without those instructions, a failed build or ``FP8LINEAR_CPU_NATIVE=0``:
:func:`native_kernel` returns None (logged once) and the torch path runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

from ..formats import GROUP_SIZE, activation_max, fp8_min_exponent
from ..reference import AMAX_FLOOR

__all__ = ["GEMV_MAX_M", "native_gemv", "native_kernel", "native_linear", "native_quantize", "linear_call",
           "run_split"]

log = logging.getLogger(__name__)

# Rows the GEMV functions are compiled for (the switch in fp8_gemv_rows: two fp32 accumulator registers
# per row, x read once per weight row); more rows run the blocked kernel (weight rows decoded once
# into L1, x reused across them).
GEMV_MAX_M = 4
# The blocked kernel walks K in blocks whose slice of x (rows x 128-wide groups, fp32) is at most this
# many bytes, so that it stays in L2 while the weight rows stream past.
X_BLOCK_BYTES = 1 << 18


_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float decode1(int8_t b) {
    uint16_t h = (uint16_t)(((int16_t)b << 7) & 0xBF80);
    return _cvtsh_ss(h);
}

/* y[m * ldy + n] = sum_g ws(n, g) * xs[m * G + g] * sum_{k in group g} xq[m * Kp + k] * dec(w[n * K + k])
   for n in [n0, n1), m < M; ws(n, g) = ws[(n / ws_div) * ws_ld + g * ws_gs]. */
#define GEMV_BODY(MM)                                                                              \
    for (int64_t n = n0; n < n1; ++n) {                                                            \
        const int8_t* wr = w + n * K;                                                              \
        const float* wsr = ws + (n / ws_div) * ws_ld;                                              \
        float out[MM];                                                                             \
        for (int m = 0; m < MM; ++m) out[m] = 0.0f;                                                \
        for (int64_t g = 0; g < G; ++g) {                                                          \
            const int64_t k0 = g * 128;                                                            \
            const int64_t k1 = (k0 + 128 < K) ? k0 + 128 : K;                                      \
            __m256 acc[MM], acc2[MM]; /* two FMA chains per row: latency, not throughput, at M=1 */  \
            for (int m = 0; m < MM; ++m) acc[m] = acc2[m] = _mm256_setzero_ps();                   \
            int64_t k = k0;                                                                        \
            for (; k + 16 <= k1; k += 16) {                                                        \
                __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wr + k)));       \
                h = _mm256_and_si256(_mm256_slli_epi16(h, 7), mask);                               \
                const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));                      \
                const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));                 \
                for (int m = 0; m < MM; ++m) {                                                     \
                    const float* xr = xq + m * Kp + k;                                             \
                    acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), lo, acc[m]);                     \
                    acc2[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), hi, acc2[m]);               \
                }                                                                                  \
            }                                                                                      \
            const float wsg = wsr[g * ws_gs];                                                      \
            for (int m = 0; m < MM; ++m) {                                                         \
                float s = hsum8(_mm256_add_ps(acc[m], acc2[m]));                                   \
                for (int64_t t = k; t < k1; ++t) s += xq[m * Kp + t] * decode1(wr[t]);             \
                out[m] += s * (xs[m * G + g] * wsg);                                               \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < MM; ++m) y[m * ldy + n] = out[m];                                      \
    }

#define GEMV_FN(MM)                                                                                \
    static void gemv_##MM(const int8_t* w, int64_t K, int64_t n0, int64_t n1, const float* xq,     \
                          int64_t Kp, const float* xs, int64_t G, const float* ws, int64_t ws_ld,  \
                          int64_t ws_gs, int64_t ws_div, float* y, int64_t ldy) {                  \
        const __m256i mask = _mm256_set1_epi16((short)0xBF80);                                     \
        GEMV_BODY(MM)                                                                              \
    }

GEMV_FN(1) GEMV_FN(2) GEMV_FN(3) GEMV_FN(4)

/* 128 FP8 codes of one weight row's group [k0, k1) -> out[0..128) fp32 (the decoded value times
   2^-8 or 2^-7, as above), zeros past k1; out 32-byte aligned. */
static inline void decode_group(const int8_t* wr, int64_t k0, int64_t k1, float* out, __m256i mask) {
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wr + k)));
        h = _mm256_and_si256(_mm256_slli_epi16(h, 7), mask);
        _mm256_store_ps(out + (k - k0), _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
        _mm256_store_ps(out + (k - k0) + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
    for (; k < k1; ++k) out[k - k0] = decode1(wr[k]);
    for (; k < k0 + 128; ++k) out[k - k0] = 0.0f;
}

/* MM (1..3) rows of x from row m against the decoded group g of four weight rows (wb, 128 floats a
   row): 12 FMA chains at MM = 3, x read from L1 once per four weight rows. Each (row of x, weight
   row) group sum is reduced across lanes (four weight rows at once), scaled by the activation and
   weight scales and added to y, as the GEMV does. */
#define QUAD_CHUNK(MM)                                                                             \
    case MM: {                                                                                     \
        __m256 a[MM][4];                                                                           \
        for (int i = 0; i < MM; ++i)                                                               \
            for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();                             \
        const float* xr = xq + m * Kp + k0;                                                        \
        for (int kk = 0; kk < 128; kk += 8) {                                                      \
            const __m256 w0 = _mm256_load_ps(wb + kk), w1 = _mm256_load_ps(wb + 128 + kk);         \
            const __m256 w2 = _mm256_load_ps(wb + 256 + kk), w3 = _mm256_load_ps(wb + 384 + kk);   \
            for (int i = 0; i < MM; ++i) {                                                         \
                const __m256 xv = _mm256_loadu_ps(xr + i * Kp + kk);                               \
                a[i][0] = _mm256_fmadd_ps(xv, w0, a[i][0]);                                        \
                a[i][1] = _mm256_fmadd_ps(xv, w1, a[i][1]);                                        \
                a[i][2] = _mm256_fmadd_ps(xv, w2, a[i][2]);                                        \
                a[i][3] = _mm256_fmadd_ps(xv, w3, a[i][3]);                                        \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MM; ++i) {                                                             \
            const __m128 s = _mm_mul_ps(sum4(a[i][0], a[i][1], a[i][2], a[i][3]),                  \
                                        _mm_mul_ps(_mm_set1_ps(xs[(m + i) * G + g]), wsv));        \
            float* yr = y + (m + i) * ldy + n;                                                     \
            if (nr == 4) {                                                                         \
                _mm_storeu_ps(yr, g == 0 ? s : _mm_add_ps(_mm_loadu_ps(yr), s));                   \
            } else {                                                                               \
                float o[4];                                                                        \
                _mm_storeu_ps(o, s);                                                               \
                for (int j = 0; j < nr; ++j) yr[j] = g == 0 ? o[j] : yr[j] + o[j];                 \
            }                                                                                      \
        }                                                                                          \
        break;                                                                                     \
    }

/* The four lane sums of a, b, c, d: (sum a, sum b, sum c, sum d). */
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* More rows of x than the GEMV takes: the same sums, each weight element decoded once per call.
   K is walked in blocks of kb_groups 128-wide groups (x's slice of a block stays in L2 while the
   weight rows stream past); in a block, four weight rows at a time are decoded group by group into
   an fp32 buffer that stays in L1 and multiplied into the rows of x three at a time. */
static void gemm_quads(const int8_t* w, int64_t K, int64_t n0, int64_t n1, const float* xq, int64_t M,
                       int64_t Kp, const float* xs, int64_t G, const float* ws, int64_t ws_ld, int64_t ws_gs,
                       int64_t ws_div, float* y, int64_t ldy, int64_t kb_groups) {
    const __m256i mask = _mm256_set1_epi16((short)0xBF80);
    float wb[512] __attribute__((aligned(32)));
    for (int64_t gb = 0; gb < G; gb += kb_groups) {
        const int64_t g1 = (gb + kb_groups < G) ? gb + kb_groups : G;
        for (int64_t n = n0; n < n1; n += 4) {
            const int nr = (n1 - n < 4) ? (int)(n1 - n) : 4;
            for (int64_t g = gb; g < g1; ++g) {
                const int64_t k0 = g * 128;
                const int64_t k1 = (k0 + 128 < K) ? k0 + 128 : K;
                float wsq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int j = 0; j < 4; ++j) {
                    if (j < nr) {
                        decode_group(w + (n + j) * K, k0, k1, wb + 128 * j, mask);
                        wsq[j] = ws[((n + j) / ws_div) * ws_ld + g * ws_gs];
                    } else {
                        for (int t = 0; t < 128; ++t) wb[128 * j + t] = 0.0f;
                    }
                }
                const __m128 wsv = _mm_loadu_ps(wsq);
                for (int64_t m = 0; m < M; m += 3) {
                    switch ((M - m < 3) ? M - m : 3) { QUAD_CHUNK(1) QUAD_CHUNK(2) QUAD_CHUNK(3) }
                }
            }
        }
    }
}

/* Per-token 1x128 quantization, bit for bit cpu_linear.quantize_activation_grid (and so the
   reference): x (M, K) fp32 / bf16 / fp16 (x_dtype 0 / 1 / 2, row stride ldx elements) ->
   xq (M, Kp) fp32 FP8 values (0 past K), xs (M, G) = scale * x_factor. amax propagates NaN, as
   torch's amax; the clamps keep NaN, as torch.clamp; the rounding to 3 mantissa bits adds and
   subtracts c = 1.5 * 2**(e + 20) (e floored at the FP8 subnormal exponent) in fp32. */
static inline float load_x(const void* x, int x_dtype, int64_t i) {
    if (x_dtype == 0) return ((const float*)x)[i];
    if (x_dtype == 1) {
        union { uint32_t u; float f; } v;
        v.u = (uint32_t)((const uint16_t*)x)[i] << 16;
        return v.f;
    }
    return _cvtsh_ss(((const uint16_t*)x)[i]);
}

int fp8_quant_rows(const void* x, int x_dtype, int64_t M, int64_t K, int64_t ldx, int64_t Kp,
                   float qmax, float amax_floor, int32_t emin_bits, int32_t round_offset, float x_factor,
                   float* xq, float* xs) {
    const int64_t G = Kp / 128;
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t g = 0; g < G; ++g) {
            const int64_t k0 = g * 128;
            const int64_t k1 = (k0 + 128 < K) ? k0 + 128 : K;
            float amax = 0.0f;
            int nan = 0;
            for (int64_t k = k0; k < k1; ++k) {
                const float a = fabsf(load_x(x, x_dtype, m * ldx + k));
                if (a != a) nan = 1;
                else if (a > amax) amax = a;
            }
            if (nan) amax = NAN;
            else if (amax < amax_floor) amax = amax_floor;
            const float scale = amax / qmax;
            float* out = xq + m * Kp + k0;
            for (int64_t k = k0; k < k0 + 128; ++k) {
                float q = ((k < k1) ? load_x(x, x_dtype, m * ldx + k) : 0.0f) / scale;  /* padding: 0 / scale */
                if (q == q) q = q < -qmax ? -qmax : (q > qmax ? qmax : q);
                union { float f; uint32_t u; } b, c;
                b.f = q;
                const uint32_t e = b.u & 0x7F800000u;  /* unsigned: NaN's exponent plus the offset wraps, defined */
                c.u = (e < (uint32_t)emin_bits ? (uint32_t)emin_bits : e) + (uint32_t)round_offset;
                volatile float t = q + c.f;  /* two separate fp32 roundings, never contracted */
                out[k - k0] = t - c.f;
            }
            xs[m * G + g] = scale * x_factor;
        }
    }
    return 0;
}

int fp8_gemv_rows(const int8_t* w, int64_t K, int64_t n0, int64_t n1, const float* xq, int64_t M,
                  int64_t Kp, const float* xs, int64_t G, const float* ws, int64_t ws_ld, int64_t ws_gs,
                  int64_t ws_div, float* y, int64_t ldy, int64_t kb_groups) {
    switch (M) {
        case 1: gemv_1(w, K, n0, n1, xq, Kp, xs, G, ws, ws_ld, ws_gs, ws_div, y, ldy); return 0;
        case 2: gemv_2(w, K, n0, n1, xq, Kp, xs, G, ws, ws_ld, ws_gs, ws_div, y, ldy); return 0;
        case 3: gemv_3(w, K, n0, n1, xq, Kp, xs, G, ws, ws_ld, ws_gs, ws_div, y, ldy); return 0;
        case 4: gemv_4(w, K, n0, n1, xq, Kp, xs, G, ws, ws_ld, ws_gs, ws_div, y, ldy); return 0;
        default:
            if (M < 1 || kb_groups < 1) return 1;
            gemm_quads(w, K, n0, n1, xq, M, Kp, xs, G, ws, ws_ld, ws_gs, ws_div, y, ldy, kb_groups);
            return 0;
    }
}

/* fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (as torch's conversion). */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if (f != f) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* The whole linear on one thread: x (M, K) quantized (fp8_quant_rows), its sums against weight rows
   [0, N) (fp8_gemv_rows), and y (M, N) in y_dtype (0 fp32, 1 bf16, 2 fp16; row stride N) = the sums
   plus the bias (bias_dtype as x_dtype; -1: none) in fp32, rounded once. Returns 0, or 2 where the
   scratch cannot be allocated. */
int fp8_linear_rows(const void* x, int x_dtype, int64_t M, int64_t K, int64_t ldx, int64_t Kp, float qmax,
                    float amax_floor, int32_t emin_bits, int32_t round_offset, float x_factor, const int8_t* w,
                    int64_t N, const float* ws, int64_t ws_ld, int64_t ws_gs, int64_t ws_div, const void* bias,
                    int bias_dtype, void* y, int y_dtype, int64_t kb_groups) {
    const int64_t G = Kp / 128;
    float* xq = (float*)malloc((size_t)(M * Kp + M * G + M * N) * sizeof(float));
    if (xq == NULL) return 2;
    float* xs = xq + M * Kp;
    float* yf = xs + M * G;
    int status = fp8_quant_rows(x, x_dtype, M, K, ldx, Kp, qmax, amax_floor, emin_bits, round_offset, x_factor,
                                xq, xs);
    if (status == 0)
        status = fp8_gemv_rows(w, K, 0, N, xq, M, Kp, xs, G, ws, ws_ld, ws_gs, ws_div, yf, N, kb_groups);
    if (status == 0) {
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t n = 0; n < N; ++n) {
                const float v = yf[m * N + n];
                const float o = (bias_dtype < 0) ? v : v + load_x(bias, bias_dtype, n);  /* in fp32 */
                if (y_dtype == 0) ((float*)y)[m * N + n] = o;
                else if (y_dtype == 1) ((uint16_t*)y)[m * N + n] = to_bf16(o);
                else ((uint16_t*)y)[m * N + n] = _cvtss_sh(o, _MM_FROUND_TO_NEAREST_INT);
            }
        }
    }
    free(xq);
    return status;
}
"""

_FLAGS = ("-O3", "-march=native", "-mavx2", "-mf16c", "-mfma", "-shared", "-fPIC")
_NEEDED_CPU_FLAGS = ("avx2", "f16c", "fma")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    return Path(os.environ.get("FP8LINEAR_CACHE") or Path.home() / ".cache" / "fp8linear")


def _build(compiler: str, flags: set[str]) -> Path:
    """The compiled library for this source, compiler and CPU (built once, renamed into place)."""
    tag = hashlib.sha256("\0".join((_SOURCE, compiler, *_FLAGS, *sorted(flags))).encode()).hexdigest()[:16]
    target = _cache_dir() / f"fp8_cpu_gemv-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "fp8_cpu_gemv.c", Path(tmp) / "fp8_cpu_gemv.so"
        src.write_text(_SOURCE)
        subprocess.run([compiler, *_FLAGS, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
        os.replace(out, target)
    return target


class _Kernels(NamedTuple):
    gemv: Callable[..., int]
    quant: Callable[..., int]
    linear: Callable[..., int]


@lru_cache(maxsize=1)
def native_kernel() -> _Kernels | None:
    """The loaded kernels (``gemv``, ``quant``), or None (logged once) where they cannot be had."""
    if os.environ.get("FP8LINEAR_CPU_NATIVE", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _cpu_flags()
    if not all(f in flags for f in _NEEDED_CPU_FLAGS):
        log.info("fp8linear: this CPU lacks AVX2/F16C/FMA; the CPU FP8 linear runs on torch ops")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.info("fp8linear: no C compiler (cc) found; the CPU FP8 linear runs on torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, flags)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.info("fp8linear: building the CPU FP8 kernel failed (%s %s); the CPU FP8 linear runs on torch ops",
                 e, detail.decode(errors="replace")[:500])
        return None
    i64, i32, f32, p = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    gemv, quant, linear = lib.fp8_gemv_rows, lib.fp8_quant_rows, lib.fp8_linear_rows
    gemv.argtypes = [p, i64, i64, i64, p, i64, i64, p, i64, p, i64, i64, i64, p, i64, i64]
    quant.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, f32, f32, i32, i32, f32, p, p]
    linear.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, f32, f32, i32, i32, f32, p, i64, p, i64, i64, i64, p,
                       ctypes.c_int, p, ctypes.c_int, i64]
    gemv.restype = quant.restype = linear.restype = ctypes.c_int
    return _Kernels(gemv, quant, linear)


_WORKER_PREFIX = "fp8linear-cpu"
T = TypeVar("T")


@lru_cache(maxsize=1)
def _pool(threads: int) -> ThreadPoolExecutor:
    """Worker threads for row splits and :func:`run_split` (one pool; a new thread count replaces it)."""
    return ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix=_WORKER_PREFIX)


def _in_worker() -> bool:
    """Whether this thread is one of the pool's workers (which must not wait on the pool)."""
    return threading.current_thread().name.startswith(_WORKER_PREFIX)


def run_split(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """The results of `tasks`, run over the intra-op threads: task i on this thread where i % threads
    is 0, else on a pool worker; results in task order. A task must not split its own work over the
    pool (:func:`native_gemv` runs its parts in turn on a worker)."""
    threads = min(torch.get_num_threads(), len(tasks))
    if threads <= 1 or _in_worker():
        return [task() for task in tasks]

    def share(j: int) -> list[T]:
        return [tasks[i]() for i in range(j, len(tasks), threads)]

    pool = _pool(torch.get_num_threads())
    futures = [pool.submit(share, j) for j in range(1, threads)]
    shares = [share(0)] + [f.result() for f in futures]
    return [shares[i % threads][i // threads] for i in range(len(tasks))]


def _drop_pool_after_fork() -> None:
    # a forked child inherits the pool's state but not its threads: it makes its own
    _pool.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_pool_after_fork)


_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@lru_cache(maxsize=4)
def _quant_constants(fp8_dtype: torch.dtype) -> tuple[float, float, int, int]:
    """(qmax, amax floor, FP32 bits of the FP8 subnormal exponent, rounding offset) of the quantization."""
    return activation_max(fp8_dtype), AMAX_FLOOR, (127 + fp8_min_exponent(fp8_dtype)) << 23, (20 << 23) | (1 << 22)


def _check_f32(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """The C code reads and writes these buffers as contiguous fp32 of exactly this shape."""
    if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a contiguous float32 tensor of shape {shape}, "
                         f"got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}")


def native_quantize(x2d: torch.Tensor, kp: int, fp8_dtype: torch.dtype, x_factor: float,
                    xq: torch.Tensor, xs: torch.Tensor) -> None:
    """Per-token 1x128 quantization of x2d (M, K) (fp32/bf16/fp16, unit column stride) into xq
    (M, Kp) fp32 FP8 values, zero past K, and xs (M, Kp/128) = scales * x_factor: the values and
    scales of :func:`fp8linear.ops.cpu_linear.quantize_activation_grid`, bit for bit."""
    m, k = x2d.shape
    _check_f32(xq, (m, kp), "xq")
    _check_f32(xs, (m, kp // GROUP_SIZE), "xs")
    if x2d.dtype not in _X_DTYPES or x2d.stride(1) != 1 or kp < k or kp % GROUP_SIZE:
        raise ValueError(f"x must be (M, K) fp32/bf16/fp16 with unit column stride and Kp a multiple of 128 >= K, "
                         f"got {x2d.dtype} {tuple(x2d.shape)} strides {x2d.stride()}, Kp={kp}")
    status = native_kernel().quant(
        x2d.data_ptr(), _X_DTYPES[x2d.dtype], m, k, x2d.stride(0), kp, *_quant_constants(fp8_dtype), x_factor,
        xq.data_ptr(), xs.data_ptr())
    if status:
        raise ValueError("the CPU FP8 quantization kernel refused its arguments")


def native_linear(x2d: torch.Tensor, kp: int, fp8_dtype: torch.dtype, x_factor: float, codes: torch.Tensor,
                  ws: torch.Tensor, ws_ld: int, ws_gs: int, ws_div: int, bias: torch.Tensor | None,
                  y: torch.Tensor) -> None:
    """The whole linear in one call on this thread: :func:`native_quantize` of x2d (M, K), the sums of
    :func:`native_gemv`, and y (M, N) in x's dtype (contiguous) = the sums plus the bias (fp32/bf16/fp16,
    N values) in fp32, rounded once: the bits of the fp32 sums converted as torch converts them. For
    calls that :func:`fp8linear.ops.router.cpu_row_parts` keeps in one range (the caller checks)."""
    m, k = x2d.shape
    if x2d.stride(1) != 1 or y.dtype != x2d.dtype or not y.is_contiguous() or tuple(y.shape) != (m, codes.shape[0]):
        raise ValueError(f"x must have unit column stride and y be contiguous ({m}, {codes.shape[0]}) of x's dtype, "
                         f"got x {x2d.dtype} strides {x2d.stride()}, y {y.dtype} {tuple(y.shape)} "
                         f"contiguous={y.is_contiguous()}")
    head, tail = _linear_args(m, k, x2d.stride(0), kp, x2d.dtype, fp8_dtype, x_factor, codes, ws, ws_ld, ws_gs,
                              ws_div, bias)
    if native_kernel().linear(x2d.data_ptr(), *head, y.data_ptr(), *tail):
        raise ValueError(f"the CPU FP8 kernel could not allocate its scratch (M={m}, K={k}, N={codes.shape[0]})")


def linear_call(m: int, k: int, kp: int, x_dtype: torch.dtype, fp8_dtype: torch.dtype, x_factor: float,
                codes: torch.Tensor, ws: torch.Tensor, ws_ld: int, ws_gs: int, ws_div: int,
                bias: torch.Tensor | None) -> Callable[[int, int], None]:
    """:func:`native_linear` for contiguous x (m, k) of `x_dtype` into contiguous y (m, N) of that
    dtype, its arguments checked and made once: ``call(x address, y address)`` (it keeps `codes`,
    `ws` and `bias` alive)."""
    head, tail = _linear_args(m, k, k, kp, x_dtype, fp8_dtype, x_factor, codes, ws, ws_ld, ws_gs, ws_div, bias)
    fn, n = native_kernel().linear, codes.shape[0]

    def call(x_addr: int, y_addr: int) -> None:
        if fn(x_addr, *head, y_addr, *tail):
            raise ValueError(f"the CPU FP8 kernel could not allocate its scratch (M={m}, K={k}, N={n})")

    call.operands = (codes, ws, bias)  # the addresses in `head` stay valid while the call lives
    return call


def _linear_args(m: int, k: int, ldx: int, kp: int, x_dtype: torch.dtype, fp8_dtype: torch.dtype, x_factor: float,
                 codes: torch.Tensor, ws: torch.Tensor, ws_ld: int, ws_gs: int, ws_div: int,
                 bias: torch.Tensor | None) -> tuple[tuple, tuple]:
    """fp8_linear_rows' arguments around the x and y addresses (checked: the C code trusts them)."""
    n = codes.shape[0]
    if (x_dtype not in _X_DTYPES or kp < k or kp % GROUP_SIZE or m < 1 or codes.dtype != torch.int8
            or not codes.is_contiguous() or codes.shape[1] != k or ws.dtype != torch.float32 or not ws.is_contiguous()
            or (bias is not None and (bias.dtype not in _X_DTYPES or not bias.is_contiguous() or bias.numel() != n))):
        raise ValueError(f"the CPU FP8 linear takes M >= 1 rows of fp32/bf16/fp16 x, Kp a multiple of 128 >= K, "
                         f"contiguous int8 codes (N, K), contiguous fp32 ws and N contiguous fp32/bf16/fp16 bias "
                         f"values; got M={m}, K={k}, Kp={kp}, x {x_dtype}, codes {codes.dtype} {tuple(codes.shape)}, "
                         f"ws {ws.dtype}, bias {None if bias is None else (bias.dtype, tuple(bias.shape))}")
    head = (_X_DTYPES[x_dtype], m, k, ldx, kp, *_quant_constants(fp8_dtype), x_factor, codes.data_ptr(), n,
            ws.data_ptr(), ws_ld, ws_gs, ws_div, None if bias is None else bias.data_ptr(),
            -1 if bias is None else _X_DTYPES[bias.dtype])
    return head, (_X_DTYPES[x_dtype], _kb_groups(m))


def _kb_groups(m: int) -> int:
    """128-wide groups per K block of the blocked kernel (see X_BLOCK_BYTES)."""
    return max(1, X_BLOCK_BYTES // (m * GROUP_SIZE * 4))


def native_gemv(codes: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, ws_ld: int, ws_gs: int,
                ws_div: int, y: torch.Tensor, parts: list[tuple[int, int]]) -> None:
    """y (M, N) fp32 = the FP8 linear's sums for M >= 1 rows of x (see the module docstring).

    `codes`: the weight (N, K) as int8, contiguous; `xq` (M, Kp) fp32 quantized activations, zero
    past K, contiguous; `xs` (M, G) fp32 activation scales, times the decode's power of two;
    `ws`, `ws_ld`, `ws_gs`, `ws_div`: weight scale of (row n, group g) = ws[(n // ws_div) * ws_ld +
    g * ws_gs] (fp32, contiguous). `parts`: the weight-row ranges to run, one per thread
    (:func:`fp8linear.ops.router.cpu_row_parts`). The caller has checked the kernel exists
    (:func:`native_kernel`).
    """
    fn = native_kernel().gemv
    n, k = codes.shape
    m, kp = xq.shape
    groups = xs.shape[1]
    if codes.dtype != torch.int8 or not codes.is_contiguous():
        raise ValueError(f"codes must be a contiguous int8 (N, K) tensor, got {codes.dtype} strides {codes.stride()}")
    _check_f32(xq, (m, groups * GROUP_SIZE), "xq")
    _check_f32(xs, (m, groups), "xs")
    _check_f32(y, (m, n), "y")
    if ws.dtype != torch.float32 or not ws.is_contiguous():
        raise ValueError(f"ws must be contiguous float32, got {ws.dtype}")
    if m < 1:
        raise ValueError(f"the CPU FP8 kernel takes 1 row of x or more, got {m}")
    if not parts or parts[0][0] != 0 or parts[-1][1] != n or any(
            not a < b or b != c for (a, b), (c, _) in zip(parts, parts[1:] + [(n, None)])):
        raise ValueError(f"parts must be weight row ranges (start, end) covering [0, {n}) in order, got {parts}")
    args = (codes.data_ptr(), k, xq.data_ptr(), m, kp, xs.data_ptr(), groups, ws.data_ptr(), ws_ld, ws_gs, ws_div,
            y.data_ptr(), y.stride(0), _kb_groups(m))
    threads = torch.get_num_threads()

    def run(part: tuple[int, int]) -> int:
        return fn(args[0], args[1], part[0], part[1], *args[2:])

    if len(parts) == 1 or _in_worker():  # a worker runs its parts itself: waiting on the pool could deadlock
        status = 0
        for part in parts:
            status |= run(part)
    else:
        futures = [_pool(threads).submit(run, part) for part in parts[1:]]
        status = run(parts[0])
        status |= sum(f.result() for f in futures)
    if status:
        raise ValueError(f"the CPU FP8 kernel refused its arguments (M={m}, K={k})")
