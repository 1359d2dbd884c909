"""`fp8linear build-cutlass`: compile the CUTLASS blockwise FP8 kernels once, into the cache.

Each (config, bias) variant of ``fp8linear/ops/cutlass/blockwise_gemm.cu``
(:func:`fp8linear.ops.cutlass_gemm.variants`) is compiled by nvcc for sm_90a into its own object,
in parallel (one object takes about a minute of one core), then linked into one shared library
(the CUDA runtime statically; no GPU driver is needed to build). Everything happens in a temporary folder beside the target and the
library is moved into place by a rename, so the cache holds a complete library or none
(:func:`fp8linear.ops.cutlass_gemm.library_path`: a new source or flag set gets a new name).

Needs nvcc (``--nvcc``, else ``$CUDA_HOME/bin/nvcc``, else the PATH) and CUTLASS's headers
(``--cutlass``, else ``$CUTLASS_PATH``, else the ``nvidia-cutlass`` package, 4.2 or newer:
``pip install 'nvidia-cutlass>=4.2'``). No GPU is needed to build. A build stopped midway leaves a
``.build-*`` folder beside the library, which the next build does not reuse (delete it).

Then a C++ compiler (``--cxx``, else ``$CXX``, else the PATH's ``c++``) builds the eager plans'
one-call host side, ``fp8linear/ops/cutlass/plan_call.cpp``, against the installed torch's headers
(:func:`fp8linear.ops.cutlass_gemm.plan_call_path`, the same temporary folder and rename). Without
it the library works as well; eager plans then allocate in Python and call it through ``ctypes``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..ops.cutlass_gemm import (BUILD_FLAGS, PLAN_CALL_MODULE, PLAN_CALL_SOURCE, SOURCE, library_path, plan_call_path,
                                variants)

# What the source needs of a CUTLASS tree: the Hopper blockwise-scaling layouts came in CUTLASS 4.x.
_HEADERS = ("include/cutlass/cutlass.h", "include/cutlass/detail/blockwise_scale_layout.hpp",
            "tools/util/include/cutlass/util/packed_stride.hpp")

# CUTLASS's Hopper cooperative kernel waits in griddepcontrol.wait (what a launch with programmatic
# dependent launch needs) in its scheduler, mainloop and epilogue producer warps, but in CUTLASS 4.2
# not in its scale-loading warp (MainloopAux), which then read activation scales before the
# quantization wrote them (H100: different bits at 24576x1536 M=333). The ping-pong kernel's
# scale-loading warp waits. The build compiles the cooperative kernel against a copy of its header
# where that warp waits too (cooperative_overlay).
COOPERATIVE_HEADER = "cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized_cooperative.hpp"
_AUX_BRANCH = re.compile(r"else if \(producer_warp_role == ProducerWarpRole::MainloopAux\) \{\s*"
                         r"if constexpr \(IsMainloopAuxiliaryLoadNeeded\) \{")
_WAIT = "cutlass::arch::wait_on_dependent_grids();"
# What the source checks (an #error where missing) when it compiles with FP8L_COOPERATIVE_PDL=1.
_OVERLAY_MARK = "#define FP8L_COOPERATIVE_AUX_WAITS 1\n"

__all__ = ["COOPERATIVE_HEADER", "cooperative_overlay", "find_nvcc", "find_cutlass", "find_cxx", "compile_command",
           "link_command", "plan_call_command",
           "build_library", "build_plan_call", "add_arguments", "run"]


def find_nvcc(explicit: str | None = None) -> str:
    """nvcc's path: `explicit` (only), else $CUDA_HOME/bin/nvcc, else the PATH's; FileNotFoundError
    naming what was tried."""
    if explicit:
        cands = [explicit]
    else:
        home = os.environ.get("CUDA_HOME")
        cands = [os.path.join(home, "bin", "nvcc")] if home else []
        found = shutil.which("nvcc")
        cands += [found] if found else []
    for cand in cands:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    tried = cands if explicit else cands + ["PATH"]
    raise FileNotFoundError(f"nvcc not found (tried {tried}); install the CUDA toolkit or pass --nvcc")


def find_cutlass(explicit: str | None = None) -> Path:
    """The CUTLASS source root (holding include/cutlass/cutlass.h and tools/util/include): `explicit`
    (only), else $CUTLASS_PATH, else the nvidia-cutlass package's."""
    if explicit:
        roots = [explicit]
    else:
        roots = [os.environ.get("CUTLASS_PATH")]
        try:
            import cutlass_library  # the nvidia-cutlass package ships the C++ sources under source/

            roots.append(str(Path(cutlass_library.__file__).resolve().parent / "source"))
        except ImportError:
            pass
    tried = [r for r in roots if r]
    for root in tried:
        if all((Path(root) / h).is_file() for h in _HEADERS):
            return Path(root)
    raise FileNotFoundError(f"CUTLASS >= 4.2 headers ({', '.join(_HEADERS)}) not found under {tried or 'nothing'}; "
                            "`pip install 'nvidia-cutlass>=4.2'`, or pass --cutlass or set CUTLASS_PATH")


