"""Timing helpers of the benchmark and the tuner: operand sets rotated past the L2 cache, CUDA-graph
replays sampled in interleaved rounds (one sample of each method per round)."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Round", "l2_bytes", "n_sets", "clone_set", "prepare_cuda", "time_rounds", "time_graph", "rotation_sets"]

# L2 size if the device does not report it (H100 and H200: 50 MB).
_DEFAULT_L2_BYTES = 50 * 2**20
# One pass over the rotated operand sets reads at least this many times the L2 size.
_ROTATE_L2_FACTOR = 2
# Cap on rotated copies (small weights): 64 sets of the smallest shape already exceed 2x L2.
_MAX_SETS = 64
# A captured graph runs about this long (µs), with between _MIN_CALLS and _MAX_CALLS calls:
# long enough that event resolution (~0.5 µs) and replay launch (~5 µs) vanish, short
# enough that capture stays cheap.
_TARGET_GRAPH_US = 4000.0
_MIN_CALLS = 8
_MAX_CALLS = 400
# Operands smaller than this are not cloned for rotation (they stay L2-resident in serving too).
_CLONE_MIN_BYTES = 256 * 1024


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or _DEFAULT_L2_BYTES)


def n_sets(bytes_per_set: int, l2: int) -> int:
    if l2 <= 0:
        return 1
    return max(1, min(_MAX_SETS, math.ceil(_ROTATE_L2_FACTOR * l2 / max(1, bytes_per_set))))


# Each method is first prepared (warmed up and, for the 'graph' timer, captured in a CUDA graph);
# then the methods of one (shape, M) are timed in interleaved rounds, one sample each per round,
# starting each round one method further on. Timed one after another, later methods ran at
# other clocks: on H100, ours (which hands these GEMMs to the same cuBLAS call) measured
# 1.03-1.24x cuBLAS's time right after it, while the two alternating took 218.0/219.2 us.
Round = Callable[[], float]  # one timed sample: µs per call


def _prepare_events(fn: Callable[..., Any], sets: Sequence[tuple], calls: int) -> Round:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def one_round() -> float:
        start.record()
        for i in range(calls):
            fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / calls

    return one_round


def prepare_cuda(fn: Callable[..., Any], sets: Sequence[tuple], warmup: int, graph_timer: bool,
                 target_us: float = _TARGET_GRAPH_US) -> tuple[Round, str]:
    """Warm `fn` up over `sets`, then capture a CUDA graph of whole passes over them (CUDA events
    where `graph_timer` is False or capture fails); returns one timed round and the timer used."""
    n = len(sets)
    # Warm up on a side stream (compiles Triton kernels, creates cuBLAS handles/workspaces):
    # what torch.cuda.graphs asks for before capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(max(warmup, n)):
            fn(*sets[i % n])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # Eager estimate (an upper bound: includes launch overhead) sizes the graph.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(n):
        fn(*sets[i])
    end.record()
    end.synchronize()
    est_us = max(start.elapsed_time(end) * 1e3 / n, 0.5)
    calls = min(_MAX_CALLS, max(_MIN_CALLS, n, math.ceil(target_us / est_us)))
    calls = max(n, calls - calls % n)  # whole passes over the sets
    if not graph_timer:
        return _prepare_events(fn, sets, calls), "events"
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(*sets[i % n])
    except RuntimeError as e:
        print(f"    CUDA-graph capture failed ({str(e).splitlines()[0][:100]}); timing with events", file=sys.stderr)
        del graph
        torch.cuda.synchronize()
        return _prepare_events(fn, sets, calls), "events"
    graph.replay()
    torch.cuda.synchronize()
    return _GraphRound(graph, calls, (fn, sets)), "graph"


class _GraphRound:
    """One timed replay of a captured graph. It owns what the graph reads (the operand sets, fn's
    workspace): capturing the next method's graph empties the allocator's cache, which would
    otherwise hand their memory back to the driver under the graph."""

    def __init__(self, graph: torch.cuda.CUDAGraph, calls: int, keep_alive: tuple) -> None:
        self.graph, self.calls, self.keep_alive = graph, calls, keep_alive
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __call__(self) -> float:
        self.start.record()
        self.graph.replay()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) * 1e3 / self.calls


def time_rounds(rounds: Mapping[str, Round], replays: int) -> dict[str, float]:
    """Median µs per call of each prepared method, sampled in `replays` interleaved rounds."""
    names = list(rounds)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(replays):
        first = r % max(1, len(names))
        for name in names[first:] + names[:first]:
            samples[name].append(rounds[name]())
    return {name: statistics.median(v) for name, v in samples.items()}


def time_graph(fn: Callable[..., Any], sets: Sequence[tuple], warmup: int = 3, replays: int = 5) -> float:
    """Median µs per call of `fn` over rotated operand `sets`, from CUDA-graph replays (the
    benchmark's timer, also used by `fp8linear tune`)."""
    one_round, _ = prepare_cuda(fn, sets, warmup, graph_timer=True)
    return time_rounds({"fn": one_round}, replays)["fn"]


def rotation_sets(args: tuple, bytes_per_set: int, device: torch.device) -> list[tuple]:
    """`args` plus enough copies at new addresses that one pass over them reads more than twice
    the L2 cache (tensors below 256 KiB are shared, not copied)."""
    return [args] + [clone_set(args) for _ in range(n_sets(bytes_per_set, l2_bytes(device)) - 1)]


def clone_set(args: tuple) -> tuple:
    """A copy of one operand set at new addresses; tensors below _CLONE_MIN_BYTES (scales, decode
    activations: L2-resident in serving too) are shared, strides are kept as cuBLAS checks them, and a
    view is copied with the tensor it views (so padding rows past a view's end stay in its storage)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.numel() * a.element_size() >= _CLONE_MIN_BYTES:
            if a._base is not None:  # a view (the first M rows of a padded buffer): copy the buffer, view it again
                out.append(a._base.clone().as_strided(a.size(), a.stride(), a.storage_offset()))
                continue
            c = a.clone()  # preserve_format: dense tensors keep their strides
            out.append(c if c.stride() == a.stride() else a)
        else:
            out.append(a)
    return tuple(out)
