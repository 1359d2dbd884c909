"""AMD dispatch and `fp8linear amd-check` (compiles for gfx942 without a GPU).

The dispatch tests are pure functions of an arch name; the compile tests run the CLI in a
subprocess (compiling needs TRITON_INTERPRET unset, which the CPU test session sets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fp8linear.ops import config_tables as tables
from fp8linear.ops import configs, router
from fp8linear.ops.configs import AMD_TILE_OPTIONS, GemmConfig, amd_launch_options, is_amd_arch, launch_options
from fp8linear.ops.router import amd_heuristic_config, config_for_arch, heuristic_config
from fp8linear.tools import tune

REPO = Path(__file__).resolve().parents[2]
GFX942_TABLE = REPO / "fp8linear" / "ops" / "tuned_configs" / "gfx942.json"
BENCH_MS = (1, 2, 4, 8, 16, 32, 64, 1024, 2048, 4096)


def _bench_shapes() -> list[tuple[int, int]]:
    from fp8linear.tools.shapes import default_shapes

    return [(s.n, s.k) for s in default_shapes()]


# ----------------------------------------------------------------------------- arch names
@pytest.mark.parametrize("name, amd", [("gfx942", True), ("gfx950", True), ("gfx90a", True),
                                       ("NVIDIA H100 80GB HBM3", False), ("cpu", False), ("gfx", False),
                                       (None, False)])
def test_is_amd_arch(name, amd):
    assert is_amd_arch(name) is amd


def test_hip_arch_strips_features_and_rejects_other_names():
    assert configs.hip_arch("gfx942:sramecc+:xnack-") == "gfx942"
    with pytest.raises(ValueError, match="not an AMD GPU arch"):
        configs.hip_arch("NVIDIA H200")


def test_device_arch_is_none_without_rocm():
    if torch.version.hip is None:
        assert configs.device_arch() is None and configs.device_arch(torch.device("cpu")) is None


# ----------------------------------------------------------------------------- configs
def test_amd_options_validated():
    with pytest.raises(ValueError, match="matrix_instr_nonkdim"):
        GemmConfig(block_m=64, block_n=64, matrix_instr_nonkdim=8)
    with pytest.raises(ValueError, match="kpack"):
        GemmConfig(block_m=64, block_n=64, kpack=4)
    with pytest.raises(ValueError, match="waves_per_eu"):
        GemmConfig(block_m=64, block_n=64, waves_per_eu=9)


def test_launch_options_are_empty_off_amd():
    """Triton's CUDA backend rejects unknown launch options: NVIDIA launches must get none."""
    cfg = amd_heuristic_config(4096, 7168, 7168)
    assert launch_options(cfg, arch=None) == {}
    if torch.version.hip is None:  # NVIDIA or CPU builds: the detected platform is not AMD
        assert launch_options(cfg) == {}
        assert launch_options(heuristic_config(4096, 7168, 7168)) == {}
    assert launch_options(cfg, arch="gfx942") == {"waves_per_eu": 0, "matrix_instr_nonkdim": 16, "kpack": 1}


def test_launch_options_for_split_k_and_gfx950():
    from fp8linear.ops.configs import SplitKConfig

    sk = SplitKConfig(block_m=16, block_n=64, split_k=4)
    assert amd_launch_options(sk, "gfx942")["matrix_instr_nonkdim"] == 16
    cfg = replace(amd_heuristic_config(64, 7168, 7168), kpack=2)
    assert amd_launch_options(cfg, "gfx942")["kpack"] == 2
    assert amd_launch_options(cfg, "gfx950")["kpack"] == 1  # deprecated on gfx950


@pytest.mark.parametrize("n, k", [(576, 7168), (18432, 7168), (32768, 512), (7168, 256), (7168, 2304)])
@pytest.mark.parametrize("m", BENCH_MS)
def test_amd_heuristic_uses_amd_options(m, n, k):
    cfg = amd_heuristic_config(m, n, k)
    assert (cfg.block_m, cfg.block_n) in AMD_TILE_OPTIONS
    assert cfg.num_stages == 2 and cfg.matrix_instr_nonkdim in (16, 32) and cfg.num_warps in (4, 8)
    assert cfg.block_k == 128
    if m > router.AMD_MID_MAX_M and k > 256:  # prefill: enough tiles for every CU, or the smallest tile
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        assert tiles >= configs.AMD_CU_COUNT["gfx942"] or (cfg.block_m, cfg.block_n) == (32, 32)


