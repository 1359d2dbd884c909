"""Launching a Triton kernel cheaply when the same launch repeats with new tensors.

``kernel[grid](...)`` binds every argument, derives the specialization key (dtypes, 16-byte
alignment, ints equal to 1 or divisible by 16), looks the compiled kernel up and reads the
current stream: H100 host (torch 2.11, Triton 3.6), 10.4 us for a no-op kernel of three
arguments against 4.9 us for calling the compiled kernel's launcher directly. A decode-sized FP8
linear is host-bound in eager mode, so :class:`KernelCall` keeps the compiled kernel of its first
launch and calls its launcher directly afterwards, with the same grid, scalars and options and
new tensors in named slots.

That is only valid while the new tensors specialize as the first ones did: same dtypes (the
caller keys its plans by dtype and shape) and 16-byte aligned data pointers wherever the first
launch's were aligned (:func:`aligned`; fresh allocations always are, caller inputs are checked).
The CPU interpreter, launch hooks (profilers) and Triton builds whose compiled kernels lack the
launcher attributes take the JIT path every time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton

__all__ = ["ALIGN", "KernelCall", "aligned"]

# Triton specializes pointers on 16-byte alignment.
ALIGN = 16


def aligned(t: torch.Tensor) -> bool:
    """Whether `t`'s data pointer has the alignment a compiled kernel may have been specialized for."""
    return t.data_ptr() % ALIGN == 0


def _hook_set(hook: Any) -> bool:
    """A launch hook that would run: a callable, or a non-empty chain of them (Triton >= 3.5's HookChain)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _launch_hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    return _hook_set(getattr(runtime, "launch_enter_hook", None)) or _hook_set(getattr(runtime, "launch_exit_hook", None))


def _direct(compiled: Any) -> bool:
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))


class KernelCall:
    """A launch of `kernel` with a fixed grid, fixed scalar arguments and options, whose tensor
    arguments named in `slots` are given per call (in that order).

    The first call goes through the JIT (compiling if needed); later calls on a CUDA device use the
    compiled kernel's launcher directly, on the current stream of the device of the first call.
    """

    __slots__ = ("kernel", "grid", "options", "values", "slot_index", "compiled", "device_index")

    def __init__(self, kernel: Any, grid: Sequence[int], args: Mapping[str, Any], options: Mapping[str, Any],
                 slots: Sequence[str]) -> None:
        names = list(kernel.arg_names)
        missing = [n for n in names if n not in args and n not in slots]
        if missing:
            raise ValueError(f"KernelCall for {kernel.__name__} is missing arguments {missing}")
        self.kernel = kernel
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.options = dict(options)
        self.values = [args.get(n) for n in names]
        self.slot_index = tuple(names.index(s) for s in slots)
        self.compiled = None
        self.device_index = -1

    def __call__(self, *tensors: torch.Tensor) -> None:
        values = self.values.copy()
        for i, t in zip(self.slot_index, tensors):
            values[i] = t
        c = self.compiled
        if c is not None:
            g = self.grid
            c.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self.device_index), c.function,
                  c.packed_metadata, None, None, None, *values)
            return
        c = self.kernel[self.grid](*values, **self.options)
        device = tensors[0].device if tensors else None
        if device is not None and device.type == "cuda" and c is not None and _direct(c) and not _launch_hooks_set():
            self.compiled = c
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
