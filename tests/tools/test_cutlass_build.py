"""`fp8linear build-cutlass` (fp8linear/tools/cutlass_build.py) without a GPU or CUDA toolkit: a stand-in
nvcc records its commands and writes its outputs, so the build's steps, its cache layout and its
failure handling are checked here; the real build ran on the GPU machine (docs/benchmarks.md)."""

from __future__ import annotations

import os
import stat
import sys

import pytest
import torch

from fp8linear.cli import main as cli_main
from fp8linear.ops import cutlass_gemm
from fp8linear.tools import cutlass_build

_FAKE_NVCC = """#!{python}
import os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_NVCC_LOG"], "a") as f:
    f.write(" ".join(args) + "\\n")
fail = os.environ.get("FAKE_NVCC_FAIL")
if fail and any(fail in a for a in args):
    sys.stderr.write("error: planted failure\\n")
    sys.exit(2)
out = args[args.index("-o") + 1]
with open(out, "wb") as f:
    f.write(b"object" if "-c" in args else b"library")
"""


@pytest.fixture
def toolchain(tmp_path, monkeypatch):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(_FAKE_NVCC.format(python=sys.executable))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    cutlass = tmp_path / "cutlass"
    for header in cutlass_build._HEADERS:
        (cutlass / header).parent.mkdir(parents=True, exist_ok=True)
        (cutlass / header).write_text("// headers\n")
    monkeypatch.setenv("FAKE_NVCC_LOG", str(tmp_path / "nvcc.log"))
    monkeypatch.setenv("CXX", str(nvcc))  # the stand-in compiles the plan call too
    monkeypatch.setenv("FP8LINEAR_CACHE_DIR", str(tmp_path / "cache"))
    return nvcc, cutlass, tmp_path


def test_finds_nvcc_and_cutlass_or_says_what_it_tried(toolchain, monkeypatch, tmp_path):
    nvcc, cutlass, _ = toolchain
    assert cutlass_build.find_nvcc(str(nvcc)) == str(nvcc)
    monkeypatch.setenv("CUDA_HOME", str(nvcc.parent.parent))
    assert cutlass_build.find_nvcc() == str(nvcc)
    with pytest.raises(FileNotFoundError, match="nvcc not found.*--nvcc"):
        cutlass_build.find_nvcc(str(tmp_path / "missing"))
    assert cutlass_build.find_cutlass(str(cutlass)) == cutlass
    monkeypatch.setenv("CUTLASS_PATH", str(cutlass))
    assert cutlass_build.find_cutlass() == cutlass
    with pytest.raises(FileNotFoundError, match="nvidia-cutlass>=4.2"):
        cutlass_build.find_cutlass(str(tmp_path))
    (cutlass / cutlass_build._HEADERS[1]).unlink()  # a CUTLASS 3.x tree: no blockwise scale layouts
    with pytest.raises(FileNotFoundError, match="blockwise_scale_layout"):
        cutlass_build.find_cutlass(str(cutlass))


def test_compile_command_targets_sm90a_per_variant(toolchain):
    nvcc, cutlass, tmp_path = toolchain
    symbol, macros = cutlass_gemm.variants()[1]
    cmd = cutlass_build.compile_command(str(nvcc), cutlass, symbol, macros, tmp_path / "x.o")
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd and "-c" in cmd and str(cutlass_gemm.SOURCE) in cmd
    assert f"-DFP8L_NAME={symbol}" in cmd and f"-I{cutlass / 'include'}" in cmd
    assert all(f"-D{k}={v}" in cmd for k, v in macros.items())
    link = cutlass_build.link_command(str(nvcc), [tmp_path / "x.o"], tmp_path / "l.so")
    assert "-shared" in link and not any(a.startswith("-lcuda") for a in link)  # builds without a driver


def test_build_installs_one_complete_library(toolchain):
    nvcc, cutlass, tmp_path = toolchain
    lines = []
    path = cutlass_build.build_library(str(nvcc), str(cutlass), jobs=2, log=lines.append)
    assert path == cutlass_gemm.library_path() and path.read_bytes() == b"library"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no objects or temp folder left
    calls = (tmp_path / "nvcc.log").read_text().splitlines()
    assert len(calls) == len(cutlass_gemm.variants()) + 1 and "-shared" in calls[-1]
    assert any("built" in line for line in lines)
    again = []
    assert cutlass_build.build_library(str(nvcc), str(cutlass), log=again.append) == path  # kept, not rebuilt
    assert "already built" in again[0] and len((tmp_path / "nvcc.log").read_text().splitlines()) == len(calls)


