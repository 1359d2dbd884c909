"""Checkpoint conversion: BF16/FP16/FP32 -> FP8, FP8 -> BF16, and e4m3fn FP8 -> e4m3fnuz FP8.

Every conversion is planned from the shard headers alone (a deterministic list of output tensors
per output shard; each input shard gives the output shard of the same name), then executed shard
by shard, one tensor chunk at a time. A state file in DST records what is being produced, so a
re-run after an interruption skips the shards that are complete and redoes the rest: the result
is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch
from tqdm.auto import tqdm

from ..formats import GROUP_SIZE, check_granularity, e4m3fn_to_e4m3fnuz, parse_fp8_dtype
from ..functional import dequantize_weight, quantize_weight
from ..reference import weight_granularity, weight_scale_shape
from .checkpoint import (
    TMP_SUFFIX,
    Checkpoint,
    CheckpointError,
    OutputSpec,
    ShardReader,
    ShardWriter,
    TensorInfo,
    atomic_copy,
    atomic_write_bytes,
    check_output_path,
    fsync_dir,
    iter_row_ranges,
    list_tmp_files,
    open_checkpoint,
    walk_regular_files,
)
from ..checkpoint_format import (
    FP8_SAFETENSORS_DTYPES,
    HIGH_PRECISION_DTYPES,
    compile_patterns,
    default_should_quantize,
    fp8_quantization_config,
    fused_experts_are_in_out,
    granularity_from_config,
    is_scale_name,
    module_name,
    safetensors_dtype,
    scale_name,
    weight_name_for_scale,
)

__all__ = [
    "QuantizeOptions",
    "DequantizeOptions",
    "ConversionSummary",
    "STATE_FILE",
    "CHUNK_ELEMENTS",
    "quantize_checkpoint",
    "dequantize_checkpoint",
    "plan_quantization",
]

# Name of the file in DST that marks an unfinished conversion and says which one (for resume).
STATE_FILE = ".fp8linear-state.json"
# Elements per processed chunk (whole 128-row blocks): 2M elements = 4 MiB of BF16 input and
# ~8 MiB per fp32 temporary inside quantize_weight (~14 of them live): ~150 MiB working set.
CHUNK_ELEMENTS = 2 * 2**20
# safetensors dtype strings of all FP8 formats (weights that are already quantized).
_FP8_NAMES = ("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ")
# Output dtypes `dequantize` accepts.
_OUT_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
)
# Bytes of one fp32 scale.
_SCALE_BYTES = 4

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"fp8linear: {msg}", file=sys.stderr)


def _validate_common(workers: int, device: str, chunk_elements: int) -> None:
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not isinstance(chunk_elements, int) or chunk_elements < GROUP_SIZE * GROUP_SIZE:
        raise ValueError(f"chunk_elements must be an integer >= {GROUP_SIZE * GROUP_SIZE}, got {chunk_elements!r}")


@dataclass(frozen=True)
class QuantizeOptions:
    """Options of :func:`quantize_checkpoint` (validated on construction).

    granularity: 'block' (128x128, the default), 'row' (1x128) or 'tensor'; None means 'block'
        for a high-precision input and "keep" for an e4m3fn -> e4m3fnuz conversion.
    fp8_dtype: 'e4m3fn' or 'e4m3fnuz'. On an e4m3fn FP8 checkpoint, 'e4m3fnuz' converts it
        directly (bit rewrite + doubled scales, no BF16 round trip).
    ignore / only: regexes searched in tensor names; `ignore` keeps matches in high precision,
        `only` restricts quantization to matches (on top of the default rules).
    """

    granularity: str | None = None
    fp8_dtype: str = "e4m3fn"
    ignore: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    device: str = "cpu"
    workers: int = 1
    overwrite: bool = False
    allow_nonfinite: bool = False
    progress: bool = True
    chunk_elements: int = CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        if self.granularity is not None:
            check_granularity(self.granularity)
        dtype = parse_fp8_dtype(self.fp8_dtype)  # ValueError for unknown names
        object.__setattr__(self, "fp8_dtype", "e4m3fnuz" if dtype == torch.float8_e4m3fnuz else "e4m3fn")
        for key in ("ignore", "only"):
            value = getattr(self, key)
            value = (value,) if isinstance(value, str) else tuple(value or ())
            compile_patterns(value, f"--{key}")
            object.__setattr__(self, key, value)
        _validate_common(self.workers, self.device, self.chunk_elements)

    def identity(self) -> dict[str, object]:
        """The options that determine the output bytes (recorded for resume)."""
        return {k: v for k, v in asdict(self).items() if k in ("granularity", "fp8_dtype", "ignore", "only", "allow_nonfinite")}


@dataclass(frozen=True)
class DequantizeOptions:
    """Options of :func:`dequantize_checkpoint`: output dtype ('bfloat16', 'float16', 'float32')."""

    dtype: str = "bfloat16"
    device: str = "cpu"
    workers: int = 1
    overwrite: bool = False
    progress: bool = True
    chunk_elements: int = CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        name = str(self.dtype).removeprefix("torch.")
        name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(name, name)
        if name not in _OUT_DTYPES:
            raise ValueError(f"unknown output dtype {self.dtype!r}; expected one of {', '.join(_OUT_DTYPES)}")
        object.__setattr__(self, "dtype", name)
        _validate_common(self.workers, self.device, self.chunk_elements)

    def identity(self) -> dict[str, object]:
        return {"dtype": self.dtype}


@dataclass
class ConversionSummary:
    """What a conversion did; ``str(summary)`` is the one-paragraph report the CLI prints."""

    command: str
    src: str
    dst: str
    shards: int = 0
    shards_resumed: int = 0
    tensors_quantized: int = 0
    tensors_dequantized: int = 0
    tensors_converted: int = 0
    tensors_kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bytes_converted: int = 0  # input bytes converted by this run (less than bytes_in when resumed)
    seconds: float = 0.0
    details: str = ""

    def __str__(self) -> str:
        gib = 2**30
        done = []
        if self.tensors_quantized:
            done.append(f"quantized {self.tensors_quantized} tensors")
        if self.tensors_dequantized:
            done.append(f"dequantized {self.tensors_dequantized} tensors")
        if self.tensors_converted:
            done.append(f"converted {self.tensors_converted} tensors to e4m3fnuz")
        done.append(f"kept {self.tensors_kept} unchanged")
        rate = self.bytes_converted / max(self.seconds, 1e-9) / 2**20
        resumed = f" ({self.shards_resumed} already done by an earlier run)" if self.shards_resumed else ""
        return (
            f"{self.command}: {', '.join(done)}{self.details}; {self.shards} shards{resumed}; "
            f"{self.bytes_in / gib:.3f} GiB -> {self.bytes_out / gib:.3f} GiB in {self.seconds:.1f} s "
            f"({rate:.0f} MiB/s); wrote {self.dst}"
        )


# ----------------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class _Job:
    """One source tensor and what to do with it."""

    kind: str  # "copy" | "quantize" | "dequantize" | "fnuz_weight" | "fnuz_scale"
    source: TensorInfo
    outputs: tuple[OutputSpec, ...]
    granularity: str = ""
    scale: TensorInfo | None = None  # dequantize: the weight's scale (possibly in another shard)


@dataclass
class _Counts:
    quantized: int = 0
    dequantized: int = 0
    converted: int = 0
    kept: int = 0


@dataclass
class _Plan:
    command: str
    jobs: dict[str, list[_Job]]  # source shard -> jobs, in a fixed order
    config: dict | None  # new config.json content (None: no config.json)
    identity: dict[str, object]
    counts: _Counts = field(default_factory=_Counts)
    details: str = ""


class _Context:
    """Per-run state shared by the shard workers (no globals)."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, chunk_elements: int, allow_nonfinite: bool,
                 fp8_dtype: torch.dtype, out_dtype: torch.dtype):  # fmt: skip
        self.ckpt = ckpt
        self.device = device
        self.chunk_elements = chunk_elements
        self.allow_nonfinite = allow_nonfinite
        self.fp8_dtype = fp8_dtype
        self.out_dtype = out_dtype
        self.abort = threading.Event()

    def check_abort(self) -> None:
        if self.abort.is_set():
            raise _Aborted()


