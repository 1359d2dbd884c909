"""CPU tests of the benchmark and the tuning infrastructure: formats, lookups, CLI, dry runs.

Nothing here times anything for real or asserts on speed; the bench runs on the reference
backend with a wall clock, the tuner on Triton's CPU interpreter (set up by conftest.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import warnings
from pathlib import Path

import pytest
import torch

from fp8linear.ops import config_tables as tables
from fp8linear.tools import bench, bench_cli, timing, tune
from fp8linear.cli import main as cli_main
from fp8linear.ops.configs import GemmConfig

from conftest import HAS_CUDA

DEVICE = "Fake GPU 80GB"

# DeepSeek-V3's config.json, trimmed to the fields that decide linear-layer shapes.
DSV3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
DSV3_SHAPES = {
    (1536, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384),
    (18432, 7168), (7168, 18432), (2048, 7168), (7168, 2048),
}


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Point the autotune cache and the shipped-table folder at empty temp folders."""
    monkeypatch.setenv(tables.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(tables.TABLE_ENV, raising=False)
    monkeypatch.setattr(tables, "_SHIPPED_DIR", tmp_path / "shipped")
    tables.clear_lookup_cache()
    yield tmp_path
    tables.clear_lookup_cache()


def cfg(bm: int, bn: int, warps: int = 4, stages: int = 4, bk: int = 128) -> GemmConfig:
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


# ----------------------------------------------------------------------------- table format
def test_table_round_trip(tmp_path):
    t = tables.ConfigTable(device=DEVICE, meta={"note": "test"})
    t.set(18432, 7168, 1, cfg(16, 64), us=50.5, heuristic_us=60.0, tried=7)
    t.set(18432, 7168, 4096, cfg(128, 256, 8, 3))
    t.set(576, 7168, 16, cfg(16, 32), granularity="row")
    path = tables.save_table(t, tmp_path / "t.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == tables.TABLE_FORMAT and raw["version"] == tables.TABLE_VERSION
    assert raw["device"] == DEVICE
    assert raw["shapes"]["18432,7168"]["1"]["us"] == 50.5
    assert "576,7168,row" in raw["shapes"]
    back = tables.load_table(path)
    assert back.to_json() == t.to_json()
    assert back.get(18432, 7168, 4096) == cfg(128, 256, 8, 3)
    assert back.get(576, 7168, 16, "row") == cfg(16, 32)
    assert back.get(576, 7168, 16) is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format="something-else"),
        lambda d: d.update(version=99),
        lambda d: d["shapes"]["1,2"].update({"3": d["shapes"]["1,2"]["1"]}),  # 3 is not a bucket
        lambda d: d["shapes"]["1,2"]["1"].update(block_m=48),  # not a power of two
        lambda d: d["shapes"]["1,2"]["1"].update(bogus=1),
        lambda d: d["shapes"].update({"1,2,diagonal": {}}),
    ],
)
def test_table_rejects_malformed(mutate):
    t = tables.ConfigTable(device=DEVICE)
    t.set(1, 2, 1, cfg(16, 32))
    data = json.loads(json.dumps(t.to_json()))
    mutate(data)
    with pytest.raises(ValueError):
        tables.ConfigTable.from_json(data)


def test_table_merge_and_device_check():
    a = tables.ConfigTable(device=DEVICE)
    a.set(1, 2, 1, cfg(16, 32))
    b = tables.ConfigTable(device=DEVICE)
    b.set(1, 2, 1, cfg(16, 64))
    b.set(1, 2, 2, cfg(16, 128))
    a.merge(b)
    assert a.get(1, 2, 1) == cfg(16, 64) and a.get(1, 2, 2) == cfg(16, 128)
    with pytest.raises(ValueError):
        a.merge(tables.ConfigTable(device="Other GPU"))


