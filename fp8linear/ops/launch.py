"""Low-overhead launches of our Triton kernels on a GPU (the host side of eager decode).

``kernel[grid](*args)`` through Triton's ``JITFunction.run`` costs about 24 us of host time per
launch on the H100 machines' CPUs (binding the arguments, specialising each one, building the
cache key, looking up the stream): as much as the GPU work of a decode-sized linear, so eager
decode was bound by it (``benchmarks/host_overhead.py``). :class:`FastKernel` wraps a
``@triton.jit`` kernel with the same calling convention; its first call for a given
specialisation goes through Triton (which compiles) and keeps the returned ``CompiledKernel``;
later calls with the same key launch that ``CompiledKernel`` directly.

The key is at least as fine as Triton's own specialisation, so a cached kernel is only reused
where Triton would pick the same binary: per argument, tensors by dtype and 16-byte alignment of
the data pointer, integers by ``== 1``, divisibility by 16, 32/64-bit range and sign, constexprs,
other scalars and launch options (``num_warps`` ...) by value; plus the current CUDA device.
Anything else (defaulted or unhashable arguments, the interpreter) takes Triton's own path;
launch hooks (profilers) are called as Triton calls them. H100 machine, act_quant launch: 25.4 us
through ``JITFunction.run``; its floor, ``CompiledKernel.run`` alone, 8.4 us.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton.runtime.jit import JITFunction

try:  # Triton >= 3.4
    from triton import knobs
except ImportError:  # pragma: no cover - older Triton: every launch takes Triton's own path
    knobs = None

__all__ = ["FastKernel", "specialization_key"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ALIGN = 16  # Triton specialises pointers and integers on divisibility by 16
_Tensor = torch.Tensor


def specialization_key(values: Sequence[Any], constexpr: Sequence[bool]) -> tuple:
    """Per argument: constexprs and non-integer scalars by value, tensors by (dtype, 16-byte
    alignment), integers by (== 1, % 16 == 0, fits int32, sign: int64 vs uint64). Unhashable arguments make the key
    unhashable (the caller then launches through Triton)."""
    return tuple(
        v if c else (v.dtype, v.data_ptr() % _ALIGN == 0) if type(v) is _Tensor
        else (v == 1, v % _ALIGN == 0, _INT32_MIN <= v <= _INT32_MAX, v >= 0) if type(v) is int else v
        for v, c in zip(values, constexpr)
    )


class FastKernel:
    """``FastKernel(jit_fn)[grid](*args, **kwargs)``: launch like ``jit_fn[grid](...)``, with a cached fast path."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # Under TRITON_INTERPRET=1 the kernel is an InterpretedFunction: always Triton's own path.
        self._fast = isinstance(fn, JITFunction) and knobs is not None
        params = list(inspect.signature(fn.fn).parameters.values())
        self._names = tuple(p.name for p in params)
        self._name_set = frozenset(self._names)
        self._constexpr = tuple(bool(p.is_constexpr) for p in fn.params) if self._fast else ()
        self._compiled: dict[tuple, Any] = {}  # (device, key) -> CompiledKernel, like Triton's own cache

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._fast or len(args) + len(kwargs) < len(self._names):  # defaults in play: Triton's path
            self.fn[grid](*args, **kwargs)
            return
        try:
            values = args + tuple(kwargs[name] for name in self._names[len(args):])
            options = tuple((k, v) for k, v in kwargs.items() if k not in self._name_set)
            device = torch.cuda.current_device()
            key = (device, options, specialization_key(values, self._constexpr))
            compiled = self._compiled.get(key)
        except (KeyError, TypeError):  # a default or an unhashable argument: Triton's own path
            self.fn[grid](*args, **kwargs)
            return
        if compiled is None:  # first launch of this specialisation: Triton compiles and launches it
            compiled = self.fn[grid](*args, **kwargs)
            if compiled is not None:
                self._compiled[key] = compiled
            return
        # What CompiledKernel's own runner does, without building a closure per call; launch hooks
        # (profilers) are passed on as Triton passes them. The raw stream is what Triton's driver reads.
        g = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch._C._cuda_getCurrentRawStream(device)
        hooks = knobs.runtime
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(g, stream, *values), hooks.launch_enter_hook, hooks.launch_exit_hook,
                     *values)
