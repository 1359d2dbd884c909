"""Eager-mode cost of one FP8 linear against BF16 `nn.Linear` (`fp8linear bench --eager`).

Most users call a model without torch.compile or CUDA graphs; then each layer's host work
(Python, argument checks, kernel launches, allocations) adds up with the GPU work. Per weight
shape and batch M this reports, for ``Fp8BlockLinear`` (``ours``) and a BF16 ``nn.Linear``:

=============  ==============================================================================
``wall_us``    many calls back to back, one synchronisation at the end, wall time per call
``host_us``    the same burst's enqueue time per call (before the synchronisation)
``gpu_us``     one call replayed in a CUDA graph (GPU time only; no launch overhead)
``kernels``    GPU kernels (and memsets) one call launches (torch.profiler)
``py_calls``   Python function calls one forward makes (``sys.setprofile``)
=============  ==============================================================================

and the ratio ``ours / bf16`` of wall time. On a GPU with transformers installed it also times the
routed experts (``Fp8Experts`` against transformers' BF16 ``DeepseekV3Experts`` with its
``grouped_mm`` implementation, DeepSeek-V3 widths)
at EAGER_EXPERT_TOKENS tokens (rows ``what="experts"``, N x K = hidden x intermediate, M = tokens). Every call of a burst reads a different input
(rotated over enough copies to exceed the L2 cache on a GPU). Without a GPU it runs on the CPU
with the given thread count (wall = host; no GPU columns).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .shapes import parse_shape

__all__ = ["EAGER_EXPERTS", "EAGER_EXPERT_TOKENS", "EAGER_SHAPES", "EAGER_MS", "EagerRow", "interleaved_wall_us",
           "measure_eager", "measure_eager_experts", "format_eager", "run_eager"]

# DeepSeek-V3 linear shapes (N, K) of the eager-mode targets: q_a/kv_a-like, wide q_b, expert-width down.
EAGER_SHAPES = ((2112, 7168), (24576, 1536), (7168, 2048))
EAGER_MS = (1, 8, 64, 512)
# Routed experts of the eager targets: hidden, intermediate, experts, top-k (DeepSeek-V3 widths with
# 32 experts, as benchmarks/bench_moe.py), at these token counts.
EAGER_EXPERTS = (7168, 2048, 32, 8)
EAGER_EXPERT_TOKENS = (1, 8, 64)
# Calls per timed burst: far below the CUDA launch queue (~1000 entries), so enqueueing never waits.
_BURST = 50
_BURSTS = 11


@dataclass
class EagerRow:
    n: int
    k: int
    m: int
    method: str  # "ours" or "bf16"
    wall_us: float
    host_us: float
    gpu_us: float | None
    kernels: int | None
    py_calls: int
    what: str = "linear"  # or "experts"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _burst_times(methods: dict[str, Callable[[torch.Tensor], Any]], xs: Sequence[torch.Tensor],
                 device: torch.device) -> dict[str, tuple[float, float]]:
    """Per method (wall us per call, enqueue us per call): medians over bursts of back-to-back
    calls, the methods' bursts interleaved round by round so that host drift reaches them alike."""
    for fn in methods.values():
        for x in xs[:3]:
            fn(x)
    _sync(device)
    walls: dict[str, list[float]] = {name: [] for name in methods}
    hosts: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(_BURSTS):
        names = list(methods)
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = methods[name]
            t0 = time.perf_counter()
            for i in range(_BURST):
                fn(xs[i % len(xs)])
            t1 = time.perf_counter()
            _sync(device)
            t2 = time.perf_counter()
            hosts[name].append((t1 - t0) / _BURST * 1e6)
            walls[name].append((t2 - t0) / _BURST * 1e6)
    return {name: (statistics.median(walls[name]), statistics.median(hosts[name])) for name in methods}


