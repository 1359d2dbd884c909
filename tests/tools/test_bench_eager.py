"""`fp8linear bench --eager` (fp8linear.tools.bench_eager) on the CPU: rows, pairing and the table."""

from __future__ import annotations

import pytest
import torch

from fp8linear.tools import bench_eager


@pytest.mark.parametrize("ms", [(1,), (1, 3)])
def test_measure_eager_times_both_methods_per_case_interleaved(ms, monkeypatch):
    monkeypatch.setattr(bench_eager, "_BURST", 3)
    monkeypatch.setattr(bench_eager, "_BURSTS", 3)
    order: list[str] = []
    real = bench_eager._burst_times

    def spy(methods, xs, device):
        order.extend(methods)
        return real(methods, xs, device)

    monkeypatch.setattr(bench_eager, "_burst_times", spy)
    rows = bench_eager.measure_eager([(256, 384)], ms, "cpu")
    assert [(r.m, r.method) for r in rows] == [(m, name) for m in ms for name in ("ours", "bf16")]
    assert order == ["ours", "bf16"] * len(ms)  # one interleaved measurement per (shape, M)
    for r in rows:
        assert (r.n, r.k) == (256, 384) and r.wall_us > 0 and r.host_us > 0 and r.py_calls > 0
        assert r.gpu_us is None and r.kernels is None  # no GPU here
    table = bench_eager.format_eager(rows).splitlines()
    assert len(table) == 2 + len(ms) and all("256x384" in line for line in table[2:])


def test_burst_times_interleave_methods_round_by_round(monkeypatch):
    monkeypatch.setattr(bench_eager, "_BURST", 2)
    monkeypatch.setattr(bench_eager, "_BURSTS", 4)
    calls: list[str] = []
    methods = {"a": lambda x: calls.append("a"), "b": lambda x: calls.append("b")}
    times = bench_eager._burst_times(methods, [torch.zeros(1)] * 3, torch.device("cpu"))
    assert set(times) == {"a", "b"} and all(w >= h > 0 for w, h in times.values())
    bursts = [calls[i] for i in range(6, len(calls), 2)]  # after 3 warm-up calls each, one entry per burst
    assert bursts == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_experts_rows_gpu_only_and_labelled():
    """Without a GPU no experts rows; with them, the table labels experts apart from a linear of the same N x K."""
    assert bench_eager.measure_eager_experts(device="cpu") == []
    rows = [bench_eager.EagerRow(7168, 2048, 1, name, 10.0, 9.0, None, None, 5, what)
            for what in ("linear", "experts") for name in ("ours", "bf16")]
    table = bench_eager.format_eager(rows).splitlines()
    assert len(table) == 4 and "experts 7168x2048" in table[3] and "experts" not in table[2]


def test_every_burst_is_timed_before_any_detail_column(monkeypatch):
    """The profiler and tracer columns run after every timed burst of the run (CUPTI's callbacks stay
    attached once torch.profiler traced CUDA and slow later launches), linear cases and experts alike."""
    monkeypatch.setattr(bench_eager, "_BURST", 2)
    monkeypatch.setattr(bench_eager, "_BURSTS", 2)
    events: list[str] = []
    real_burst, real_py = bench_eager._burst_times, bench_eager._py_calls
    monkeypatch.setattr(bench_eager, "_burst_times", lambda *a: events.append("burst") or real_burst(*a))
    monkeypatch.setattr(bench_eager, "_py_calls", lambda *a: events.append("detail") or real_py(*a))
    expert_rows = [bench_eager.EagerRow(1, 1, 1, name, 1.0, 1.0, None, None, 0, "experts") for name in ("ours", "bf16")]

    def fake_experts(tokens, device, log):
        events.append("burst")
        return expert_rows, [lambda: events.append("detail")]

    monkeypatch.setattr(bench_eager, "_time_experts", fake_experts)
    args = type("Args", (), {"threads": None, "shapes": ["256,384"], "m": [1, 3], "device": "cpu", "json": True})()
    assert bench_eager.run_eager(args) == 0
    assert events.count("burst") == 3 and events.count("detail") == 5  # 2 linear cases x 2 methods, experts
    assert events.index("detail") > max(i for i, e in enumerate(events) if e == "burst")
    rows = bench_eager.measure_eager([(256, 384)], (1, 3), "cpu")
    assert all(r.py_calls > 0 for r in rows)


@pytest.mark.parametrize("text,shape", [("2112,7168", (2112, 7168)), ("2112x7168", (2112, 7168))])
def test_eager_shapes_take_the_bench_forms_and_refuse_others_clearly(monkeypatch, text, shape):
    """--shapes takes 'N,K' or 'NxK' as the other bench modes do; anything else is a ValueError
    naming the form, before anything is timed."""
    import argparse

    seen = []

    def fake_time_linear(shapes, ms, device, granularity, log):
        seen.append(list(shapes))
        raise RuntimeError("stop after parsing")

    monkeypatch.setattr(bench_eager, "_time_linear", fake_time_linear)
    args = argparse.Namespace(threads=None, shapes=[text], device="cpu", json=True, m=[1])
    with pytest.raises(RuntimeError, match="stop after parsing"):
        bench_eager.run_eager(args)
    assert seen == [[shape]]
    for bad in ("2112", "2112x7168x1", "ax7168"):
        with pytest.raises(ValueError, match="a shape is 'N,K'"):
            bench_eager.run_eager(argparse.Namespace(threads=None, shapes=[bad], device="cpu", json=True, m=[1]))
