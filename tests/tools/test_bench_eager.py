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
