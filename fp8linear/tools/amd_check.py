"""`fp8linear amd-check`: compile every Triton kernel the AMD dispatch can launch for an AMD GPU,
without one, and check the machine code.

How: the real launchers (:mod:`fp8linear.ops`) are called on tensors of the real shapes on
PyTorch's ``meta`` device (no memory) with the dispatch steered as on ROCm for `arch` (the arch's
table and :func:`~fp8linear.ops.router.amd_heuristic_config`, the AMD launch options, the CU count
for split-K, no PDL, no persistent TMA kernel). Each kernel launch is recorded instead of run; every
distinct launch (kernel, specialization, options) is then compiled with ``triton.compile`` for
``GPUTarget("hip", arch, 64)``, with the specialization a real launch would get (16-byte aligned
pointers below 2 GiB: divisibility 16 and buffer loads), and the AMDGCN assembly is read:

* ``vgpr`` (``.vgpr_count``: architectural plus accumulation registers, what limits occupancy),
  ``agpr``, ``sgpr``, ``vgpr_spill``, ``sgpr_spill``, ``scratch`` (bytes per lane), ``lds``
  (``metadata.shared``, bytes per workgroup);
* ``occupancy``: waves per SIMD, the compiler's (registers, ``waves_per_eu``) capped by what the
  LDS allows (64 KiB per CU on gfx942, 160 KiB on gfx950);
* ``mfma``: the MFMA instructions inside the kernel's loops (the GEMM main loop).

The grid: the benchmark's shapes (``fp8linear bench``: DeepSeek-V3 and others) x M in
{1, 2, 4, 8, 16, 32, 64, 1024, 2048, 4096} x weight granularities, through the dense forward
(fused GEMV for single tokens where it is chosen, else activation quantization then the GEMM,
split-K or tiled); every entry of the arch's shipped table; and MoE layers (alignment kernel,
activation quantization, grouped GEMM) at several token counts; RMSNorm rows of the models'
widths (:class:`fp8linear.FusedRMSNorm`). ``--quick`` takes a subset
(block scales, the benchmark's 5 quick shapes and their table entries, fewer M values and MoE
sizes) for the test suite.

Exit status 1 if any compiled kernel spills VGPRs or SGPRs, uses scratch, needs more LDS than a CU
has, or is a GEMM whose loops hold no FP8 MFMA; 2 on bad arguments or a Triton without the HIP
backend. Only compile-time facts: nothing here measures speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "ARCHS",
    "REPORT_FIELDS",
    "Launch",
    "KernelReport",
    "parse_amdgcn",
    "loop_mfma",
    "record_launches",
    "CompileJob",
    "make_job",
    "compile_job",
    "compile_launch",
    "check_report",
    "add_arguments",
    "run",
]

# Archs checked: MI300X/MI325X (gfx942, FP8 fnuz) and MI355X (gfx950, OCP FP8).
ARCHS = ("gfx942", "gfx950")
# LDS per CU (the most one workgroup may use): 64 KiB on CDNA3, 160 KiB on CDNA4.
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
# Waves per SIMD at most, and SIMDs per CU (CDNA3/4).
MAX_WAVES_PER_SIMD = 8
SIMDS_PER_CU = 4
WAVE_SIZE = 64
# Kernels whose main loop must run on FP8 MFMAs (also: any kernel calling tl.dot or using MFMAs).
GEMM_KERNELS = ("_block_fp8_gemm_kernel", "_splitk_fp8_gemm_kernel", "_grouped_fp8_gemm_kernel")
# Field names of a report row (the --json objects carry these and a few more).
REPORT_FIELDS = ("kernel", "config", "vgpr", "agpr", "sgpr", "vgpr_spill", "sgpr_spill", "scratch", "lds",
                 "occupancy", "mfma")
# M values of the dense grid: the benchmark's decode and prefill sizes.
GRID_MS = (1, 2, 4, 8, 16, 32, 64, 1024, 2048, 4096)
QUICK_MS = (1, 4, 16, 64, 1024, 4096)
# MoE layers: DeepSeek-V3 routed experts as one GPU of expert parallelism 8 holds them (32 of
# the 256 experts, top-8; gate/up N=4096, K=7168; down N=7168, K=2048), at these token counts.
MOE_EXPERTS, MOE_TOP_K = 32, 8
# Also the whole expert stack on one GPU (256 experts: 7.5 GB for gate/up, no buffer loads).
MOE_ALL_EXPERTS = 256
MOE_SHAPES = ((4096, 7168), (7168, 2048))
MOE_TOKENS = (1, 16, 64, 512, 4096)
QUICK_MOE_TOKENS = (1, 64, 4096)
# RMSNorm (FusedRMSNorm) row widths: hidden sizes of the benchmark's models (Llama-3 70B / Qwen2.5
# 72B 8192, DeepSeek-V3 7168, Mixtral / Llama-3 8B 4096, Qwen2.5 7B 3584, SmolLM2-135M 576), MLA's
# q / kv LoRA ranks (1536, 512), a head dim (128), and one past the one-pass limit (the chunked loop).
NORM_WIDTHS = (128, 512, 576, 1536, 3584, 4096, 7168, 8192, 20480)
QUICK_NORM_WIDTHS = (576, 7168, 20480)
_FP8_MFMA = re.compile(r"v_mfma\w*(?:fp8|bf8|f8f6f4)")


# ----------------------------------------------------------------------------- assembly
def parse_amdgcn(asm: str) -> dict[str, int]:
    """Register, spill, scratch and occupancy numbers of one kernel's AMDGCN text."""

    def meta(name: str) -> int:
        m = re.search(rf"^\s*(?:-\s+)?\.{name}:\s+(\d+)\s*$", asm, re.M)
        if m is None:
            raise ValueError(f"no .{name} in the AMDGCN metadata")
        return int(m.group(1))

    def comment(name: str) -> int:
        m = re.search(rf"^; {name}: (\d+)", asm, re.M)
        if m is None:
            raise ValueError(f"no '; {name}:' line in the AMDGCN text")
        return int(m.group(1))

    return {
        "vgpr": meta("vgpr_count"),
        "agpr": meta("agpr_count"),
        "sgpr": meta("sgpr_count"),
        "vgpr_spill": meta("vgpr_spill_count"),
        "sgpr_spill": meta("sgpr_spill_count"),
        "scratch": comment("ScratchSize"),
        "compiler_occupancy": comment("Occupancy"),
    }


