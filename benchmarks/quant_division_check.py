"""Check act_quant's division (fp8linear.ops.quant.quantize_groups) against fp32 division on the CPU.

quantize_groups computes x / scale from r = 1 / scale (correctly rounded) as q0 = x * r and two
residual corrections q' = fma(x - q * scale, r, q). This script replays that arithmetic in numpy,
with the exact fp32 fma of Triton's CPU interpreter, for every finite bf16 value up to a group's
amax and 4096 full-mantissa fp32 values in [-amax, amax], under scale = amax / 448 for random
full-mantissa amax over 2**-40..2**40 (the first 64 with mantissas of all ones or near, the next 64
near powers of two), and counts quotients of at least 2**-12 (below, every FP8 format gives +0)
that differ from numpy's correctly rounded fp32 division, after one and after two corrections.

    python benchmarks/quant_division_check.py [--scales 20000] [--seed 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

try:  # the exact fp32 fma the interpreter runs tl.fma with
    from triton._C.libtriton import interpreter as _interpreter
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    raise SystemExit(f"this check needs Triton's CPU interpreter helpers (triton._C.libtriton.interpreter): {exc}")

QMAX = np.float32(448.0)  # e4m3fn's activation range; fnuz's 240 gives the same kind of scales
SMALLEST_RELEVANT = 2.0**-12


def _every_finite_bf16() -> np.ndarray:
    bits = np.arange(-(2**15), 2**15, dtype=np.int32).astype(np.uint32) << 16
    v = bits.view(np.float32)
    return v[np.isfinite(v)]


def _amaxes(rng: np.random.Generator, n: int) -> np.ndarray:
    mantissa = rng.integers(0, 2**23, n, dtype=np.int64)
    edge = min(n, 64)
    mantissa[:edge] = 2**23 - 1 - np.arange(edge)
    near = min(max(n - 64, 0), 64)
    mantissa[64:64 + near] = np.arange(near)
    exponent = rng.integers(-40, 41, n)
    return ((exponent + 127).astype(np.int64) << 23 | mantissa).astype(np.uint32).view(np.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    fma = _interpreter.fma_fp32
    rng = np.random.default_rng(a.seed)
    bf16 = _every_finite_bf16()
    start, total, one_step, two_step = time.time(), 0, 0, 0
    for amax in _amaxes(rng, a.scales):
        scale = np.float32(amax / QMAX)
        x = np.concatenate([bf16[np.abs(bf16) <= amax],
                            ((rng.random(4096, dtype=np.float32) * 2 - 1) * amax).astype(np.float32),
                            np.float32([amax, -amax])])
        s, r = np.full_like(x, scale), np.full_like(x, np.float32(1.0) / scale)
        exact = x / scale
        q0 = x * r
        q1 = fma(fma(-q0, s, x), r, q0)
        q2 = fma(fma(-q1, s, x), r, q1)
        relevant = np.abs(exact) >= SMALLEST_RELEVANT
        one_step += int(((q1 != exact) & relevant).sum())
        two_step += int(((q2 != exact) & relevant).sum())
        total += x.size
    print(f"{a.scales} scales, {total} quotients ({time.time() - start:.0f} s): differing from fp32 division "
          f"from 2**-12 up after one correction {one_step}, after two {two_step}")
    if two_step:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