def test_a_failed_compile_leaves_no_library(toolchain, monkeypatch):
    nvcc, cutlass, _ = toolchain
    monkeypatch.setenv("FAKE_NVCC_FAIL", "c128x128_bias")
    with pytest.raises(RuntimeError, match="planted failure"):
        cutlass_build.build_library(str(nvcc), str(cutlass), jobs=4, log=lambda s: None)
    folder = cutlass_gemm.library_path().parent
    assert not cutlass_gemm.library_path().exists() and list(folder.iterdir()) == []


# The cooperative kernel header's producer branches as CUTLASS 4.2 writes them (abridged): the
# scale-loading warp's branch has no wait before its loop.
_COOPERATIVE = """#pragma once
      if (producer_warp_role == ProducerWarpRole::Mainloop) {
        cutlass::arch::wait_on_dependent_grids();
        while (work_tile_info.is_valid()) {
        }
      }
      else if (producer_warp_role == ProducerWarpRole::MainloopAux) {
        if constexpr (IsMainloopAuxiliaryLoadNeeded) {
          while (work_tile_info.is_valid()) {
            collective_mainloop.load_auxiliary();
          }
        }
      }
"""


def test_the_cooperative_header_copy_waits_in_the_scale_loading_warp(tmp_path):
    root = tmp_path / "cutlass"
    header = root / "include" / cutlass_build.COOPERATIVE_HEADER
    assert cutlass_build.cooperative_overlay(root, tmp_path / "a") is None  # no header: no copy
    header.parent.mkdir(parents=True)
    header.write_text(_COOPERATIVE)
    out = cutlass_build.cooperative_overlay(root, tmp_path / "b")
    text = (out / cutlass_build.COOPERATIVE_HEADER).read_text()
    assert text.startswith("#define FP8L_COOPERATIVE_AUX_WAITS 1\n") and text.count("wait_on_dependent_grids") == 2
    aux = text[text.index("MainloopAux"):]
    assert aux.index("wait_on_dependent_grids") < aux.index("while (") < aux.index("load_auxiliary")
    assert text.replace("          cutlass::arch::wait_on_dependent_grids();  // fp8linear: wait as the other "
                        "producer warps do\n", "") == "#define FP8L_COOPERATIVE_AUX_WAITS 1\n" + _COOPERATIVE
    header.write_text(text)  # a CUTLASS whose warp waits already: copied with the mark only
    again = cutlass_build.cooperative_overlay(root, tmp_path / "c") / cutlass_build.COOPERATIVE_HEADER
    assert again.read_text() == cutlass_build._OVERLAY_MARK + text
    header.write_text(_COOPERATIVE.replace("MainloopAux", "AuxLoad"))  # a layout not recognised
    assert cutlass_build.cooperative_overlay(root, tmp_path / "d") is None


def test_the_build_compiles_against_the_header_copy_where_it_applies(toolchain):
    nvcc, cutlass, tmp_path = toolchain
    lines = []
    cutlass_build.build_library(str(nvcc), str(cutlass), jobs=2, log=lines.append)
    calls = (tmp_path / "nvcc.log").read_text().splitlines()[:-1]  # the objects
    assert all("-DFP8L_COOPERATIVE_PDL=0" in c for c in calls)
    assert any("not recognised" in line and "without PDL" in line for line in lines)
    header = cutlass / "include" / cutlass_build.COOPERATIVE_HEADER
    header.parent.mkdir(parents=True)
    header.write_text(_COOPERATIVE)
    (tmp_path / "nvcc.log").unlink()
    path = cutlass_build.build_library(str(nvcc), str(cutlass), jobs=2, force=True, log=lines.append)
    calls = (tmp_path / "nvcc.log").read_text().splitlines()[:-1]
    assert len(calls) == len(cutlass_gemm.variants())
    for call in calls:
        args = call.split()
        first_include = next(a for a in args if a.startswith("-I"))
        assert first_include.endswith("/include") and str(path.parent) in first_include  # the copy, first
        assert args.index(first_include) < args.index(f"-I{cutlass / 'include'}") and "-DFP8L_COOPERATIVE_PDL=1" in args
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # the copy went with the build folder