def test_table_filename():
    assert tables.table_filename("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert tables.table_filename("NVIDIA H200") == "NVIDIA_H200.json"
    with pytest.raises(ValueError):
        tables.table_filename("  ")


# ----------------------------------------------------------------------------- lookup
@pytest.mark.parametrize(
    "m, bucket",
    [(1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 32), (64, 64), (65, 128), (1000, 1024),
     (1024, 1024), (1025, 2048), (4096, 4096), (5000, 4096), (10**6, 4096)],
)
def test_m_bucket(m, bucket):
    assert tables.m_bucket(m) == bucket


def test_m_bucket_rejects_zero():
    with pytest.raises(ValueError):
        tables.m_bucket(0)


def _write_cache_table(device: str = DEVICE) -> tables.ConfigTable:
    t = tables.ConfigTable(device=device)
    t.set(18432, 7168, 4, cfg(16, 64, 4, 5))
    t.set(18432, 7168, 64, cfg(64, 64))
    t.set(18432, 7168, 4096, cfg(128, 128, 8, 4))
    tables.save_table(t, tables.cache_table_path(device))
    return t


def test_lookup_bucketing_and_neighbours(isolated):
    _write_cache_table()
    lk = tables.lookup_config
    assert lk(DEVICE, 3, 18432, 7168) == cfg(16, 64, 4, 5)  # bucket 4
    assert lk(DEVICE, 4, 18432, 7168) == cfg(16, 64, 4, 5)
    assert lk(DEVICE, 1, 18432, 7168) == cfg(16, 64, 4, 5)  # bucket 1 missing: 4 is 2 buckets away
    assert lk(DEVICE, 16, 18432, 7168) == cfg(64, 64)  # 16: 4 and 64 both 2 away, the larger M wins
    assert lk(DEVICE, 200, 18432, 7168) == cfg(64, 64)  # 256 -> 64 is 2 away
    assert lk(DEVICE, 512, 18432, 7168) is None  # nothing within 2 buckets of 512
    assert lk(DEVICE, 3000, 18432, 7168) == cfg(128, 128, 8, 4)
    assert lk(DEVICE, 100_000, 18432, 7168) == cfg(128, 128, 8, 4)
    assert lk(DEVICE, 64, 7168, 18432) is None  # unknown shape
    assert lk("Other GPU", 64, 18432, 7168) is None  # unknown device
    assert lk(DEVICE, 0, 18432, 7168) is None


def test_lookup_is_cached_and_read_only(isolated):
    _write_cache_table()
    tables.lookup_config(DEVICE, 4096, 18432, 7168)
    hits = tables._lookup.cache_info().hits
    a = tables.lookup_config(DEVICE, 4000, 18432, 7168)
    assert tables._lookup.cache_info().hits == hits + 1
    assert a is tables.lookup_config(DEVICE, 3000, 18432, 7168)
    assert not list((isolated / "cache").glob("*.tmp"))


def test_lookup_granularity_and_source_priority(isolated, monkeypatch):
    t = _write_cache_table()
    t.set(18432, 7168, 4096, cfg(64, 256, 8, 4), granularity="row")
    tables.save_table(t, tables.cache_table_path(DEVICE))
    assert tables.lookup_config(DEVICE, 4096, 18432, 7168, "row") == cfg(64, 256, 8, 4)
    assert tables.lookup_config(DEVICE, 4, 18432, 7168, "row") == cfg(16, 64, 4, 5)  # falls back to block
    # shipped table: used for shapes the cache lacks, overridden where the cache has them
    shipped = tables.ConfigTable(device=DEVICE)
    shipped.set(7168, 2048, 1, cfg(16, 32))
    shipped.set(18432, 7168, 4096, cfg(256, 128, 8, 3))
    tables.save_table(shipped, tables.shipped_table_path(DEVICE))
    assert tables.lookup_config(DEVICE, 1, 7168, 2048) == cfg(16, 32)
    assert tables.lookup_config(DEVICE, 4096, 18432, 7168) == cfg(128, 128, 8, 4)
    # an explicit $FP8LINEAR_GEMM_TABLE beats both
    env = tables.ConfigTable(device=DEVICE)
    env.set(18432, 7168, 4096, cfg(128, 64, 4, 6))
    monkeypatch.setenv(tables.TABLE_ENV, str(tables.save_table(env, isolated / "env.json")))
    tables.clear_lookup_cache()  # the environment is read on a cache miss
    assert tables.lookup_config(DEVICE, 4096, 18432, 7168) == cfg(128, 64, 4, 6)
    monkeypatch.setenv(tables.TABLE_ENV, "off")  # every table off: the caller's heuristic decides
    tables.clear_lookup_cache()
    assert tables.lookup_config(DEVICE, 4096, 18432, 7168) is None


def test_lookup_ignores_corrupt_cache(isolated):
    path = tables.cache_table_path(DEVICE)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert tables.lookup_config(DEVICE, 1, 18432, 7168) is None


# ----------------------------------------------------------------------------- atomic writes
def test_cache_dir_reads_the_deprecated_variable(tmp_path, monkeypatch):
    """$FP8LINEAR_CACHE_DIR names the cache; the older $FP8LINEAR_CACHE still works, with a warning."""
    monkeypatch.delenv(tables.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv(tables.DEPRECATED_CACHE_ENV, str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="FP8LINEAR_CACHE_DIR"):
        assert tables.cache_dir() == tmp_path / "old"
    monkeypatch.setenv(tables.CACHE_DIR_ENV, str(tmp_path / "new"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tables.cache_dir() == tmp_path / "new"


def test_save_table_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    good = tables.ConfigTable(device=DEVICE)
    good.set(1, 2, 1, cfg(16, 32))
    tables.save_table(good, path)
    before = path.read_bytes()

    def exploding_dump(obj, f, **kw):
        f.write('{"format": "fp8linear-gemm-co')  # a partial write, then failure
        raise OSError("disk full")

    monkeypatch.setattr(tables.json, "dump", exploding_dump)
    bad = tables.ConfigTable(device=DEVICE)
    bad.set(1, 2, 1, cfg(16, 64))
    with pytest.raises(OSError, match="disk full"):
        tables.save_table(bad, path)
    assert path.read_bytes() == before  # the old table is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no temp file left


def test_save_table_creates_folders_and_clears_lookup_cache(isolated):
    assert tables.lookup_config(DEVICE, 1, 18432, 7168) is None  # cached miss
    _write_cache_table()
    assert tables.lookup_config(DEVICE, 4, 18432, 7168) == cfg(16, 64, 4, 5)


# ----------------------------------------------------------------------------- candidates
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16, 17, 32, 33, 64])
def test_decode_heuristic_is_one_tile_of_rows_covering_m(m):
    """Untuned decode shapes: one 16/32/64-row tile covering M, 64 columns up to M=8, 32 above
    (what the graph-timed tuner picked on H100), never one 16x64 tile for every M."""
    from fp8linear.ops.router import heuristic_config

    cfg = heuristic_config(m, 4096, 2048)
    assert cfg.block_m == max(16, 1 << (m - 1).bit_length()) and cfg.block_m >= m
    assert cfg.block_n == (64 if m <= 8 else 32) and cfg.block_k == 128
    assert (cfg.num_warps, cfg.num_stages) == (4, 4)


def test_candidates_are_valid_and_start_with_the_heuristic():
    from fp8linear.ops.router import heuristic_config

    for m in (1, 16, 64, 256, 4096):
        cands = tune.candidate_configs(m, 18432, 7168)
        assert cands[0] == heuristic_config(m, 18432, 7168)
        assert len(set(cands)) == len(cands) > 3
        for c in cands[1:]:
            assert c.block_m * c.block_n // (32 * c.num_warps) <= 128  # accumulator fits in registers
            if m <= 16:
                assert c.block_m == 16
        refined = tune.refine_candidates(cands[:3])
        assert refined and not set(refined) & set(cands[:3])
        assert {c.block_k for c in refined} == {64, 128}
    assert {c.block_m for c in tune.candidate_configs(4096, 7168, 7168)} >= {64, 128, 256}
    assert {c.block_n for c in tune.candidate_configs(1, 7168, 7168)} >= {32, 64, 128}


def test_autotune_refuses_inside_compile(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="torch.compile"):
        tune.autotune_config(16, 128, 256, "cpu")


# ----------------------------------------------------------------------------- shapes
def test_hf_config_deepseek_v3(tmp_path):
    shapes = bench.shapes_from_hf_config(DSV3_CONFIG)
    assert {(s.n, s.k) for s in shapes} == DSV3_SHAPES
    assert len(shapes) == len(DSV3_SHAPES)
    names = {(s.n, s.k): s.name for s in shapes}
    assert "kv_b_proj" in names[(32768, 512)]
    assert "expert gate/up" in names[(2048, 7168)] and "shared expert gate/up" in names[(2048, 7168)]
    # from a file and from a model folder too; the defaults contain exactly these plus 6 extras
    (tmp_path / "config.json").write_text(json.dumps(DSV3_CONFIG))
    assert bench.shapes_from_hf_config(tmp_path) == shapes
    assert bench.shapes_from_hf_config(tmp_path / "config.json") == shapes
    defaults = {(s.n, s.k) for s in bench.default_shapes()}
    assert DSV3_SHAPES < defaults and len(defaults) == 15


def test_hf_config_other_models():
    llama = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
    assert [(s.n, s.k) for s in bench.shapes_from_hf_config(llama)] == [
        (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)
    ]  # q and o share (4096, 4096)
    mixtral = dict(llama, num_local_experts=8)
    assert {(s.n, s.k) for s in bench.shapes_from_hf_config(mixtral)} == {
        (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)
    }
    qwen3_moe = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "mlp_only_layers": [], "decoder_sparse_step": 1}
    got = {(s.n, s.k) for s in bench.shapes_from_hf_config(qwen3_moe)}
    assert got == {(4096, 2048), (512, 2048), (2048, 4096), (768, 2048), (2048, 768)}  # no dense MLP
    mla_no_qlora = dict(DSV3_CONFIG, q_lora_rank=None)
    got = {(s.n, s.k) for s in bench.shapes_from_hf_config(mla_no_qlora)}
    assert (24576, 7168) in got and (1536, 7168) not in got
    with pytest.raises(ValueError, match="hidden_size"):
        bench.shapes_from_hf_config({"model_type": "vision"})
    nested = {"text_config": llama, "vision_config": {"hidden_size": 1}}
    assert bench.shapes_from_hf_config(nested) == bench.shapes_from_hf_config(llama)


@pytest.mark.parametrize("text, nk", [("18432,7168", (18432, 7168)), ("576x7168", (576, 7168))])
def test_parse_shape(text, nk):
    s = bench.parse_shape(text)
    assert (s.n, s.k) == nk


@pytest.mark.parametrize("text", ["18432", "a,b", "0,7", "1,2,3"])
def test_parse_shape_rejects(text):
    with pytest.raises(ValueError):
        bench.parse_shape(text)


# ----------------------------------------------------------------------------- CLI parsing
def _parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_bench_arguments(tmp_path):
    c = bench_cli.build_config(_parse(bench_cli, ["--device", "cpu"]))
    assert len(c.shapes) == 15 and c.ms == bench.DECODE_MS + bench.PREFILL_MS
    assert c.methods == bench.METHODS and c.timer == "wall" and c.bias
    c = bench_cli.build_config(_parse(bench_cli, ["--quick", "--device", "cpu"]))
    assert len(c.shapes) == 5 and c.ms == bench.QUICK_MS
    c = bench_cli.build_config(_parse(bench_cli, ["--shapes", "256,512", "256x512", "128,128", "--m", "1", "3",
                                          "--methods", "bf16", "ours_block", "--no-bias", "--device", "cpu"]))
    assert [(s.n, s.k) for s in c.shapes] == [(256, 512), (128, 128)]
    assert c.ms == (1, 3) and c.methods == ("bf16", "ours_block") and not c.bias
    (tmp_path / "config.json").write_text(json.dumps(DSV3_CONFIG))
    c = bench_cli.build_config(_parse(bench_cli, ["--hf-config", str(tmp_path), "--device", "cpu"]))
    assert {(s.n, s.k) for s in c.shapes} == DSV3_SHAPES
    with pytest.raises(SystemExit):
        _parse(bench_cli, ["--methods", "nonsense"])
    with pytest.raises(ValueError):
        bench_cli.build_config(_parse(bench_cli, ["--device", "cpu", "--timer", "graph"]))


def test_tune_arguments(tmp_path):
    a = _parse(tune, ["--shapes", "18432,7168", "576,7168", "--m", "1", "4096", "--out", str(tmp_path / "t.json"),
                        "--budget-s", "5", "--granularity", "row"])
    assert a.shapes == ["18432,7168", "576,7168"] and a.m == [1, 4096] and a.budget_s == 5
    assert a.granularity == "row"
    assert [(n, k) for n, k, _ in tune._resolve_shapes(a)] == [(18432, 7168), (576, 7168)]
    d = _parse(tune, [])
    assert len(tune._resolve_shapes(d)) == 15 and d.m is None


def test_benchmark_config_validation():
    s = (bench.Shape(128, 128),)
    with pytest.raises(ValueError):
        bench.BenchConfig(shapes=(), ms=(1,), device="cpu", timer="wall")
    with pytest.raises(ValueError):
        bench.BenchConfig(shapes=s, ms=(0,), device="cpu", timer="wall")
    with pytest.raises(ValueError):
        bench.BenchConfig(shapes=s, ms=(1,), methods=("magic",), device="cpu", timer="wall")
    with pytest.raises(ValueError):
        bench.Shape(0, 128)


# ----------------------------------------------------------------------------- summaries
def _rows(times: dict[tuple[int, int, int, str], float]) -> list[bench.BenchRow]:
    return [bench.BenchRow(shape="", n=n, k=k, m=m, method=meth, status="ok", us=us)
            for (n, k, m, meth), us in times.items()]


def test_summary_math():
    t = {}
    for n, k in ((18432, 7168), (7168, 256)):
        for m in (1, 4096):
            t[(n, k, m, "bf16")] = 200.0
            t[(n, k, m, "cublas_tensor")] = 80.0
            t[(n, k, m, "ours_block")] = 100.0
            t[(n, k, m, "ours_row")] = 104.0
            t[(n, k, m, "ours_forward")] = 102.0 if m == 1 else 110.0
    t[(18432, 7168, 4096, "cublas_block")] = 125.0  # cuBLAS refuses K=256: no entry there
    rows = _rows(t)
    rows.append(bench.BenchRow(shape="", n=7168, k=256, m=4096, method="cublas_block", status="refused"))
    s = bench.summarize(rows)
    assert s["prefill_ours_over_cublas_block"]["value"] == pytest.approx(0.8)
    assert s["prefill_ours_over_cublas_block"]["cases"] == 1 and s["prefill_ours_over_cublas_block"]["pass"]
    assert s["prefill_ours_over_per_tensor"]["value"] == pytest.approx(1.25)
    assert s["prefill_ours_over_per_tensor"]["pass"] is False
    assert s["prefill_min_speedup_vs_bf16"]["value"] == pytest.approx(2.0)
    assert s["prefill_min_speedup_vs_bf16"]["cases"] == 2  # both shape classes, refused or not
    assert s["decode_ours_over_per_tensor"]["value"] == pytest.approx(1.25)
    big = 18432 * 7168
    assert s["decode_m1_weight_tbps_min"]["value"] == pytest.approx(big / 100.0 * 1e-6)
    assert s["decode_m1_weight_tbps_min"]["cases"] == 1  # 7168x256 is below 64M elements
    assert s["prefill_row_over_block"]["value"] == pytest.approx(1.04) and s["prefill_row_over_block"]["pass"]
    assert s["decode_row_over_block"]["pass"] is True
    assert s["prefill_forward_over_gemm"]["value"] == pytest.approx(1.10)
    assert s["decode_forward_minus_gemm_us_max"]["value"] == pytest.approx(2.0)
    text = bench.format_summary(s)
    assert "PASS" in text and "MISS" in text
    assert bench.summarize([])["prefill_ours_over_cublas_block"]["value"] is None
    assert "n/a" in bench.format_summary(bench.summarize([]))


# ----------------------------------------------------------------------------- dry runs
def test_bench_dry_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli_main(["bench", "--shapes", "256,384", "--m", "1", "130", "--device", "cpu", "--backend", "reference",
                   "--replays", "1", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "(N=256, K=384)" in printed and "Speed targets" in printed
    data = json.loads((out / "bench_gemm.json").read_text())
    assert data["meta"]["torch"] == torch.__version__ and "timestamp" in data["meta"] and "gpu" in data["meta"]
    rows = {(r["m"], r["method"]): r for r in data["rows"]}
    assert len(rows) == 2 * len(bench.METHODS)
    for m in (1, 130):
        assert rows[(m, "cublas_block")]["status"] == "refused"  # no CUDA here
        for meth in ("bf16", "bf16_linear", "ours_block", "ours_row", "ours_forward"):
            r = rows[(m, meth)]
            assert r["status"] == "ok" and r["us"] > 0 and r["tflops"] > 0 and r["gbps"] > 0
            assert r["rel_err"] < (0.01 if meth.startswith("bf16") else 0.06)
            # the forward (bias included) against a BF16 nn.Linear with the bias, the GEMMs against the BF16 GEMM
            base = "bf16_linear" if meth == "ours_forward" else "bf16"
            assert math.isclose(r["speedup_vs_bf16"], rows[(m, base)]["us"] / r["us"])
    csv_lines = (out / "bench_gemm.csv").read_text().splitlines()
    assert csv_lines[0].startswith("shape,n,k,m,method,status,us") and len(csv_lines) == 1 + len(rows)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "bench_gemm.png").stat().st_size > 1000


@pytest.mark.parametrize("replays", [1, 3, 4, 7])
def test_methods_are_timed_in_interleaved_rounds(replays):
    """Every method gets one sample per round, rounds start one method further on, and the
    reported time is the median of that method's own samples."""
    calls: list[str] = []

    def sampler(name: str, values: list[float]):
        it = iter(values)
        return lambda: (calls.append(name), next(it))[1]

    values = {"a": [5.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0], "b": [10.0] * 7, "c": [float(i) for i in range(7)]}
    medians = timing.time_rounds({n: sampler(n, v) for n, v in values.items()}, replays)
    rounds = [calls[3 * r: 3 * r + 3] for r in range(replays)]
    assert len(calls) == 3 * replays and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert [r[0] for r in rounds] == ["abc"[r % 3] for r in range(replays)]
    for name, v in values.items():
        assert medians[name] == statistics.median(v[:replays])


def test_bench_times_every_method_of_a_case_together(monkeypatch):
    """_measure_shape prepares all methods of one M first, then samples them in shared rounds."""
    events: list[tuple[str, str]] = []
    real_prepare = bench._prepare

    def spy_prepare(fn, sets, cfg):
        one_round, used = real_prepare(fn, sets, cfg)
        events.append(("prepare", ""))
        return (lambda: (events.append(("round", "")), one_round())[1]), used

    monkeypatch.setattr(bench, "_prepare", spy_prepare)
    cfg = bench.BenchConfig(shapes=(bench.Shape(256, 384, "t"),), ms=(2,), device="cpu", timer="wall",
                            backend="reference", replays=3, methods=("bf16", "ours_block", "ours_row"))
    rows = bench.run_benchmark(cfg, log=lambda s: None).rows
    assert [r.status for r in rows] == ["ok"] * 3
    assert [e[0] for e in events] == ["prepare"] * 3 + ["round"] * 9


@pytest.mark.gpu
def test_bench_on_the_gpu_with_graphs():
    """Every method of every case captured in its graph, replayed in interleaved rounds: each
    graph keeps its operands alive while the next ones are captured (which empties the cache)."""
    cfg = bench.BenchConfig(shapes=(bench.Shape(1536, 7168, "a"), bench.Shape(576, 2048, "b")), ms=(1, 16, 1024),
                            replays=3)
    rows = bench.run_benchmark(cfg, log=lambda s: None).rows
    assert len(rows) == 2 * 3 * len(bench.METHODS)
    for r in rows:
        if r.method == "cublas_block" and r.status == "refused":
            continue
        assert r.status == "ok", (r.shape, r.m, r.method, r.note)
        assert r.us > 0 and r.rel_err < (0.01 if r.method in ("bf16",) else 0.06), (r.shape, r.m, r.method)
    # our rows name the route that ran: the router's, in tune-routes' labels (triton: none of cuBLAS's)
    from fp8linear.ops.route_table import route_label
    from fp8linear.ops.router import route_gemm

    ours = {(r.n, r.m, r.method): r.config for r in rows if r.method in ("ours_block", "triton_block")}
    for (n, m, method), label in ours.items():
        k = 7168 if n == 1536 else 2048
        route = route_gemm(torch.device("cuda"), m, n, k, "block", torch.float8_e4m3fn, torch.bfloat16, None,
                           method == "ours_block", True, True)
        assert label == route_label(route.kernel, route.config) + (":pdl" if route.pdl else ""), (n, m, method)
        assert method == "ours_block" or not label.startswith(("cublas", "cutlass")), (n, m, label)


@pytest.mark.gpu
def test_tune_times_with_graphs_over_rotated_weights(monkeypatch):
    """On a GPU the tuner times candidates with the benchmark's graph timer, cycling over weight
    copies that exceed the L2 (here 4 MB of weight: many copies)."""
    seen: list[int] = []
    real = timing.time_graph

    def spy(fn, sets, *a, **kw):
        seen.append(len(sets))
        return real(fn, sets, *a, **kw)

    monkeypatch.setattr(timing, "time_graph", spy)
    res = tune.tune_shape(576, 7168, ms=(16,), device="cuda", max_candidates=3, budget_s=60)
    assert len(res) == 1 and res[0].tried >= 1 and 0 < res[0].us < 1000 and res[0].heuristic_us is not None
    assert seen and all(n_sets * 576 * 7168 >= 2 * timing.l2_bytes(torch.device("cuda")) for n_sets in seen)


def test_tune_always_times_the_heuristic_and_the_current_entry(isolated, monkeypatch):
    """Even with no time left, a re-tune times the heuristic and the config the tables already
    hold for the bucket, so it never replaces an entry with an untried worse one."""
    from fp8linear.ops.router import heuristic_config

    current = GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=2)
    assert current != heuristic_config(3, 128, 256)
    monkeypatch.setattr(tune, "lookup_config", lambda dev, m, n, k, g="block": current)
    timed: list[GemmConfig] = []
    real_gemm = __import__("fp8linear.ops.gemm", fromlist=["block_fp8_gemm"]).block_fp8_gemm

    def spy(*args, config=None, **kw):
        timed.append(config)
        return real_gemm(*args, config=config, **kw)

    monkeypatch.setattr("fp8linear.ops.gemm.block_fp8_gemm", spy)
    # where the kernels run: the GPU, or the CPU interpreter (conftest sets it without a GPU)
    res = tune.tune_shape(128, 256, ms=(3,), device="cuda" if HAS_CUDA else "cpu", budget_s=0.0, max_candidates=1)
    assert res[0].tried == 2 and set(timed) == {heuristic_config(3, 128, 256), current}


def test_tune_dry_run_end_to_end(tmp_path, isolated, capsys):
    """The real tuning path: Triton GEMM launches (CPU interpreter), timing, table writing, lookup."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = tables.device_name(device)
    out = tmp_path / "table.json"
    rc = cli_main(["tune", "--shapes", "128,256", "--m", "3", "--max-candidates", "2", "--budget-s", "60",
                   "--device", device, "--out", str(out)])
    assert rc == 0
    t = tables.load_table(out)
    assert t.device == name and set(t.shapes) == {"128,256"} and set(t.shapes["128,256"]) == {4}
    entry = t.shapes["128,256"][4]
    assert entry["tried"] == 2 and entry["us"] > 0 and entry["heuristic_us"] > 0
    assert t.meta["tool"] == "fp8linear tune"
    # the same result through the library API lands in the autotune cache and is found by lookups
    got = tune.autotune_config(3, 128, 256, device, budget_s=0.0)  # budget 0: the heuristic only
    assert tables.lookup_config(name, 3, 128, 256) == got
    assert tables.load_table(tables.cache_table_path(name)).get(128, 256, 4) == got


@pytest.mark.parametrize("path", sorted((Path(tables.__file__).parent / "tuned_configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_tables_are_valid(path):
    """Every table in the package parses, is named after its device and covers the benchmark's default shapes
    (measured tables; a table of unmeasured priors, meta.measured false, carries no timings)."""
    table = tables.load_table(path)
    assert tables.table_filename(table.device) == path.name
    if table.meta.get("measured", True) is False:
        assert table.shapes and all("us" not in e for b in table.shapes.values() for e in b.values())
        return
    assert len(table.shapes) >= 15 and all(len(b) >= 1 for b in table.shapes.values())
    for key in ("7168,18432", "576,7168", "7168,2304"):
        assert set(table.shapes[key]) == set(tables.M_BUCKETS), key
    for buckets in table.shapes.values():
        for entry in buckets.values():
            assert entry["us"] > 0 and entry["us"] <= entry["heuristic_us"] * 1.05


def test_summary_leaves_out_wrong_results_and_reports_triton_alone():
    """A method whose output is wrong (cuBLAS with a misread scale layout) must not count as fast."""
    t = {(7168, 2304, 4096, "ours_block"): 100.0, (7168, 2304, 4096, "triton_block"): 150.0,
         (7168, 7168, 4096, "ours_block"): 100.0, (7168, 7168, 4096, "triton_block"): 140.0,
         (7168, 7168, 4096, "cublas_block"): 100.0}
    rows = _rows(t)
    for r in rows:
        r.rel_err = 0.03
    rows.append(bench.BenchRow(shape="", n=7168, k=2304, m=4096, method="cublas_block", status="ok", us=10.0,
                               rel_err=300.0))
    s = bench.summarize(rows)
    assert s["prefill_ours_over_cublas_block"]["cases"] == 1  # the wrong 10 us cuBLAS row is not a case
    assert s["prefill_ours_over_cublas_block"]["value"] == pytest.approx(1.0)
    assert s["prefill_triton_over_cublas_block"]["value"] == pytest.approx(1.4)
    assert "Triton kernel alone" in bench.format_summary(s)


def test_operand_copies_keep_a_views_padding_rows():
    """A rotated copy of the first M rows of a padded buffer is a view of a copy of the whole buffer
    (cuBLAS reads the padding rows past the view, fp8linear.ops.cublas_gemm.padded_rows_view);
    plain tensors are copied with their strides, small ones shared."""
    from fp8linear.tools.timing import clone_set

    buf = torch.randn(336, 2048)
    view, plain, small = buf[:333], torch.randn(333, 2048).t(), torch.randn(4)
    c_view, c_plain, c_small = clone_set((view, plain, small))
    assert torch.equal(c_view, view) and c_view.data_ptr() != view.data_ptr()
    assert c_view._base is not None and c_view._base.shape == (336, 2048) and c_view.stride() == view.stride()
    assert torch.equal(c_plain, plain) and c_plain.stride() == plain.stride() and c_plain.data_ptr() != plain.data_ptr()
    assert c_small is small


@pytest.mark.parametrize("method,backend,allow,gran", [("ours_block", "auto", True, "block"),
                                                        ("triton_block", "auto", False, "block"),
                                                        ("ours_row", "auto", True, "row"),
                                                        ("ours_block", "triton", False, "block")])
def test_rows_name_the_route_the_router_takes(monkeypatch, method, backend, allow, gran):
    """A GEMM row's config is the label of route_gemm's route for what the row runs: its weight
    granularity, cuBLAS allowed only under "auto" and never for triton_block, PDL marked."""
    from fp8linear.ops import router
    from fp8linear.ops.configs import SplitKConfig

    seen = []

    def fake_route_gemm(device, m, n, k, granularity, fp8_dtype, out_dtype, bias, allow_cublas, tma_ok,
                        contiguous):
        seen.append((m, n, k, granularity, out_dtype, bias, allow_cublas, tma_ok, contiguous))
        return router.Route("splitk", SplitKConfig(64, 64, 5), pdl=True)

    monkeypatch.setattr(router, "route_gemm", fake_route_gemm)
    monkeypatch.setattr(router, "resolve_backend", lambda b, d: "triton")
    cfg = bench.BenchConfig(shapes=(bench.Shape(576, 2112, "s"),), ms=(77,), timer="wall", device="cpu",
                            backend=backend)
    label = bench._describe_route(method, 77, 576, 2112, torch.device("cuda"), torch.float8_e4m3fn, cfg)
    assert label == "splitk:64x64x5w4s4:pdl"
    assert seen == [(77, 576, 2112, gran, torch.bfloat16, None, allow, True, True)]
    assert bench._describe_route(method, 77, 576, 2112, torch.device("cpu"), torch.float8_e4m3fn, cfg) == ""


def test_forward_rows_name_the_whole_linears_route_and_failures_say_so(monkeypatch):
    from fp8linear.ops import router
    from fp8linear.ops.configs import GemvConfig

    seen = []

    def fake_route_linear(device, m, n, k, granularity, fp8_dtype, out_dtype, bias, allow_cublas, weight_tma_ok,
                          eager=False, weight_contiguous=False):
        seen.append((m, granularity, bias is not None, allow_cublas, weight_tma_ok, eager, weight_contiguous))
        return router.Route("gemv", GemvConfig(8, 2))

    monkeypatch.setattr(router, "route_linear", fake_route_linear)
    monkeypatch.setattr(router, "resolve_backend", lambda b, d: "triton")
    cfg = bench.BenchConfig(shapes=(bench.Shape(576, 2112, "s"),), ms=(1,), timer="wall", device="cpu",
                            backend="auto")
    cuda = torch.device("cuda")
    assert bench._describe_route("ours_forward", 1, 576, 2112, cuda, torch.float8_e4m3fn, cfg) == "gemv:8g2w4s3"
    assert seen == [(1, "block", True, True, True, False, True)]

    def broken(*args, **kwargs):
        raise ValueError("no route here")

    monkeypatch.setattr(router, "route_gemm", broken)
    assert (bench._describe_route("ours_block", 1, 576, 2112, cuda, torch.float8_e4m3fn, cfg)
            == "unknown (ValueError: no route here)")
    monkeypatch.setattr(router, "resolve_backend", lambda b, d: "reference")
    assert bench._describe_route("ours_block", 1, 576, 2112, cuda, torch.float8_e4m3fn, cfg) == "reference"