def loop_mfma(asm: str) -> list[str]:
    """MFMA mnemonics inside loops: between a label and a later branch back to it."""
    lines = asm.splitlines()
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        s = line.strip()
        m = re.match(r"^(\.L\w+):", s)
        if m:
            labels[m.group(1)] = i
            continue
        m = re.match(r"^s_(?:c)?branch\w*\s+(\.L\w+)", s)
        if m and m.group(1) in labels:
            loops.append((labels[m.group(1)], i))
    found: list[str] = []
    for start, end in loops:
        for line in lines[start:end]:
            m = re.match(r"^\s*(v_mfma\w+)", line)
            if m and m.group(1) not in found:
                found.append(m.group(1))
    return found


# ----------------------------------------------------------------------------- launches
def _meta(shape: Sequence[int] | tuple = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor with shape and dtype only: real sizes (the 2 GiB buffer-load test), no memory."""
    return torch.empty(shape, dtype=dtype, device="meta")

@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its arguments, and where the dispatch chose it."""

    kernel: Any  # triton JITFunction
    args: tuple
    kwargs: dict[str, Any]
    where: str

    @property
    def name(self) -> str:
        return self.kernel.__name__


class _LaunchList(list):
    """Recorded launches; ``where["label"]`` names the dispatch point of the next ones."""

    where: dict[str, str]


@contextlib.contextmanager
def record_launches(arch: str) -> Iterator[_LaunchList]:
    """Within this context, the fp8linear launchers dispatch as on a ROCm `arch` device and every
    Triton kernel launch is recorded (into the yielded list) instead of run."""
    from triton.runtime.jit import JITFunction

    from ..ops import configs as cfg_mod
    from ..ops import gemm, router

    launches = _LaunchList()
    launches.where = {"label": ""}

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, kwargs, launches.where["label"]))

    cus = cfg_mod.AMD_CU_COUNT.get(arch, 304)
    patches: list[tuple[Any, str, Any]] = [
        (router, "select_config", lambda device, m, n, k, granularity="block": router.config_for_arch(
            arch, m, n, k, granularity)),
        (cfg_mod, "device_arch", lambda device=None: arch),  # launch options
        (router, "device_arch", lambda device=None: arch),  # split-K stages, MoE configs
        (router, "sm_count", lambda device: cus),
        (gemm, "sm_count", lambda device: cus),
        (torch.version, "hip", "amd-check"),  # ROCm as far as the dispatch can tell (no TMA, no PDL)
        (JITFunction, "run", record),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield launches
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _dense_launches(arch: str, shapes: Sequence[tuple[int, int]], ms: Sequence[int],
                    granularities: Sequence[str], fp8: torch.dtype) -> list[Launch]:
    """The dense forward: the router's choice (fused GEMV, or act-quant then split-K or tiled GEMM)."""
    from ..formats import GROUP_SIZE
    from ..ops.linear import run_linear_route
    from ..ops.router import route_linear, tma_ok

    with record_launches(arch) as launches:
        for n, k in shapes:
            g_n, g_k = -(-n // GROUP_SIZE), -(-k // GROUP_SIZE)
            w_q = _meta((n, k), fp8)
            for gran in granularities:
                w_s = {"block": _meta((g_n, g_k)), "row": _meta((n, g_k)),
                       "tensor": _meta(())}[gran]
                for m in ms:
                    launches.where["label"] = f"{gran} N={n} K={k} M={m}"
                    x = _meta((m, k), torch.bfloat16)
                    # eager: as Fp8BlockLinear's eager plans ask (the one-launch decode kernel is
                    # NVIDIA-only; the router declines it on ROCm)
                    route = route_linear(x.device, m, n, k, gran, fp8, x.dtype, None, False, tma_ok(w_q),
                                         eager=True)
                    run_linear_route(route, x, w_q, w_s, gran, None)
    return list(launches)


def _table_launches(arch: str, fp8: torch.dtype, shapes: Sequence[tuple[int, int]] | None = None) -> list[Launch]:
    """Every entry of the arch's shipped table (of `shapes` only, if given), at its shape and M bucket."""
    from ..formats import GROUP_SIZE
    from ..ops.gemm import block_fp8_gemm
    from ..ops.config_tables import load_table, shipped_table_path

    path = shipped_table_path(arch)
    if not path.is_file():
        return []
    table = load_table(path)
    from ..ops.config_tables import _parse_shape_key

    with record_launches(arch) as launches:
        for key, buckets in table.shapes.items():
            n, k, gran = _parse_shape_key(key)
            if shapes is not None and (n, k) not in shapes:
                continue
            g_n, g_k = -(-n // GROUP_SIZE), -(-k // GROUP_SIZE)
            w_q = _meta((n, k), fp8)
            w_s = {"block": _meta((g_n, g_k)), "row": _meta((n, g_k)), "tensor": _meta(())}[gran]
            for bucket in buckets:
                cfg = table.get(n, k, bucket, gran)
                launches.where["label"] = f"table {key} M={bucket}"
                x_q = _meta((bucket, k), fp8)
                x_s = _meta((bucket, g_k))
                block_fp8_gemm(x_q, x_s, w_q, w_s, gran, torch.bfloat16, config=cfg)
    return list(launches)


def _moe_launches(arch: str, tokens: Sequence[int], granularities: Sequence[str], fp8: torch.dtype,
                  experts: Sequence[int] = (MOE_EXPERTS,)) -> list[Launch]:
    from ..formats import GROUP_SIZE
    from ..ops.grouped_gemm import grouped_fp8_gemm, moe_align_block_size
    from ..ops.quant import act_quant
    from ..ops.router import grouped_config

    top_k = MOE_TOP_K
    with record_launches(arch) as launches:
        for e, (n, k) in ((e, s) for e in experts for s in MOE_SHAPES):
            g_n, g_k = -(-n // GROUP_SIZE), -(-k // GROUP_SIZE)
            w_q = _meta((e, n, k), fp8)
            for gran in granularities:
                w_s = {"block": _meta((e, g_n, g_k)), "row": _meta((e, n, g_k)),
                       "tensor": _meta((e,))}[gran]
                for t in tokens:
                    launches.where["label"] = f"moe E={e} {gran} N={n} K={k} T={t}"
                    pairs = t * top_k
                    block_m = grouped_config(pairs, e, n, k).block_m
                    idx = _meta((t, top_k), torch.int32)
                    routing = moe_align_block_size(idx, e, block_m)
                    down = n != MOE_SHAPES[0][0]
                    a_rows = pairs if down else t
                    a_q, a_s = act_quant(_meta((a_rows, k), torch.bfloat16), fp8)
                    grouped_fp8_gemm(a_q, a_s, w_q, w_s, routing.sorted_pair_ids, routing.block_expert, pairs,
                                     1 if down else top_k, gran, torch.bfloat16,
                                     topk_weights=_meta((pairs,)) if down else None)
    return list(launches)


# ----------------------------------------------------------------------------- compile
@dataclass
class KernelReport:
    kernel: str
    config: str
    arch: str
    vgpr: int = 0
    agpr: int = 0
    sgpr: int = 0
    vgpr_spill: int = 0
    sgpr_spill: int = 0
    scratch: int = 0
    lds: int = 0
    occupancy: int = 0
    compiler_occupancy: int = 0
    mfma: str = ""
    gemm: bool = False  # a GEMM: its loops must hold an FP8 MFMA
    num_warps: int = 0
    options: dict[str, int] = field(default_factory=dict)
    uses: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    problems: list[str] = field(default_factory=list)


_OPTION_KEYS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack")


# Size arguments shown as NAME=value when specialized to a constant (1).
_SIZE_ARGS = ("M", "M_IN", "N", "K", "num_pairs")


_ABBREV = {"WS_GROUP_N": "wsg", "W_SCALE_UNIFORM": "uni", "HAS_BIAS": "bias", "GROUP_M": "g", "SCALE_GROUP_K": "sgk",
           "MIN_EXP": "minexp", "RELEASE_EARLY": "rel", "MUL_ROUTED_WEIGHT": "mulw", "A_ROW_DIV": "rowdiv",
           "GROUPS_PER_STEP": "gps", "NUM_BINS": "bins", "CHUNK": "chunk", "SPLIT": "split"}
_OPTION_ABBREV = {"num_warps": "w", "num_stages": "s", "waves_per_eu": "wpe", "matrix_instr_nonkdim": "nk",
                  "kpack": "kp"}


def _config_label(launch: Launch, constexprs: dict[str, Any], aligned: Sequence[str] = ()) -> str:
    """'64x128x128 w4 s2 wpe0 nk16 kp2 g32 uni1 ...': tile, options, other constants, then size
    arguments specialized as 1 ('M=1') and the integer arguments divisible by 16 ('16|N,K')."""
    c = dict(constexprs)
    parts = []
    if "BLOCK_M" in c and "BLOCK_N" in c:
        parts.append("x".join(str(c.pop(k)) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in c))
    elif "BLOCK_M" in c or "BLOCK_N" in c:
        parts.append(f"{'BM' if 'BLOCK_M' in c else 'BN'}={c.pop('BLOCK_M', c.pop('BLOCK_N', None))}")
    parts += [f"{_OPTION_ABBREV[k]}{launch.kwargs[k]}" for k in _OPTION_KEYS if k in launch.kwargs]
    for k, v in c.items():
        if k in ("USE_PDL", "GROUP") or k.startswith("stride"):
            continue
        v = int(v) if isinstance(v, bool) else v
        parts.append(f"{k}={v}" if k in _SIZE_ARGS or k not in _ABBREV else f"{_ABBREV[k]}{v}")
    if aligned:
        parts.append("16|" + ",".join(aligned))
    return " ".join(parts)


def _specialize(launch: Launch, arch: str) -> tuple[Any, dict, dict, dict, dict]:
    """(options, signature, constexprs, attrs, named constexprs) as a real launch on `arch` gets them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    backend = make_backend(GPUTarget("hip", arch, WAVE_SIZE))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(launch.kwargs), bound, specialization, opts)
    named = {fn.arg_names[path[0]]: v for path, v in constexprs.items() if len(path) == 1}
    return options, signature, constexprs, attrs, named


def launch_key(launch: Launch, arch: str) -> tuple:
    """What makes two launches one compile: kernel, specialization and options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    backend = make_backend(GPUTarget("hip", arch, WAVE_SIZE))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _, specialization, opts = binder(*launch.args, **launch.kwargs)
    return (fn.__name__, tuple(map(tuple, specialization)), tuple(sorted(opts.items())))


@dataclass
class CompileJob:
    """Everything a compile needs, picklable: the kernel by module and name, its specialization."""

    module: str
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    arch: str
    config: str
    gemm: bool = False

    def kernel(self) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)


def make_job(launch: Launch, arch: str) -> CompileJob:
    options, signature, constexprs, attrs, named = _specialize(launch, arch)
    names = launch.kernel.arg_names
    aligned = [names[p[0]] for p, a in attrs.items()
               if not str(signature.get(names[p[0]], "*")).startswith("*")
               and any(x[0] == "tt.divisibility" for x in a)]
    return CompileJob(launch.kernel.fn.__module__, launch.name, signature, constexprs, attrs, dict(options.__dict__),
                      arch, _config_label(launch, named, aligned), gemm="tl.dot(" in launch.kernel.src)


def compile_job(job: CompileJob) -> KernelReport:
    """Compile one kernel specialization for its arch and read its assembly."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    rep = KernelReport(kernel=job.name, config=job.config, arch=job.arch, num_warps=job.options["num_warps"],
                       options={k: job.options[k] for k in _OPTION_KEYS}, gemm=job.gemm)
    try:
        compiled = triton.compile(ASTSource(job.kernel(), job.signature, job.constexprs, job.attrs),
                                  target=GPUTarget("hip", job.arch, WAVE_SIZE), options=job.options)
        asm = compiled.asm["amdgcn"]
        nums = parse_amdgcn(asm)
    except Exception as e:  # a compile failure is a finding, reported with the rest
        text = str(e).strip()
        rep.error = f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"
        rep.seconds = time.perf_counter() - t0
        return check_report(rep)
    for key, value in nums.items():
        setattr(rep, key, value)
    rep.lds = int(compiled.metadata.shared)
    rep.mfma = ",".join(loop_mfma(asm))
    rep.gemm = rep.gemm or "v_mfma" in asm
    rep.occupancy = occupancy(rep.compiler_occupancy, rep.lds, rep.num_warps, job.arch)
    rep.seconds = time.perf_counter() - t0
    return check_report(rep)


def compile_launch(launch: Launch, arch: str) -> KernelReport:
    """Compile one recorded launch for `arch` and read its assembly."""
    return compile_job(make_job(launch, arch))


def occupancy(compiler_occupancy: int, lds: int, num_warps: int, arch: str) -> int:
    """Waves per SIMD: the compiler's figure, capped by the workgroups the LDS holds per CU."""
    occ = min(compiler_occupancy, MAX_WAVES_PER_SIMD)
    if lds > 0:
        groups = LDS_BYTES.get(arch, LDS_BYTES["gfx942"]) // lds
        occ = min(occ, groups * num_warps // SIMDS_PER_CU)
    return occ


def check_report(rep: KernelReport) -> KernelReport:
    """Fill `rep.problems`: spills, scratch, too much LDS, a GEMM without FP8 MFMA in its loops."""
    p: list[str] = []
    if rep.error:
        p.append(f"compile failed: {rep.error}")
    else:
        if rep.vgpr_spill:
            p.append(f"{rep.vgpr_spill} VGPRs spilled")
        if rep.sgpr_spill:
            p.append(f"{rep.sgpr_spill} SGPRs spilled")
        if rep.scratch:
            p.append(f"{rep.scratch} B scratch")
        limit = LDS_BYTES.get(rep.arch, LDS_BYTES["gfx942"])
        if rep.lds > limit:
            p.append(f"LDS {rep.lds} B > {limit} B")
        if (rep.kernel in GEMM_KERNELS or rep.gemm) and not _FP8_MFMA.search(rep.mfma):
            p.append("no FP8 MFMA in the main loop" + (f" ({rep.mfma})" if rep.mfma else ""))
    rep.problems = p
    return rep


# ----------------------------------------------------------------------------- driver
def _norm_launches(arch: str, widths: Sequence[int]) -> list[Launch]:
    """RMSNorm (:class:`fp8linear.FusedRMSNorm`'s kernel) over bf16 / fp16 / fp32 rows of each width."""
    from ..ops.rmsnorm import rms_norm

    with record_launches(arch) as launches:
        for n in widths:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                launches.where["label"] = f"rmsnorm N={n} {str(dtype).removeprefix('torch.')}"
                rms_norm(_meta((4, n), dtype), _meta((n,), dtype), 1e-6)
    return list(launches)


def collect(arch: str, quick: bool = False) -> list[tuple[Launch, list[str]]]:
    """Distinct launches of the AMD dispatch on `arch` over the grid, each with where it is used."""
    from .shapes import default_shapes, quick_shapes
    from ..formats import default_fp8_dtype

    fp8 = torch.float8_e4m3fnuz if arch.startswith("gfx94") else default_fp8_dtype("cpu")
    shapes = [(s.n, s.k) for s in (quick_shapes() if quick else default_shapes())]
    grans = ("block",) if quick else ("block", "row", "tensor")
    launches = _dense_launches(arch, shapes, QUICK_MS if quick else GRID_MS, grans, fp8)
    launches += _table_launches(arch, fp8, shapes if quick else None)
    launches += _moe_launches(arch, QUICK_MOE_TOKENS if quick else MOE_TOKENS, grans, fp8,
                              (MOE_EXPERTS,) if quick else (MOE_EXPERTS, MOE_ALL_EXPERTS))
    launches += _norm_launches(arch, QUICK_NORM_WIDTHS if quick else NORM_WIDTHS)
    seen: dict[tuple, tuple[Launch, list[str]]] = {}
    for launch in launches:
        key = launch_key(launch, arch)
        if key not in seen:
            seen[key] = (launch, [])
        seen[key][1].append(launch.where)
    return list(seen.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", nargs="+", default=["gfx942"], choices=ARCHS,
                        help="AMD archs to compile for (default gfx942 = MI300X/MI325X; gfx950 = MI355X)")
    parser.add_argument("--json", metavar="FILE", nargs="?", const="-", default=None,
                        help="write one JSON object per (kernel, config) to FILE (default: stdout)")
    parser.add_argument("--quick", action="store_true",
                        help="a subset: block scales, 5 shapes and their table entries, fewer M values and MoE sizes")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="compile processes (default: min(4, CPUs))")


def _print_table(reports: Sequence[KernelReport], out: Any) -> None:
    head = f"{'kernel':26s} {'config':70s} {'vgpr':>4s} {'agpr':>4s} {'sgpr':>4s} {'vsp':>3s} {'ssp':>3s} " \
           f"{'scr':>4s} {'lds':>6s} {'occ':>3s}  mfma"
    print(head, file=out)
    for r in reports:
        flag = "  <-- " + "; ".join(r.problems) if r.problems else ""
        print(f"{r.kernel:26s} {r.config[:70]:70s} {r.vgpr:4d} {r.agpr:4d} {r.sgpr:4d} {r.vgpr_spill:3d} "
              f"{r.sgpr_spill:3d} {r.scratch:4d} {r.lds:6d} {r.occupancy:3d}  {r.mfma or '-'}{flag}", file=out)


def _summary(reports: Sequence[KernelReport], arch: str, seconds: float) -> str:
    from collections import Counter

    kernels = Counter(r.kernel for r in reports)
    occ = Counter(r.occupancy for r in reports if not r.error)
    bad = [r for r in reports if r.problems]
    listed = "; ".join(f"{r.kernel} [{r.config}]: {', '.join(r.problems)}" for r in bad[:5])
    lines = [
        f"{arch}: {len(reports)} kernel compiles ({', '.join(f'{k} {v}' for k, v in sorted(kernels.items()))}) "
        f"in {seconds:.0f}s",
        "  occupancy (waves/SIMD): " + ", ".join(f"{o}: {c}" for o, c in sorted(occ.items())),
        f"  problems: {len(bad)}" + (f" ({listed}{' ...' if len(bad) > 5 else ''})" if bad else ""),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        log("fp8linear amd-check: compiles kernels, so TRITON_INTERPRET must be unset")
        return 2
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except ImportError:
        log("fp8linear amd-check: needs Triton (pip install triton)")
        return 2
    if "amd" not in backends:
        log("fp8linear amd-check: this Triton has no AMD (HIP) backend")
        return 2
    if args.jobs < 1:
        log("fp8linear amd-check: --jobs must be >= 1")
        return 2
    all_reports: list[KernelReport] = []
    summaries = []
    for arch in args.arch:
        t0 = time.perf_counter()
        items = collect(arch, quick=args.quick)
        jobs = [make_job(launch, arch) for launch, _ in items]
        if args.jobs > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                reports = list(pool.map(compile_job, jobs))
        else:
            reports = [compile_job(j) for j in jobs]
        for rep, (_, uses) in zip(reports, items):
            rep.uses = uses
        reports.sort(key=lambda r: (r.kernel, r.config))
        _print_table(reports, sys.stderr if args.json == "-" else sys.stdout)
        summaries.append(_summary(reports, arch, time.perf_counter() - t0))
        all_reports += reports
    for s in summaries:
        log(s)
    if args.json is not None:
        rows = [asdict(r) for r in all_reports]
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            from pathlib import Path

            path = Path(args.json)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
    return 1 if any(r.problems for r in all_reports) else 0