def find_cxx(explicit: str | None = None) -> str:
    """The C++ compiler's path: `explicit` (only), else $CXX, else the PATH's c++ or g++;
    FileNotFoundError naming what was tried."""
    cands = [explicit] if explicit else [c for c in (os.environ.get("CXX"), "c++", "g++") if c]
    for cand in cands:
        found = shutil.which(cand)
        if found:
            return found
    raise FileNotFoundError(f"no C++ compiler found (tried {cands}); install g++ or pass --cxx")


def cooperative_overlay(cutlass: Path, out: Path) -> Path | None:
    """Write under folder `out` CUTLASS's cooperative kernel header (:data:`COOPERATIVE_HEADER`) with
    its scale-loading warp waiting for the previous grid before its loop, as its other producer warps
    do, and return `out`: the include folder that goes before CUTLASS's. Where the warp waits
    already the copy is unchanged but for the mark the source checks. None where the header is
    missing or its text not recognised (the cooperative kernel then builds without PDL)."""
    try:
        text = (cutlass / "include" / COOPERATIVE_HEADER).read_text()
    except OSError:
        return None
    found = list(_AUX_BRANCH.finditer(text))
    if len(found) != 1:
        return None
    end = found[0].end()
    loop = text.find("while (", end)
    if loop < 0:
        return None
    if _WAIT not in text[end:loop]:
        text = f"{text[:end]}\n          {_WAIT}  // fp8linear: wait as the other producer warps do{text[end:]}"
    target = out / COOPERATIVE_HEADER
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(_OVERLAY_MARK + text)
    return out


def compile_command(nvcc: str, cutlass: Path, symbol: str, macros: dict[str, int], out: Path,
                    overlay: Path | None = None) -> list[str]:
    """The nvcc command that compiles one variant of the source into object `out`; with `overlay`
    (:func:`cooperative_overlay`'s folder) the cooperative kernel waits in every producer warp, and
    is built for PDL launches."""
    defines = [f"-DFP8L_NAME={symbol}"] + [f"-D{k}={v}" for k, v in sorted(macros.items())]
    defines.append(f"-DFP8L_COOPERATIVE_PDL={int(overlay is not None)}")
    includes = [f"-I{overlay}"] if overlay is not None else []
    includes += [f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}"]
    return [nvcc, *BUILD_FLAGS, *includes, *defines, "-c", str(SOURCE), "-o", str(out)]


def link_command(nvcc: str, objects: list[Path], out: Path) -> list[str]:
    """The shared library of the objects; the CUDA runtime linked statically, the driver reached
    through it (no libcuda at build time: a machine without a GPU driver builds too)."""
    return [nvcc, "-shared", "-o", str(out), *map(str, objects)]