class _Aborted(Exception):
    """Raised in a worker when another worker failed or the user interrupted."""


def _rows_per_chunk(rows: int, cols: int, chunk_elements: int, align: int) -> int:
    step = max(align, (chunk_elements // max(cols, 1)) // align * align)
    return min(step, max(rows, 1))


def _check_finite(w: torch.Tensor, s: torch.Tensor, info: TensorInfo, ctx: _Context, expert: int | None,
                  row0: int) -> None:  # fmt: skip
    """Refuse a chunk (rows from `row0`, of `expert` for 3-D) with NaN/Inf unless allowed.

    A NaN/Inf weight makes its group's amax, hence its scale `s`, non-finite, so the (small)
    scale tensor is checked; the weight is scanned only to name the first bad element.
    """
    if ctx.allow_nonfinite or bool(torch.isfinite(s).all()):
        return
    r, c = torch.nonzero(~torch.isfinite(w))[0].tolist()
    pos = [row0 + r, c] if expert is None else [expert, row0 + r, c]
    kind = "NaN" if bool(torch.isnan(w).any()) else "Inf"
    raise CheckpointError(
        f"{ctx.ckpt.root / info.shard}: tensor {info.name!r} contains {kind} (first non-finite value at index "
        f"{pos}); refusing to quantize it (pass --allow-nonfinite to quantize anyway)"
    )


def _expert_views(info: TensorInfo) -> list[int | None]:
    return [None] if len(info.shape) == 2 else list(range(info.shape[0]))


def _run_copy(job: _Job, reader: ShardReader, writer: ShardWriter, ctx: _Context, advance: Callable[[int], None]) -> None:
    info = job.source
    if len(info.shape) == 0 or info.numel == 0:
        writer.write(info.name, 0, reader.read(info.name))
        advance(info.nbytes)
        return
    row_elems = info.numel // info.shape[0]
    row_bytes = info.nbytes // info.shape[0]
    step = _rows_per_chunk(info.shape[0], row_elems, ctx.chunk_elements, 1)
    for r0, r1 in iter_row_ranges(info.shape[0], step):
        ctx.check_abort()
        writer.write(info.name, r0 * row_bytes, reader.read(info.name, (slice(r0, r1),)))
        advance((r1 - r0) * row_bytes)


def _read_rows(reader: ShardReader, name: str, expert: int | None, r0: int, r1: int) -> torch.Tensor:
    if expert is None:
        return reader.read(name, (slice(r0, r1),))
    return reader.read(name, (slice(expert, expert + 1), slice(r0, r1)))[0]


def _run_quantize(job: _Job, reader: ShardReader, writer: ShardWriter, ctx: _Context, advance: Callable[[int], None]) -> None:
    info, gran = job.source, job.granularity
    n, k = info.shape[-2:]
    sname = scale_name(info.name)
    scale_grid = weight_scale_shape((n, k), gran)
    kb = scale_grid[-1] if scale_grid else 1
    expert_scale_bytes = math.prod(scale_grid) * _SCALE_BYTES
    elem = info.nbytes // info.numel
    step = _rows_per_chunk(n, k, ctx.chunk_elements, GROUP_SIZE)  # whole 128-row blocks
    for e in _expert_views(info):
        base = 0 if e is None else e
        amax = _matrix_amax(reader, info, ctx, e, step) if gran == "tensor" else None
        for r0, r1 in iter_row_ranges(n, step):
            ctx.check_abort()
            w = _read_rows(reader, info.name, e, r0, r1)
            if amax is None:
                q, s = quantize_weight(w.to(ctx.device), gran, ctx.fp8_dtype)
                _check_finite(w, s, info, ctx, e, r0)
            else:
                # One extra row holding the matrix's largest magnitude gives this chunk exactly the
                # whole matrix's per-tensor scale, so the bytes equal quantize_weight(whole matrix).
                extra = torch.zeros(1, k, dtype=w.dtype)
                extra[0, 0] = amax
                q, s = quantize_weight(torch.cat([w, extra]).to(ctx.device), gran, ctx.fp8_dtype)
                q = q[:-1]
            writer.write(info.name, (base * n + r0) * k, q)
            if gran != "tensor" or r0 == 0:
                s_row = {"block": (r0 // GROUP_SIZE) * kb, "row": r0 * kb, "tensor": 0}[gran]
                writer.write(sname, base * expert_scale_bytes + s_row * _SCALE_BYTES, s)
            advance((r1 - r0) * k * elem)


def _matrix_amax(reader: ShardReader, info: TensorInfo, ctx: _Context, expert: int | None, step: int) -> torch.Tensor:
    """Largest |w| of one (N, K) matrix (exact, in its dtype), read in chunks; refuses NaN/Inf unless allowed."""
    amax = None
    for r0, r1 in iter_row_ranges(info.shape[-2], step):
        ctx.check_abort()
        w = _read_rows(reader, info.name, expert, r0, r1)
        m = w.abs().max()  # NaN propagates, Inf stays: non-finite iff the chunk is
        _check_finite(w, m, info, ctx, expert, r0)
        amax = m if amax is None else torch.maximum(amax, m)
    assert amax is not None
    return amax


def _run_dequantize(job: _Job, reader: ShardReader, writer: ShardWriter, ctx: _Context, advance: Callable[[int], None]) -> None:
    info = job.source
    assert job.scale is not None
    if job.scale.shard == info.shard:
        scale = reader.read(job.scale.name)
    else:  # official DeepSeek-V3 checkpoints may keep a weight's scale in another shard
        with ShardReader(ctx.ckpt.shard_path(job.scale.shard)) as other:
            scale = other.read(job.scale.name)
    scale = scale.float()
    try:
        gran = weight_granularity(info.shape, scale.shape)
    except ValueError as exc:
        raise CheckpointError(f"{ctx.ckpt.root / info.shard}: tensor {info.name!r}: {exc}") from None
    n, k = info.shape[-2:]
    step = _rows_per_chunk(n, k, ctx.chunk_elements, GROUP_SIZE)
    out_elem = torch.empty((), dtype=ctx.out_dtype).element_size()
    for e in _expert_views(info):
        s_e = scale if e is None else scale[e]
        base = 0 if e is None else e
        for r0, r1 in iter_row_ranges(n, step):
            ctx.check_abort()
            q = _read_rows(reader, info.name, e, r0, r1)
            if gran == "block":
                s = s_e[r0 // GROUP_SIZE : -(-r1 // GROUP_SIZE)]
            elif gran == "row":
                s = s_e[r0:r1]
            else:
                s = s_e
            w = dequantize_weight(q.to(ctx.device), s.to(ctx.device), ctx.out_dtype)
            writer.write(info.name, (base * n + r0) * k * out_elem, w)
            advance((r1 - r0) * k)


def _run_fnuz_weight(job: _Job, reader: ShardReader, writer: ShardWriter, ctx: _Context, advance: Callable[[int], None]) -> None:
    info = job.source
    unit_scale = torch.ones((), dtype=torch.float32)  # scales are converted by their own job
    row = info.numel // info.shape[0]
    step = _rows_per_chunk(info.shape[0], row, ctx.chunk_elements, 1)
    for r0, r1 in iter_row_ranges(info.shape[0], step):
        ctx.check_abort()
        w, _ = e4m3fn_to_e4m3fnuz(reader.read(info.name, (slice(r0, r1),)), unit_scale)
        writer.write(info.name, r0 * row, w)
        advance((r1 - r0) * row)


def _run_fnuz_scale(job: _Job, reader: ShardReader, writer: ShardWriter, ctx: _Context, advance: Callable[[int], None]) -> None:
    info = job.source
    no_weight = torch.empty(0, dtype=torch.float8_e4m3fn)  # the weight is converted by its own job
    _, s = e4m3fn_to_e4m3fnuz(no_weight, reader.read(info.name))
    writer.write(info.name, 0, s)
    advance(info.nbytes)


# Job kind -> the function that executes it (read-only).
_RUNNERS: Mapping[str, Callable[..., None]] = MappingProxyType({
    "copy": _run_copy,
    "quantize": _run_quantize,
    "dequantize": _run_dequantize,
    "fnuz_weight": _run_fnuz_weight,
    "fnuz_scale": _run_fnuz_scale,
})


# ----------------------------------------------------------------------------------- plans
def _copy_job(info: TensorInfo) -> _Job:
    return _Job("copy", info, (OutputSpec(info.name, info.dtype, info.shape),))


def _fp8_tensors(ckpt: Checkpoint) -> list[TensorInfo]:
    return [t for t in ckpt.tensors.values() if t.dtype in _FP8_NAMES]


def _kept_modules(ckpt: Checkpoint, quantized: set[str]) -> list[str]:
    """Modules whose linear-like weights stay in high precision (for `modules_to_not_convert`)."""
    kept = set()
    for t in ckpt.tensors.values():
        if t.name in quantized or t.dtype not in HIGH_PRECISION_DTYPES or is_scale_name(t.name):
            continue
        if (len(t.shape) == 2 and t.name.endswith(".weight")) or (
            len(t.shape) == 3 and "experts" in t.name.split(".") and not t.name.endswith("bias")
        ):
            kept.add(module_name(t.name))
    return sorted(kept)


def _already_quantized(ckpt: Checkpoint) -> str | None:
    qcfg = ckpt.quantization_config
    if qcfg is not None:
        return f"config.json has quantization_config with quant_method {qcfg.get('quant_method')!r}"
    fp8 = _fp8_tensors(ckpt)
    if fp8:
        return f"tensor {fp8[0].name!r} is already {fp8[0].dtype}"
    scales = [t for t in ckpt.tensors.values() if is_scale_name(t.name)]
    if scales:
        return f"it has scale tensors such as {scales[0].name!r}"
    return None


def plan_quantization(ckpt: Checkpoint, options: QuantizeOptions, log: Log | None = None) -> _Plan:
    """Decide, from headers only, what each tensor becomes. Raises CheckpointError if impossible."""
    already = _already_quantized(ckpt)
    if already is not None:
        return _plan_fnuz_conversion(ckpt, options, already)
    gran = options.granularity or "block"
    dtype = parse_fp8_dtype(options.fp8_dtype)
    ignore = compile_patterns(options.ignore, "--ignore")
    only = compile_patterns(options.only, "--only")
    jobs: dict[str, list[_Job]] = {}
    quantized: set[str] = set()
    plan = _Plan("quantize", jobs, None, {"command": "quantize", **options.identity()})
    in_out = fused_experts_are_in_out(ckpt.config)
    skipped_in_out = 0
    for shard in ckpt.shards:
        shard_jobs = []
        for info in sorted(ckpt.shard_tensors(shard), key=lambda t: t.name):
            transposed = in_out and len(info.shape) == 3
            skipped_in_out += transposed and default_should_quantize(info.name, info.shape, info.dtype)
            wanted = (
                not transposed
                and default_should_quantize(info.name, info.shape, info.dtype)
                and not any(p.search(info.name) for p in ignore)
                and (not only or any(p.search(info.name) for p in only))
            )
            if not wanted:
                shard_jobs.append(_copy_job(info))
                plan.counts.kept += 1
                continue
            sname = scale_name(info.name)
            if sname in ckpt.tensors:
                raise CheckpointError(f"{ckpt.root / info.shard}: tensor {sname!r} already exists; cannot add the scale")
            outputs = (
                OutputSpec(info.name, FP8_SAFETENSORS_DTYPES[dtype], info.shape),
                OutputSpec(sname, "F32", weight_scale_shape(info.shape, gran)),
            )
            shard_jobs.append(_Job("quantize", info, outputs, gran))
            quantized.add(info.name)
            plan.counts.quantized += 1
        jobs[shard] = shard_jobs
    if skipped_in_out and log is not None:
        log(f"note: kept {skipped_in_out} fused [E, in, out] expert tensors of this model type in high precision")
    if not quantized:
        raise CheckpointError(f"{ckpt.root}: no tensor to quantize (no 2-D linear weight or fused expert matched)")
    if ckpt.config is not None:
        config = dict(ckpt.config)
        config["quantization_config"] = fp8_quantization_config(gran, dtype, _kept_modules(ckpt, quantized))
        plan.config = config
    plan.details = f" ({gran}, {options.fp8_dtype})"
    return plan


def _plan_fnuz_conversion(ckpt: Checkpoint, options: QuantizeOptions, already: str) -> _Plan:
    qcfg = ckpt.quantization_config
    fp8 = _fp8_tensors(ckpt)
    convertible = (
        options.fp8_dtype == "e4m3fnuz"
        and fp8
        and all(t.dtype == "F8_E4M3" for t in fp8)
        and (qcfg is None or qcfg.get("quant_method") == "fp8")
    )
    if not convertible:
        if options.fp8_dtype == "e4m3fn":
            hint = (
                "nothing to do; `fp8linear dequantize` turns it back into BF16, and `--fp8-dtype e4m3fnuz` "
                "converts an e4m3fn FP8 checkpoint to fnuz"
            )
        else:
            hint = "only e4m3fn FP8 checkpoints (quant_method 'fp8') can be converted to e4m3fnuz"
        raise CheckpointError(f"{ckpt.root}: checkpoint is already quantized ({already}); {hint}")
    if options.granularity is not None:
        raise CheckpointError(
            f"{ckpt.root}: --granularity cannot change an already-quantized checkpoint (converting e4m3fn -> "
            "e4m3fnuz keeps its scales' layout); dequantize it first to re-quantize"
        )
    weights = {t.name for t in fp8}
    jobs: dict[str, list[_Job]] = {}
    plan = _Plan("quantize", jobs, None, {"command": "quantize", **options.identity()})
    for shard in ckpt.shards:
        shard_jobs = []
        for info in sorted(ckpt.shard_tensors(shard), key=lambda t: t.name):
            if info.name in weights:
                if scale_name(info.name) not in ckpt.tensors:
                    raise CheckpointError(f"{ckpt.root / shard}: FP8 tensor {info.name!r} has no {scale_name(info.name)!r}")
                out = (OutputSpec(info.name, "F8_E4M3FNUZ", info.shape),)
                shard_jobs.append(_Job("fnuz_weight", info, out))
                plan.counts.converted += 1
            elif is_scale_name(info.name) and weight_name_for_scale(info.name) in weights:
                if info.dtype != "F32":
                    raise CheckpointError(f"{ckpt.root / shard}: scale {info.name!r} is {info.dtype}, expected F32")
                shard_jobs.append(_Job("fnuz_scale", info, (OutputSpec(info.name, "F32", info.shape),)))
            else:
                shard_jobs.append(_copy_job(info))
                plan.counts.kept += 1
        jobs[shard] = shard_jobs
    if ckpt.config is not None:
        config = dict(ckpt.config)
        if qcfg is not None:
            new_q = dict(qcfg)
            new_q["fp8_dtype"] = "e4m3fnuz"
        else:
            first = fp8[0]
            gran = weight_granularity(first.shape, ckpt.tensors[scale_name(first.name)].shape)
            new_q = fp8_quantization_config(gran, "e4m3fnuz", _kept_modules(ckpt, weights))
        config["quantization_config"] = new_q
        plan.config = config
    plan.details = " (e4m3fn -> e4m3fnuz, scales x2)"
    return plan


def _plan_dequantization(ckpt: Checkpoint, options: DequantizeOptions) -> _Plan:
    qcfg = ckpt.quantization_config
    if qcfg is not None and qcfg.get("quant_method") != "fp8":
        raise CheckpointError(
            f"{ckpt.root / 'config.json'}: quant_method {qcfg.get('quant_method')!r} is not supported; only 'fp8'"
        )
    fp8 = {t.name for t in _fp8_tensors(ckpt)}
    if not fp8:
        raise CheckpointError(f"{ckpt.root}: not an FP8 checkpoint (no FP8 tensors); nothing to dequantize")
    if qcfg is not None and qcfg.get("weight_block_size") is not None:
        granularity_from_config(qcfg)  # ValueError on an unsupported block size, caught below
    out_name = safetensors_dtype(_OUT_DTYPES[options.dtype])
    jobs: dict[str, list[_Job]] = {}
    plan = _Plan("dequantize", jobs, None, {"command": "dequantize", **options.identity()})
    for shard in ckpt.shards:
        shard_jobs = []
        for info in sorted(ckpt.shard_tensors(shard), key=lambda t: t.name):
            if info.name in fp8:
                scale = ckpt.tensors.get(scale_name(info.name))
                if scale is None:
                    raise CheckpointError(
                        f"{ckpt.root / shard}: FP8 tensor {info.name!r} has no scale {scale_name(info.name)!r}"
                    )
                if len(info.shape) not in (2, 3):
                    raise CheckpointError(f"{ckpt.root / shard}: FP8 tensor {info.name!r} has shape {list(info.shape)}; expected 2-D or 3-D")
                try:
                    weight_granularity(info.shape, scale.shape)
                except ValueError as exc:
                    raise CheckpointError(f"{ckpt.root / shard}: tensor {info.name!r}: {exc}") from None
                out = (OutputSpec(info.name, out_name, info.shape),)
                shard_jobs.append(_Job("dequantize", info, out, scale=scale))
                plan.counts.dequantized += 1
            elif is_scale_name(info.name):
                weight = weight_name_for_scale(info.name)
                if weight not in fp8:
                    raise CheckpointError(
                        f"{ckpt.root / shard}: scale {info.name!r} has no FP8 weight {weight!r} to go with it"
                    )
            else:
                shard_jobs.append(_copy_job(info))
                plan.counts.kept += 1
        jobs[shard] = shard_jobs
    if ckpt.config is not None:
        config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
        plan.config = config
    plan.details = f" (to {options.dtype})"
    return plan


# ----------------------------------------------------------------------------------- execution
def _same_or_nested(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _source_fingerprint(ckpt: Checkpoint) -> list[list[object]]:
    out: list[list[object]] = []
    for shard in ckpt.shards:
        st = ckpt.shard_path(shard).stat()
        out.append([shard, st.st_size, st.st_mtime_ns])
    return out


def _clean_for_overwrite(dst: Path, planned: Sequence[str]) -> None:
    """Remove what a previous conversion may have left in DST: checkpoint files and our own files."""
    doomed = {dst / STATE_FILE}
    suffixes = (".safetensors", ".safetensors.index.json", TMP_SUFFIX)
    doomed.update(p for p in walk_regular_files(dst) if p.name.endswith(suffixes))
    doomed.update(check_output_path(dst, rel) for rel in planned)
    for p in sorted(doomed):
        if p.is_symlink() or p.is_file():
            p.unlink()


def _prepare_dst(ckpt: Checkpoint, dst: Path, state: dict, overwrite: bool, planned: Sequence[str]) -> bool:
    """Make DST ready; True if an interrupted run of the same conversion is resumed."""
    state = json.loads(json.dumps(state))  # as it reads back from disk (tuples become lists)
    src_res, dst_res = ckpt.root.resolve(), dst.resolve()
    if _same_or_nested(src_res, dst_res):
        raise CheckpointError(f"{dst}: the output folder must not be the input folder or inside/around it ({ckpt.root})")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder")
    dst.mkdir(parents=True, exist_ok=True)
    entries = list(dst.iterdir())
    state_path = dst / STATE_FILE
    if entries and overwrite:
        _clean_for_overwrite(dst, planned)
    elif entries:
        saved = None
        if state_path.is_file():
            try:
                saved = json.loads(state_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                saved = None
        if saved == state:
            for tmp in list_tmp_files(dst):
                tmp.unlink()
            return True
        if saved is not None:
            raise CheckpointError(
                f"{dst}: holds an unfinished conversion with other options or inputs; re-run it with the same "
                "options to finish it, or pass --overwrite to start over"
            )
        raise CheckpointError(f"{dst}: output folder is not empty; pass --overwrite to replace it")
    atomic_write_bytes(state_path, (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
    return False


def _resolve_device(device: str, log: Log) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log("note: --device cuda requested but no CUDA/ROCm device is available; quantizing on the CPU")
        return torch.device("cpu")
    return dev


def _index_bytes(ckpt: Checkpoint, specs: dict[str, list[OutputSpec]]) -> bytes:
    assert ckpt.index is not None
    weight_map = {s.name: shard for shard, ss in specs.items() for s in ss}
    metadata = dict(ckpt.index.get("metadata") or {})
    metadata["total_size"] = sum(s.nbytes for ss in specs.values() for s in ss)
    if "total_parameters" in metadata:
        metadata["total_parameters"] = sum(math.prod(s.shape) for ss in specs.values() for s in ss)
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2) + "\n").encode()


def _execute(ckpt: Checkpoint, dst: Path, plan: _Plan, ctx: _Context, workers: int, overwrite: bool,
             progress: bool, log: Log) -> ConversionSummary:  # fmt: skip
    start = time.perf_counter()
    specs = {shard: [o for job in jobs for o in job.outputs] for shard, jobs in plan.jobs.items()}
    planned = list(plan.jobs) + ([ckpt.index_name] if ckpt.index_name else []) + ckpt.other_files + ["config.json"]
    outputs = {shard: check_output_path(dst, shard, "output shard") for shard in plan.jobs}
    state = {"tool": "fp8linear", **plan.identity, "source": str(ckpt.root.resolve()), "files": _source_fingerprint(ckpt)}
    resumed = _prepare_dst(ckpt, dst, state, overwrite, planned)

    writers = {shard: ShardWriter(outputs[shard], specs[shard]) for shard in plan.jobs}
    done = [s for s in plan.jobs if resumed and writers[s].is_complete_on_disk()]
    pending = [s for s in plan.jobs if s not in done]
    if done:
        log(f"resuming: {len(done)} of {len(plan.jobs)} shards already complete in {dst}")
    sizes = {s: ckpt.shard_size(s) for s in plan.jobs}
    total = sum(sizes.values())
    lock = threading.Lock()
    bar_kw = {"unit": "B", "unit_scale": True, "unit_divisor": 1024, "disable": not progress, "dynamic_ncols": True}
    overall = tqdm(total=total, initial=sum(sizes[s] for s in done), desc="total", position=0, **bar_kw)

    def convert_shard(shard: str) -> None:
        jobs = plan.jobs[shard]
        with lock:
            bar = tqdm(total=sizes[shard], desc=Path(shard).name, leave=False, **bar_kw)
        counted = 0

        def advance(n: int) -> None:
            nonlocal counted
            counted += n
            with lock:
                bar.update(n)
                overall.update(n)

        try:
            with ShardReader(ckpt.shard_path(shard)) as reader, writers[shard] as writer:
                for job in jobs:
                    _RUNNERS[job.kind](job, reader, writer, ctx, advance)
                writer.commit()
            advance(sizes[shard] - counted)  # header bytes
        finally:
            with lock:
                bar.close()

    try:
        if pending:
            # Worker threads even for one worker: glibc gives each thread its own malloc arena that keeps
            # the freed chunk buffers mapped, where the main thread's mmap/munmap per chunk (page
            # faults on every chunk) measured ~3x slower.
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp8linear") as pool:
                futures = [pool.submit(convert_shard, s) for s in pending]
                try:
                    wait(futures, return_when=FIRST_EXCEPTION)
                finally:  # first failure or Ctrl-C: stop the other workers (they delete their temp files)
                    if not all(f.done() and f.exception() is None for f in futures):
                        ctx.abort.set()
                        for f in futures:
                            f.cancel()
                errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()]
                if errors:
                    real = [e for e in errors if not isinstance(e, _Aborted)]
                    raise (real or errors)[0]
    finally:
        overall.close()

    if ckpt.index is not None and ckpt.index_name is not None:
        atomic_write_bytes(check_output_path(dst, ckpt.index_name, "index"), _index_bytes(ckpt, specs))
    for rel in ckpt.other_files:
        atomic_copy(ckpt.root / rel, check_output_path(dst, rel, "file"))
    if plan.config is not None:
        atomic_write_bytes(dst / "config.json", (json.dumps(plan.config, indent=2) + "\n").encode())
    (dst / STATE_FILE).unlink(missing_ok=True)
    fsync_dir(dst)
    if ckpt.skipped_files:
        log(f"note: not copied (pickle or not in the index): {', '.join(ckpt.skipped_files)}")
    if ckpt.config is None:
        log(f"note: {ckpt.root} has no config.json, so no quantization_config was written")
    return ConversionSummary(
        command=plan.command,
        src=str(ckpt.root),
        dst=str(dst),
        shards=len(plan.jobs),
        shards_resumed=len(done),
        tensors_quantized=plan.counts.quantized,
        tensors_dequantized=plan.counts.dequantized,
        tensors_converted=plan.counts.converted,
        tensors_kept=plan.counts.kept,
        bytes_in=total,
        bytes_out=sum(w.size for w in writers.values()),
        bytes_converted=sum(sizes[s] for s in pending),
        seconds=time.perf_counter() - start,
        details=plan.details,
    )


def quantize_checkpoint(
    src: str | Path, dst: str | Path, options: QuantizeOptions | None = None, *, log: Log | None = None, **kwargs: object
) -> ConversionSummary:
    """Quantize a safetensors checkpoint folder `src` to FP8 into `dst`.

    `options` (or the same fields as keyword arguments) as in :class:`QuantizeOptions`. On an
    e4m3fn FP8 checkpoint with ``fp8_dtype='e4m3fnuz'`` it converts the FP8 weights to fnuz.
    Raises :class:`CheckpointError` (one-line message) for bad input.
    """
    if options is None:
        options = QuantizeOptions(**kwargs)  # type: ignore[arg-type]
    elif kwargs:
        raise TypeError("pass either options or keyword options, not both")
    log = log or _stderr_log
    if Path(src).is_file():
        raise CheckpointError(f"{src}: SRC must be a model folder, not a file")
    ckpt = open_checkpoint(src)
    plan = plan_quantization(ckpt, options, log)
    ctx = _Context(ckpt, _resolve_device(options.device, log), options.chunk_elements, options.allow_nonfinite,
                   parse_fp8_dtype(options.fp8_dtype), torch.bfloat16)  # fmt: skip
    return _execute(ckpt, Path(dst), plan, ctx, options.workers, options.overwrite, options.progress, log)


def dequantize_checkpoint(
    src: str | Path, dst: str | Path, options: DequantizeOptions | None = None, *, log: Log | None = None, **kwargs: object
) -> ConversionSummary:
    """Dequantize an FP8 checkpoint (ours or official DeepSeek-V3 format) to BF16 (or `dtype`) into `dst`.

    Drops the ``*_scale_inv`` tensors and ``quantization_config``.
    """
    if options is None:
        options = DequantizeOptions(**kwargs)  # type: ignore[arg-type]
    elif kwargs:
        raise TypeError("pass either options or keyword options, not both")
    log = log or _stderr_log
    if Path(src).is_file():
        raise CheckpointError(f"{src}: SRC must be a model folder, not a file")
    ckpt = open_checkpoint(src)
    try:
        plan = _plan_dequantization(ckpt, options)
    except ValueError as exc:
        raise CheckpointError(f"{ckpt.root / 'config.json'}: {exc}") from None
    ctx = _Context(ckpt, _resolve_device(options.device, log), options.chunk_elements, True,
                   torch.float8_e4m3fn, _OUT_DTYPES[options.dtype])  # fmt: skip
    return _execute(ckpt, Path(dst), plan, ctx, options.workers, options.overwrite, options.progress, log)