def test_plan_call_command_builds_a_torch_extension(toolchain):
    import sysconfig

    from torch.utils.cpp_extension import include_paths, library_paths

    nvcc, _, tmp_path = toolchain
    cmd = cutlass_build.plan_call_command("c++", tmp_path / "m.so")
    assert cmd[0] == "c++" and "-shared" in cmd and "-fPIC" in cmd and str(cutlass_gemm.PLAN_CALL_SOURCE) in cmd
    assert cmd[cmd.index("-o") + 1] == str(tmp_path / "m.so")
    assert f"-DFP8L_MODULE={cutlass_gemm.PLAN_CALL_MODULE}" in cmd
    assert f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}" in cmd
    assert {f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]} <= set(cmd)
    assert {f"-L{p}" for p in library_paths()} <= set(cmd) and "-ltorch_python" in cmd and "-lc10" in cmd
    assert cutlass_build.find_cxx() == str(nvcc)  # $CXX
    with pytest.raises(FileNotFoundError, match="no C.. compiler found.*--cxx"):
        cutlass_build.find_cxx(str(tmp_path / "missing"))


def test_plan_call_build_installs_one_complete_module(toolchain, monkeypatch):
    _, _, tmp_path = toolchain
    lines = []
    path = cutlass_build.build_plan_call(log=lines.append)
    assert path == cutlass_gemm.plan_call_path() and path.read_bytes() == b"library"
    assert path.name.startswith(cutlass_gemm.PLAN_CALL_MODULE) and path.parent.parent.name == "cutlass-plan-call"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert cutlass_build.build_plan_call(log=lines.append) == path and "already built" in lines[-1]
    assert len((tmp_path / "nvcc.log").read_text().splitlines()) == 1  # kept, not rebuilt
    path.unlink()
    monkeypatch.setenv("FAKE_NVCC_FAIL", "plan_call.cpp")
    with pytest.raises(RuntimeError, match="planted failure"):
        cutlass_build.build_plan_call(log=lines.append)
    assert list(path.parent.iterdir()) == []  # no module, no temporary folder


def test_plan_call_path_follows_its_source_torch_and_python(tmp_path, monkeypatch):
    source = tmp_path / "plan_call.cpp"
    source.write_text("// one\n")
    monkeypatch.setattr(cutlass_gemm, "PLAN_CALL_SOURCE", source)
    first = cutlass_gemm.plan_call_path(tmp_path)
    assert first.parent.parent == tmp_path / "cutlass-plan-call" and first == cutlass_gemm.plan_call_path(tmp_path)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    other_torch = cutlass_gemm.plan_call_path(tmp_path)
    source.write_text("// two\n")
    assert len({first, other_torch, cutlass_gemm.plan_call_path(tmp_path)}) == 3


def test_cli(toolchain, capsys, monkeypatch):
    nvcc, cutlass, _ = toolchain
    assert cli_main(["build-cutlass", "--print-path"]) == 0
    assert capsys.readouterr().out.strip() == str(cutlass_gemm.library_path())
    assert cli_main(["build-cutlass", "--jobs", "0"]) == 2
    monkeypatch.setenv("FAKE_NVCC_FAIL", "-shared")  # every object compiles, the link fails
    assert cli_main(["build-cutlass", "--nvcc", str(nvcc), "--cutlass", str(cutlass)]) == 1
    assert "failed" in capsys.readouterr().err
    assert list(cutlass_gemm.library_path().parent.iterdir()) == []  # no objects or temp folder left
    monkeypatch.setenv("FAKE_NVCC_FAIL", "plan_call.cpp")  # the library builds, the plan call does not
    assert cli_main(["build-cutlass", "--nvcc", str(nvcc), "--cutlass", str(cutlass)]) == 0
    assert "C++ call was not built" in capsys.readouterr().err and not cutlass_gemm.plan_call_path().exists()
    monkeypatch.delenv("FAKE_NVCC_FAIL")
    assert cli_main(["build-cutlass", "--nvcc", str(nvcc), "--cutlass", str(cutlass), "--force"]) == 0
    assert os.path.isfile(cutlass_gemm.library_path()) and os.path.isfile(cutlass_gemm.plan_call_path())