def plan_call_command(cxx: str, out: Path) -> list[str]:
    """The command that builds the plan-call module `out` against the installed torch (its headers
    and libraries, its C++ ABI, Python's headers); no CUDA headers needed."""
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch.compiled_with_cxx11_abi())
    libs = library_paths()
    return [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-DFP8L_MODULE={PLAN_CALL_MODULE}", *(f"-I{p}" for p in includes), str(PLAN_CALL_SOURCE),
            "-o", str(out), *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        errors = [line for line in lines if "error" in line][:5]  # the first errors, then the end
        tail = "\n".join(dict.fromkeys(errors + lines[-15:]))
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {done.returncode}): {' '.join(cmd[-4:])}\n{tail}")


def build_library(nvcc: str | None = None, cutlass: str | None = None, jobs: int | None = None,
                  root: Path | None = None, force: bool = False, log=print) -> Path:
    """Compile and link the library into the cache (`root`: the cache root); returns its path. An
    existing library is kept unless `force`. A failure leaves no library and no temporary folder."""
    target = library_path(root)
    if target.is_file() and not force:
        log(f"fp8linear build-cutlass: already built: {target}")
        return target
    nvcc_path, cutlass_root = find_nvcc(nvcc), find_cutlass(cutlass)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        overlay = cooperative_overlay(cutlass_root, work / "include")
        if overlay is None:
            log(f"fp8linear build-cutlass: {COOPERATIVE_HEADER} not recognised under {cutlass_root}: "
                "the cooperative kernel is built without PDL launches")
        objects = [work / f"{symbol}.o" for symbol, _ in variants()]
        commands = [compile_command(nvcc_path, cutlass_root, symbol, macros, obj, overlay)
                    for (symbol, macros), obj in zip(variants(), objects)]
        workers = max(1, min(len(commands), jobs or os.cpu_count() or 1))
        log(f"fp8linear build-cutlass: compiling {len(commands)} objects with {workers} jobs "
            f"({nvcc_path}, CUTLASS {cutlass_root})")
        pool = ThreadPoolExecutor(workers)
        try:
            for future in [pool.submit(_run, cmd) for cmd in commands]:
                future.result()  # the first failure, in order
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, compiles not started are dropped
        tmp_lib = work / target.name
        _run(link_command(nvcc_path, objects, tmp_lib))
        os.replace(tmp_lib, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"fp8linear build-cutlass: built {target}")
    return target


def build_plan_call(cxx: str | None = None, root: Path | None = None, force: bool = False, log=print) -> Path:
    """Compile the plan-call module into the cache (`root`: the cache root); returns its path. An
    existing module is kept unless `force`. A failure leaves no module and no temporary folder."""
    target = plan_call_path(root)
    if target.is_file() and not force:
        log(f"fp8linear build-cutlass: already built: {target}")
        return target
    cxx_path = find_cxx(cxx)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        tmp = work / target.name
        _run(plan_call_command(cxx_path, tmp))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"fp8linear build-cutlass: built {target}")
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nvcc", default=None, help="nvcc to use (default: $CUDA_HOME/bin/nvcc, else the PATH's)")
    parser.add_argument("--cutlass", default=None,
                        help="CUTLASS source root (default: $CUTLASS_PATH, else the nvidia-cutlass package)")
    parser.add_argument("--cxx", default=None, help="C++ compiler for the eager plans' call (default: $CXX, else c++)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the library exists")
    parser.add_argument("--print-path", action="store_true", help="print where the library goes, build nothing")


def run(args: argparse.Namespace) -> int:
    if args.print_path:
        print(library_path())
        return 0
    if args.jobs is not None and args.jobs < 1:
        print(f"fp8linear build-cutlass: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        build_library(args.nvcc, args.cutlass, args.jobs, force=args.force)
    except (OSError, RuntimeError) as e:  # OSError: no nvcc / headers, or the cache folder not writable
        print(f"fp8linear build-cutlass: {e}", file=sys.stderr)
        return 1
    try:
        build_plan_call(args.cxx, force=args.force)
    except (OSError, RuntimeError) as e:  # the library works without it
        print(f"fp8linear build-cutlass: the eager plans' C++ call was not built, so they call the library "
              f"through ctypes: {e}", file=sys.stderr)
    return 0