def interleaved_wall_us(methods: dict[str, Callable[[torch.Tensor], Any]], xs: Sequence[torch.Tensor],
                       rounds: int = 9, calls: int = 40) -> dict[str, float]:
    """Median wall us per call of each method over bursts of back-to-back calls (one synchronisation
    per burst), the methods' bursts interleaved round by round so machine drift reaches them alike."""
    device = xs[0].device
    for fn in methods.values():
        for x in xs[:3]:
            fn(x)
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            for i in range(calls):
                fn(xs[i % len(xs)])
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def _gpu_us(fn: Callable[[torch.Tensor], Any], xs: Sequence[torch.Tensor]) -> float | None:
    """GPU time per call: a CUDA graph of one pass over the inputs, replayed; None if capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for x in xs:
                fn(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in xs:
                fn(x)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(xs))
        return statistics.median(times)
    except RuntimeError:
        return None


def _kernels(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> int | None:
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x)
            torch.cuda.synchronize()
    except RuntimeError:
        return None
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _py_calls(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> int:
    count = [0]

    def tracer(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(tracer)
    try:
        fn(x)
    finally:
        sys.setprofile(None)
    return max(count[0] - 1, 0)  # not the lambda itself


def _device(device: str | torch.device | None) -> torch.device:
    """The device asked for, else the GPU where there is one, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _details(rows: Sequence[EagerRow], methods: dict[str, Callable[[Any], Any]],
             make_inputs: Callable[[], Sequence[Any]], gpu: bool) -> Callable[[], None]:
    """A call that fills the rows' GPU-time, kernel and Python-call columns (graph capture, the
    profiler, a Python tracer). Run after every timed burst of a run: once torch.profiler has traced
    CUDA activity, CUPTI's callbacks stay attached and add host time to every later launch and
    driver call, ours (several driver calls per forward) more than BF16's."""
    def fill() -> None:
        inputs = make_inputs()  # made here: the timed bursts' inputs are not held until the end
        with torch.inference_mode():
            for row in rows:
                fn = methods[row.method]
                row.gpu_us = _gpu_us(fn, inputs) if gpu else None
                row.kernels = _kernels(fn, inputs[0]) if gpu else None
                row.py_calls = _py_calls(fn, inputs[0])
    return fill


