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
the data pointer, integers by ``== 1``, divisibility by 16 and 32/64-bit range, other scalars by
type, constexprs and launch options (``num_warps`` ...) by value; plus the current CUDA device.
Anything else (an argument of another kind, a launch hook set by a profiler, the interpreter)
takes Triton's own path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton.runtime.jit import JITFunction

__all__ = ["FastKernel", "specialization_key"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ALIGN = 16  # Triton specialises pointers and integers on divisibility by 16


class _Unkeyable(Exception):
    """An argument the key does not cover: launch through Triton."""


def _arg_key(value: Any, constexpr: bool) -> Any:
    if constexpr:
        return ("c", value)
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % _ALIGN == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value == 1, value % _ALIGN == 0, _INT32_MIN <= value <= _INT32_MAX, value < 0)
    if isinstance(value, float):
        return "f"
    if value is None:
        return "n"
    raise _Unkeyable(type(value).__name__)


def specialization_key(values: Sequence[Any], constexpr: Sequence[bool], options: dict[str, Any]) -> tuple:
    """The cache key of one launch (see the module docstring); raises _Unkeyable for other argument kinds."""
    return (tuple(_arg_key(v, c) for v, c in zip(values, constexpr)), tuple(sorted(options.items())))


class FastKernel:
    """``FastKernel(jit_fn)[grid](*args, **kwargs)``: launch like ``jit_fn[grid](...)``, with a cached fast path."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        # Under TRITON_INTERPRET=1 the kernel is an InterpretedFunction: always Triton's own path.
        self._fast = isinstance(fn, JITFunction)
        params = list(inspect.signature(fn.fn).parameters.values())
        self._names = tuple(p.name for p in params)
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._constexpr = tuple(bool(p.is_constexpr) for p in fn.params) if self._fast else ()
        self._compiled: dict[tuple, Any] = {}  # (device, key) -> CompiledKernel, like Triton's own cache

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._fast or _launch_hooks_set():
            self.fn[grid](*args, **kwargs)
            return
        try:
            values = list(args)
            for name in self._names[len(args):]:
                values.append(kwargs[name] if name in kwargs else self._defaults[name])
            options = {k: v for k, v in kwargs.items() if k not in self._names}
            key = (torch.cuda.current_device(), specialization_key(values, self._constexpr, options))
        except (_Unkeyable, KeyError):
            self.fn[grid](*args, **kwargs)
            return
        compiled = self._compiled.get(key)
        if compiled is None:  # first launch of this specialisation: Triton compiles and launches it
            compiled = self.fn[grid](*args, **kwargs)
            if compiled is not None:
                self._compiled[key] = compiled
            return
        g = tuple(grid) + (1,) * (3 - len(grid))
        compiled[g](*values, stream=torch.cuda.current_stream().cuda_stream)


def _launch_hooks_set() -> bool:
    """Whether a profiler (e.g. Triton's proton) hooks launches: then every launch goes through Triton."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - older Triton has no knobs; never take the fast path there
        return True
    return knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None