def test_config_for_arch_routes_by_arch(monkeypatch, tmp_path):
    monkeypatch.setenv(tables.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(tables.TABLE_ENV, raising=False)
    tables.clear_lookup_cache()
    try:
        # an NVIDIA name with no table: the NVIDIA heuristic, no AMD options
        nv = config_for_arch("NVIDIA Nonexistent GPU", 4096, 7168, 7168)
        assert nv == heuristic_config(4096, 7168, 7168) and nv.amd_options() == {
            "waves_per_eu": 0, "matrix_instr_nonkdim": 0, "kpack": 1}
        # gfx942 with a table entry: the entry; without one: the AMD heuristic
        assert config_for_arch("gfx942", 1, 7168, 18432) == tables.load_table(GFX942_TABLE).get(7168, 18432, 1)
        assert config_for_arch("gfx942", 4096, 7168, 2304) == amd_heuristic_config(4096, 7168, 2304)
        assert config_for_arch("gfx950", 4096, 7168, 2304) == amd_heuristic_config(4096, 7168, 2304, "gfx950")
    finally:
        tables.clear_lookup_cache()


def test_select_config_on_rocm_uses_the_arch(monkeypatch):
    """The one entry point: on a ROCm device select_config keys tables by arch and takes AMD configs."""
    monkeypatch.setattr(router, "device_name", lambda device=None: "gfx942")
    for m in BENCH_MS:
        for n, k in _bench_shapes():
            cfg = router.select_config(torch.device("cuda"), m, n, k)
            assert cfg.matrix_instr_nonkdim == 16 and cfg.num_stages == 2, (m, n, k, cfg)


def test_persistent_tma_kernel_never_chosen_on_amd(monkeypatch):
    """On ROCm the router never takes the persistent TMA kernel (nor the NVIDIA-only one-launch
    decode kernel), whatever the shape; the same calls on a non-AMD build (with TMA, here the
    interpreter's) would."""
    monkeypatch.setattr(router, "TensorDescriptor", object)  # as if TMA descriptors were importable
    monkeypatch.setattr(router, "interpreting", lambda: True)
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.version, "hip", None)
    assert router.use_persistent(cpu, 4096, 512, "block", True)
    assert router.route_linear(cpu, 4096, 7168, 512, "block", torch.float8_e4m3fn, torch.bfloat16, None, False,
                               True).kernel == "persistent"
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(router, "select_config", lambda device, m, n, k, g="block": config_for_arch("gfx942", m, n, k, g))
    for m in BENCH_MS:
        for n, k in _bench_shapes():
            for gran in ("block", "tensor"):
                assert not router.use_persistent(cpu, m, k, gran, True)
                route = router.route_linear(cpu, m, n, k, gran, torch.float8_e4m3fnuz, torch.bfloat16, None, False,
                                            True, eager=True)
                assert route.kernel in ("gemv", "splitk", "tiled"), (m, n, k, route)  # no TMA, no one-launch
                if route.kernel == "tiled":
                    assert route.config.matrix_instr_nonkdim == 16 and route.config.num_stages == 2


def test_amd_grouped_configs_fit_lds():
    for pairs in (8, 64 * 8, 4096 * 8, 65536 * 8):
        cfg = router.amd_grouped_config(pairs, 32)
        assert cfg.num_stages == 2 and cfg.matrix_instr_nonkdim == 16
        assert 2 * (cfg.block_m + cfg.block_n) * cfg.block_k <= 64 * 1024


# ----------------------------------------------------------------------------- tables
def test_gfx942_table_loads_and_carries_amd_options():
    table = tables.load_table(GFX942_TABLE)
    assert table.device == "gfx942" and tables.table_filename("gfx942") == GFX942_TABLE.name
    assert table.meta["measured"] is False
    for key, buckets in table.shapes.items():
        for bucket in buckets:
            n, k, gran = tables._parse_shape_key(key)
            cfg = table.get(n, k, bucket, gran)
            assert cfg.matrix_instr_nonkdim == 16 and cfg.num_stages == 2 and (cfg.block_m, cfg.block_n) in AMD_TILE_OPTIONS