def _time_linear(shapes: Sequence[tuple[int, int]], ms: Sequence[int], device: torch.device, granularity: str,
                 log: Callable[[str], None] | None) -> tuple[list[EagerRow], list[Callable[[], None]]]:
    from ..module import Fp8BlockLinear

    gpu = device.type == "cuda"
    rows: list[EagerRow] = []
    fills: list[Callable[[], None]] = []
    for n, k in shapes:
        lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        ours = Fp8BlockLinear.from_linear(lin, granularity)
        methods: dict[str, Callable[[torch.Tensor], Any]] = {"ours": ours, "bf16": lin}
        for m in ms:
            copies = max(2, min(64, (100 << 20) // max(1, m * k * 2))) if gpu else 2  # > 2x a 50 MB L2
            def make_inputs(m: int = m, k: int = k, copies: int = copies) -> list[torch.Tensor]:
                return [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]

            xs = make_inputs()
            with torch.inference_mode():
                times = _burst_times(methods, xs, device)
            del xs
            pair = [EagerRow(n, k, m, name, *times[name], None, None, 0) for name in methods]
            rows += pair
            fills.append(_details(pair, methods, make_inputs, gpu))
            if log:
                log(f"{n}x{k} M={m}: ours {pair[0].wall_us:.1f} us, bf16 {pair[1].wall_us:.1f} us")
    return rows, fills


def measure_eager(shapes: Sequence[tuple[int, int]] = EAGER_SHAPES, ms: Sequence[int] = EAGER_MS,
                  device: str | torch.device | None = None, granularity: str = "block",
                  log: Callable[[str], None] | None = None) -> list[EagerRow]:
    """Rows of both methods for every (shape, M), each (shape, M) timed as one interleaved pair; the
    GPU-time, kernel and Python-call columns after every burst (see :func:`_details`)."""
    rows, fills = _time_linear(shapes, ms, _device(device), granularity, log)
    for fill in fills:
        fill()
    return rows


def _time_experts(tokens: Sequence[int], device: torch.device, log: Callable[[str], None] | None
                  ) -> tuple[list[EagerRow], list[Callable[[], None]]]:
    if device.type != "cuda":
        return [], []
    try:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    except ImportError:
        return [], []
    from ..integrations.experts import Fp8Experts

    hidden, inter, experts, top_k = EAGER_EXPERTS
    cfg = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                           num_experts_per_tok=top_k, n_group=1, topk_group=1)
    cfg._experts_implementation = "grouped_mm"  # what a loaded model runs (a bare config gets the per-expert loop)
    with device:
        bf16 = DeepseekV3Experts(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        bf16.gate_up_proj.normal_(0, 0.02)
        bf16.down_proj.normal_(0, 0.02)
    methods: dict[str, Callable[[Any], Any]] = {"ours": lambda a, f=Fp8Experts.from_experts(bf16): f(*a),
                                                "bf16": lambda a: bf16(*a)}
    rows: list[EagerRow] = []
    fills: list[Callable[[], None]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for t in tokens:
        inputs = []
        for _ in range(8):
            x = torch.randn(t, hidden, device=device, generator=gen).to(torch.bfloat16)
            w, idx = torch.topk(torch.randn(t, experts, device=device, generator=gen).softmax(-1), top_k, dim=-1)
            inputs.append((x, idx, w))
        with torch.inference_mode():
            times = _burst_times(methods, inputs, device)
        pair = [EagerRow(hidden, inter, t, name, *times[name], None, None, 0, "experts") for name in methods]
        rows += pair
        fills.append(_details(pair, methods, lambda inputs=inputs: inputs, True))  # a few small inputs: kept
        if log:
            log(f"experts {hidden}x{inter} tokens={t}: ours {pair[0].wall_us:.1f} us, bf16 {pair[1].wall_us:.1f} us")
    return rows, fills


def measure_eager_experts(tokens: Sequence[int] = EAGER_EXPERT_TOKENS, device: str | torch.device | None = None,
                          log: Callable[[str], None] | None = None) -> list[EagerRow]:
    """Rows of Fp8Experts ("ours") and transformers' BF16 DeepseekV3Experts ("bf16") per token count;
    none without a GPU or transformers. The detail columns after every burst (see :func:`_details`)."""
    rows, fills = _time_experts(tokens, _device(device), log)
    for fill in fills:
        fill()
    return rows


def format_eager(rows: Sequence[EagerRow]) -> str:
    def f(v: float | int | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = (f"{'N x K':>17s} {'M':>5s} | {'wall us':>15s} {'ours/bf16':>9s} | {'host us':>15s} | {'gpu us':>15s} |"
            f" {'kernels':>7s} | {'py calls':>8s}")
    lines = [head, f"{'':>23s} | {'ours':>7s} {'bf16':>7s} {'':>9s} | {'ours':>7s} {'bf16':>7s} | {'ours':>7s} {'bf16':>7s} |"
                   f" {'o/b':>7s} | {'o/b':>8s}"]
    pairs = {}
    for r in rows:
        pairs.setdefault((r.what, r.n, r.k, r.m), {})[r.method] = r
    for (what, n, k, m), p in pairs.items():
        o, b = p["ours"], p["bf16"]
        label = f"{n}x{k}" if what == "linear" else f"{what} {n}x{k}"
        lines.append(
            f"{label:>17s} {m:5d} | {o.wall_us:7.1f} {b.wall_us:7.1f} {o.wall_us / b.wall_us:9.2f} |"
            f" {o.host_us:7.1f} {b.host_us:7.1f} | {f(o.gpu_us, '7.1f'):>7s} {f(b.gpu_us, '7.1f'):>7s} |"
            f" {f(o.kernels, 'd'):>3s}/{f(b.kernels, 'd'):<3s} | {o.py_calls:4d}/{b.py_calls:<3d}")
    return "\n".join(lines)


def add_eager_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eager", action="store_true",
                        help="eager-mode cost per call of Fp8BlockLinear vs BF16 nn.Linear (host, GPU, launches)")
    parser.add_argument("--json", action="store_true", help="with --eager: print the rows as JSON")
    parser.add_argument("--threads", type=int, default=None, help="with --eager on a CPU: torch threads")


def run_eager(args: argparse.Namespace) -> int:
    """`fp8linear bench --eager [--shapes N,K ...] [--m M ...] [--json]`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    # 'N,K' or 'NxK', with the grid's and bench's clear error on anything else
    shapes = [(s.n, s.k) for s in map(parse_shape, args.shapes)] if args.shapes else EAGER_SHAPES
    device = _device(args.device)
    log = None if args.json else print
    # every burst first, then the detail columns (the profiler slows later launches: _details)
    rows, fills = _time_linear(shapes, tuple(args.m) if args.m else EAGER_MS, device, "block", log)
    expert_rows, expert_fills = _time_experts(EAGER_EXPERT_TOKENS, device, log)
    rows += expert_rows
    for fill in fills + expert_fills:
        fill()
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads")
    import triton

    print(f"\n{where}, torch {torch.__version__}, triton {triton.__version__}; eager, bf16 input, 128x128 weights")
    print(format_eager(rows))
    return 0
