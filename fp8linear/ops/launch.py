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

The launcher takes a pointer argument as a tensor (it calls ``data_ptr()`` and asks the driver
about the address: ``cuPointerGetAttribute``) or as a plain int (used as is). So once compiled, a
call holds its fixed tensors as ints (keeping their storages alive), and callers may pass raw
device addresses in the slots (:attr:`KernelCall.direct`), e.g. into one scratch allocation
(:class:`Scratch`) instead of one tensor per buffer: H100 host, torch 2.11, a CUDA
``torch.empty`` costs 5.7 us, a slice and two views of one buffer 7.6 us, ``data_ptr()`` 0.17 us.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton

from ..backend import device_guard

__all__ = ["ALIGN", "KernelCall", "Scratch", "aligned"]

# Triton specializes pointers on 16-byte alignment.
ALIGN = 16
# Buffers inside a Scratch start at multiples of this many bytes (the caching allocator's blocks are
# 512-byte aligned; 256 keeps every buffer on its own 128-byte lines and past ALIGN).
_SCRATCH_ALIGN = 256


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

    __slots__ = ("kernel", "grid", "options", "values", "slot_index", "compiled", "device_index", "held", "several")

    def __init__(self, kernel: Any, grid: Sequence[int], args: Mapping[str, Any], options: Mapping[str, Any],
                 slots: Sequence[str]) -> None:
        names = list(kernel.arg_names)
        missing = [n for n in names if n not in args and n not in slots]
        if missing:
            raise ValueError(f"KernelCall for {kernel.__name__} is missing arguments {missing}")
        self.kernel = kernel
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.options = dict(options)
        # slots are filled per call: what `args` holds there (the buffers a plan was built with) is
        # not kept, so a call pins no memory beyond its fixed tensors
        self.values = [None if n in slots else args.get(n) for n in names]
        self.slot_index = tuple(names.index(s) for s in slots)
        self.compiled = None
        self.device_index = -1
        self.held: tuple = ()  # storages of the fixed tensors, once they are held as addresses
        self.several = False  # several GPUs visible: launches make the kernel's device current

    @property
    def direct(self) -> bool:
        """Whether calls launch the compiled kernel directly (and so take raw device addresses, ints,
        in the slots as well as tensors)."""
        return self.compiled is not None

    def __call__(self, *tensors: torch.Tensor | int) -> None:
        self.launch(self.grid, *tensors)

    def launch(self, grid: tuple[int, int, int], *tensors: torch.Tensor | int) -> None:
        """Launch on another `grid` (three ints): for slots that change the work per call, such as a
        row count, which the kernel must then not specialize on (``do_not_specialize``)."""
        values = self.values.copy()
        for i, t in zip(self.slot_index, tensors):
            values[i] = t
        c = self.compiled
        if c is not None:
            if self.several and torch._C._cuda_getDevice() != self.device_index:
                with torch.cuda.device(self.device_index):  # the compiled kernel is loaded on that device
                    c.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(self.device_index),
                          c.function, c.packed_metadata, None, None, None, *values)
                return
            c.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(self.device_index), c.function,
                  c.packed_metadata, None, None, None, *values)
            return
        device = tensors[0].device if tensors and isinstance(tensors[0], torch.Tensor) else None
        with device_guard(device) if device is not None else contextlib.nullcontext():
            c = self.kernel[grid](*values, **self.options)
        if device is not None and device.type == "cuda" and c is not None and _direct(c) and not _launch_hooks_set():
            self.compiled = c
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
            self.several = torch.cuda.device_count() > 1
            # fixed tensors as addresses: the launcher skips data_ptr() and a driver query per call
            self.held = tuple(v.untyped_storage() for v in self.values if isinstance(v, torch.Tensor))
            self.values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in self.values]


class Scratch:
    """Several typed buffers in one allocation (one ``torch.empty`` per call instead of one per buffer).

    `specs`: (shape, dtype) of each contiguous buffer. :meth:`views` gives them as tensors (for JIT
    launches and the CPU interpreter), :meth:`addresses` as raw device addresses (for
    :attr:`KernelCall.direct` launches); both at the same offsets, each a multiple of 256 bytes.
    """

    __slots__ = ("specs", "offsets", "nbytes")

    def __init__(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.specs = tuple((tuple(shape), dtype) for shape, dtype in specs)
        offsets, end = [], 0
        for shape, dtype in self.specs:
            offsets.append(end)
            end += -(-math.prod(shape) * dtype.itemsize // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        self.offsets = tuple(offsets)
        self.nbytes = max(end, 1)

    def allocate(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(buf[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                     for (shape, dtype), off in zip(self.specs, self.offsets))

    def addresses(self, buf: torch.Tensor) -> tuple[int, ...]:
        base = buf.data_ptr()
        return tuple(base + off for off in self.offsets)