def test_amd_fields_round_trip_and_nvidia_entries_stay_unchanged(tmp_path):
    t = tables.ConfigTable(device="gfx942")
    amd = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=2, waves_per_eu=2, matrix_instr_nonkdim=32,
                     kpack=2)
    t.set(7168, 2048, 64, amd)
    nv = GemmConfig(block_m=128, block_n=128)
    t.set(7168, 2048, 4096, nv)
    path = tables.save_table(t, tmp_path / "gfx942.json")
    back = tables.load_table(path)
    assert back.get(7168, 2048, 64) == amd and back.get(7168, 2048, 4096) == nv
    raw = json.loads(path.read_text())["shapes"]["7168,2048"]
    assert set(raw["4096"]) == {"block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"}
    for nv_table in (REPO / "fp8linear" / "ops" / "tuned_configs").glob("NVIDIA_*.json"):
        loaded = tables.load_table(nv_table)
        for key, buckets in loaded.shapes.items():
            n, k, gran = tables._parse_shape_key(key)
            assert all(loaded.get(n, k, b, gran).amd_options()["matrix_instr_nonkdim"] == 0 for b in buckets)


def test_device_name_keys_rocm_tables_by_arch(monkeypatch):
    class Props:
        gcnArchName = "gfx942:sramecc+:xnack-"

    tables._cuda_device_name.cache_clear()
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    try:
        assert tables.device_name(0) == "gfx942"
    finally:
        tables._cuda_device_name.cache_clear()


def test_tuner_candidates_on_amd():
    cands = tune.candidate_configs(4096, 7168, 7168, arch="gfx942")
    assert cands[0] == amd_heuristic_config(4096, 7168, 7168)
    assert all(c.num_stages == 2 and c.matrix_instr_nonkdim == 16 for c in cands)
    assert len(set(cands)) == len(cands) >= 5
    refined = tune.refine_candidates(cands[:2], arch="gfx942")
    assert any(c.kpack == 2 for c in refined) and any(c.matrix_instr_nonkdim == 32 for c in refined)
    assert not set(refined) & set(cands[:2])
    # NVIDIA candidates are unchanged by the arch parameter's default
    assert tune.candidate_configs(4096, 7168, 7168) == tune.candidate_configs(4096, 7168, 7168, arch=None)


# ----------------------------------------------------------------------------- assembly parsing
ASM = """\
_k:
\ts_load_dword s0, s[0:1], 0x0
.LBB0_1:
\tbuffer_load_dwordx4 v[0:3], v4, s[8:11], 0 offen
\tv_mfma_f32_16x16x32_fp8_fp8 v[8:11], v[0:1], v[2:3], v[8:11]
\ts_cbranch_scc1 .LBB0_1
.LBB0_2:
\tv_mfma_f32_32x32x8_f16 v[8:23], v[0:1], v[2:3], v[8:23]
\ts_endpgm
; ScratchSize: 12
; Occupancy: 3
amdhsa.kernels:
  - .agpr_count:     4
    .sgpr_count:     40
    .sgpr_spill_count: 0
    .vgpr_count:     168
    .vgpr_spill_count: 2
"""


def test_parse_amdgcn_and_loop_mfma():
    from fp8linear.tools.amd_check import loop_mfma, parse_amdgcn

    assert parse_amdgcn(ASM) == {"vgpr": 168, "agpr": 4, "sgpr": 40, "vgpr_spill": 2, "sgpr_spill": 0,
                                 "scratch": 12, "compiler_occupancy": 3}
    assert loop_mfma(ASM) == ["v_mfma_f32_16x16x32_fp8_fp8"]  # the f16 MFMA after the loop is not in it
    assert loop_mfma(ASM.replace("s_cbranch_scc1 .LBB0_1", "s_nop 0")) == []
    with pytest.raises(ValueError, match="vgpr_count"):
        parse_amdgcn("; ScratchSize: 0\n")


@pytest.mark.parametrize("change, problem", [
    ({}, None),
    ({"vgpr_spill": 3}, "3 VGPRs spilled"),
    ({"sgpr_spill": 5}, "5 SGPRs spilled"),
    ({"scratch": 16}, "16 B scratch"),
    ({"lds": 65537}, "LDS 65537 B > 65536 B"),
    ({"mfma": "v_mfma_f32_32x32x8_f16"}, "no FP8 MFMA in the main loop"),
    ({"mfma": ""}, "no FP8 MFMA in the main loop"),
    ({"error": "CompilationError: x"}, "compile failed"),
])
def test_check_report_flags_each_problem(change, problem):
    from fp8linear.tools.amd_check import KernelReport, check_report

    fields = {"lds": 32768, "mfma": "v_mfma_f32_16x16x32_fp8_fp8", **change}
    rep = KernelReport(kernel="_block_fp8_gemm_kernel", config="c", arch="gfx942", **fields)
    out = check_report(rep).problems
    assert (out == []) if problem is None else any(problem in p for p in out)


def test_non_gemm_kernels_need_no_mfma_and_gfx950_has_more_lds():
    from fp8linear.tools.amd_check import KernelReport, check_report, occupancy

    assert check_report(KernelReport(kernel="_act_quant_kernel", config="", arch="gfx942")).problems == []
    assert check_report(KernelReport(kernel="_fused_fp8_gemv_kernel", config="", arch="gfx950", lds=98304)).problems == []
    assert occupancy(8, 32768, 8, "gfx942") == 4 and occupancy(3, 0, 4, "gfx942") == 3
    assert occupancy(8, 32768, 4, "gfx942") == 2 and occupancy(8, 32768, 4, "gfx950") == 5


# ----------------------------------------------------------------------------- the CLI
def _cli_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    pytest.importorskip("triton.backends.amd")
    out = tmp_path_factory.mktemp("amd") / "report.jsonl"
    proc = subprocess.run([sys.executable, "-m", "fp8linear", "amd-check", "--quick", "--json", str(out)],
                          cwd=REPO, env=_cli_env(), capture_output=True, text=True, timeout=600)
    return proc, out


def test_amd_check_quick_compiles_every_kernel_clean(quick_report):
    proc, out = quick_report
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        for f in ("kernel", "config", "vgpr", "agpr", "sgpr", "vgpr_spill", "sgpr_spill", "scratch", "lds",
                  "occupancy", "mfma"):
            assert f in row, f
        assert row["vgpr_spill"] == row["sgpr_spill"] == row["scratch"] == 0 and row["lds"] <= 65536, row
        assert row["vgpr"] > 0 and 1 <= row["occupancy"] <= 8, row
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_act_quant_kernel", "_fused_fp8_gemv_kernel", "_block_fp8_gemm_kernel",
                       "_splitk_fp8_gemm_kernel", "_grouped_fp8_gemm_kernel", "_moe_align_kernel",
                       "_rms_norm_kernel"}
    assert "_block_fp8_gemm_persistent_kernel" not in kernels
    for r in rows:
        if r["kernel"] in ("_block_fp8_gemm_kernel", "_splitk_fp8_gemm_kernel", "_grouped_fp8_gemm_kernel"):
            assert "v_mfma_f32_16x16x32_fp8_fp8" in r["mfma"].split(","), r
            assert r["options"]["matrix_instr_nonkdim"] == 16 and r["options"]["num_stages"] == 2, r
    prefill = [r for r in rows if r["kernel"] == "_block_fp8_gemm_kernel" and any("M=4096" in u for u in r["uses"])]
    assert prefill and all(r["occupancy"] >= 2 for r in prefill)


def test_amd_check_fails_on_a_spilling_config(tmp_path):
    """Exit status 1 when a compiled config spills: a 256x256 tile, 8 warps (the table points at it)."""
    pytest.importorskip("triton.backends.amd")
    table = {"format": tables.TABLE_FORMAT, "version": tables.TABLE_VERSION, "device": "gfx942", "meta": {},
             "shapes": {"7168,7168": {"4096": {"block_m": 256, "block_n": 256, "block_k": 128, "group_m": 8,
                                               "num_warps": 8, "num_stages": 2, "matrix_instr_nonkdim": 16}}}}
    code = (
        "import sys, json; from pathlib import Path; import fp8linear.ops.config_tables as t; "
        f"t._SHIPPED_DIR = Path({str(tmp_path)!r}); "
        "from fp8linear.tools import amd_check as a; "
        "rows = [a.compile_launch(l, 'gfx942') for l in a._table_launches('gfx942', __import__('torch').float8_e4m3fnuz)]; "
        "print(json.dumps([r.problems for r in rows])); sys.exit(1 if any(r.problems for r in rows) else 0)"
    )
    (tmp_path / "gfx942.json").write_text(json.dumps(table))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    problems = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("VGPRs spilled" in p for row in problems for p in row)


def test_amd_check_refuses_the_interpreter():
    env = dict(_cli_env(), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "fp8linear", "amd-check", "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
