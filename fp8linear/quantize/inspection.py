"""``fp8linear inspect``: what a checkpoint holds, and how much FP8 quantization would cost per layer.

Without ``error=True`` only the safetensors headers are read. With it, every weight that
``fp8linear quantize`` would convert is quantized at all three granularities (128x128 blocks,
1x128 rows, one scale per tensor) through :func:`fp8linear.quantize_weight`, and the relative
error ``||W - dq(q(W))|| / ||W||`` and SQNR ``10 log10(||W||^2 / ||W - dq(q(W))||^2)`` are reported
side by side, reading one chunk of whole 128-row blocks at a time (so memory stays bounded).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..formats import GRANULARITIES, GROUP_SIZE, parse_fp8_dtype
from ..functional import dequantize_weight, quantize_weight
from ..reference import weight_granularity, weight_scale_shape
from .checkpoint import DTYPE_SIZES, Checkpoint, CheckpointError, ShardReader, TensorInfo, iter_row_ranges, open_checkpoint
from .convert import CHUNK_ELEMENTS
from ..checkpoint_format import (
    compile_patterns,
    default_should_quantize,
    granularity_from_config,
    is_scale_name,
    scale_name,
)

__all__ = ["LayerError", "CheckpointReport", "inspect_checkpoint", "quantization_error"]

# safetensors dtype strings of FP8 weights.
_FP8_NAMES = ("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ")


@dataclass
class LayerError:
    """Quantization error of one weight at each granularity."""

    name: str
    shape: tuple[int, ...]
    rel_error: dict[str, float]
    sqnr_db: dict[str, float]


@dataclass
class CheckpointReport:
    path: str
    shards: int
    tensors: int
    total_bytes: int  # tensor data bytes
    dtypes: dict[str, dict[str, int]]  # dtype -> {"tensors": n, "bytes": b}
    quantized_weights: int  # FP8 weights that have a scale
    scale_tensors: int
    unquantized_tensors: int
    quantizable: list[str]  # high-precision weights `fp8linear quantize` would convert
    bytes_after: dict[str, int]  # estimated data bytes after quantize (per granularity) or dequantize
    quantization_config: dict | None
    granularity: str | None  # of an FP8 checkpoint
    fp8_dtype: str | None
    errors: list[LayerError] = field(default_factory=list)
    total_error: dict[str, dict[str, float]] = field(default_factory=dict)  # gran -> rel_error / sqnr_db
    tensor_list: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    def format(self, list_tensors: bool = False) -> str:
        lines = [f"checkpoint: {self.path}", f"shards: {self.shards}, tensors: {self.tensors}, data: {_size(self.total_bytes)}"]
        for dtype, d in sorted(self.dtypes.items()):
            lines.append(f"  {dtype:<12} {d['tensors']:>6} tensors  {_size(d['bytes']):>10}")
        if self.quantized_weights:
            lines.append(
                f"quantized: {self.quantized_weights} FP8 weights ({self.fp8_dtype}, {self.granularity}) + "
                f"{self.scale_tensors} scale tensors; {self.unquantized_tensors} other tensors in high precision"
            )
            lines.append(f"size: {_size(self.total_bytes)} now -> {_size(self.bytes_after.get('bfloat16', 0))} after dequantize (bfloat16)")
        else:
            lines.append(f"quantized: none; {len(self.quantizable)} weights would be quantized, "
                         f"{self.tensors - len(self.quantizable)} kept")  # fmt: skip
            after = ", ".join(f"{g} {_size(b)}" for g, b in self.bytes_after.items())
            lines.append(f"size: {_size(self.total_bytes)} now -> after quantize: {after}")
        cfg = json.dumps(self.quantization_config) if self.quantization_config is not None else "none"
        lines.append(f"quantization_config: {cfg}")
        if list_tensors:
            lines.append("tensors:")
            for t in self.tensor_list:
                lines.append(f"  {t['name']:<60} {t['dtype']:<12} {str(list(t['shape'])):<20} {t['shard']}")
        if self.errors:
            grans = list(self.errors[0].rel_error)
            width = max(40, *(len(e.name) for e in self.errors))
            head = f"{'tensor':<{width}} {'shape':<18}" + "".join(f"{g + ' rel err / SQNR':>28}" for g in grans)
            lines += ["quantization error (relative Frobenius error / SQNR in dB):", head]
            for e in self.errors:
                cells = "".join(f"{_err_cell(e.rel_error[g], e.sqnr_db[g]):>28}" for g in grans)
                lines.append(f"{e.name:<{width}} {'x'.join(map(str, e.shape)):<18}{cells}")
            cells = "".join(
                f"{_err_cell(self.total_error[g]['rel_error'], self.total_error[g]['sqnr_db']):>28}" for g in grans
            )
            lines.append(f"{'all (energy-weighted)':<{width}} {'':<18}{cells}")
        return "\n".join(lines)


def _json_default(o: object) -> object:
    if isinstance(o, float) and math.isinf(o):
        return "inf"
    return str(o)


def _err_cell(rel: float, sqnr: float) -> str:
    return f"{rel:.3e} / {sqnr:6.2f} dB"


def _size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _error_terms(w: torch.Tensor, granularity: str, fp8_dtype: torch.dtype) -> tuple[float, float]:
    """(sum of squared error, sum of squares) of quantizing `w` (..., N, K), in float64."""
    q, s = quantize_weight(w, granularity, fp8_dtype)
    wf = w.float()
    diff = dequantize_weight(q, s, torch.float32) - wf
    return float(diff.double().pow(2).sum()), float(wf.double().pow(2).sum())


def quantization_error(
    w: torch.Tensor, granularities: Iterable[str] = GRANULARITIES, fp8_dtype: torch.dtype | str = "e4m3fn"
) -> dict[str, tuple[float, float]]:
    """{granularity: (relative error, SQNR dB)} of quantizing weight `w` (N, K) or (E, N, K)."""
    dtype = parse_fp8_dtype(fp8_dtype)
    out = {}
    for g in granularities:
        noise, signal = _error_terms(w, g, dtype)
        out[g] = (math.sqrt(noise / signal) if signal else 0.0, _sqnr(signal, noise))
    return out


def _after_bytes(ckpt: Checkpoint, quantizable: set[str]) -> dict[str, int]:
    out = {}
    for g in GRANULARITIES:
        total = 0
        for t in ckpt.tensors.values():
            if t.name in quantizable:
                total += t.numel + math.prod(weight_scale_shape(t.shape, g)) * 4
            else:
                total += t.nbytes
        out[g] = total
    return out


def _fp8_format(ckpt: Checkpoint, fp8: list[TensorInfo]) -> tuple[str | None, str | None]:
    dtype = {"F8_E4M3": "e4m3fn", "F8_E4M3FNUZ": "e4m3fnuz"}.get(fp8[0].dtype, fp8[0].dtype)
    scale = ckpt.tensors.get(scale_name(fp8[0].name))
    q = ckpt.quantization_config
    try:
        cfg_gran = granularity_from_config(q) if q else None
    except ValueError:
        cfg_gran = None
    if scale is not None and len(fp8[0].shape) >= 2:
        # A weight of at most 128x128 has a (1, 1) grid at 'block' too: the config says which.
        if cfg_gran is not None and tuple(weight_scale_shape(fp8[0].shape, cfg_gran)) == tuple(scale.shape):
            return cfg_gran, dtype
        try:
            return weight_granularity(fp8[0].shape, scale.shape), dtype
        except ValueError:
            pass
    return cfg_gran, dtype


def inspect_checkpoint(
    path: str | Path,
    error: bool = False,
    *,
    only: Iterable[str] = (),
    ignore: Iterable[str] = (),
    limit: int | None = None,
    fp8_dtype: str = "e4m3fn",
    device: str = "cpu",
    progress: bool = False,
) -> CheckpointReport:
    """Summarise a checkpoint folder (or one .safetensors file); with `error`, measure per-layer FP8 error.

    `only` / `ignore` (regexes) and `limit` (first N weights) restrict the error measurement.
    """
    ckpt = open_checkpoint(path)
    only_p, ignore_p = compile_patterns(only, "--only"), compile_patterns(ignore, "--ignore")
    dtypes: dict[str, dict[str, int]] = {}
    for t in ckpt.tensors.values():
        d = dtypes.setdefault(t.dtype, {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += t.nbytes
    fp8 = [t for t in ckpt.tensors.values() if t.dtype in _FP8_NAMES]
    quantized = [t for t in fp8 if scale_name(t.name) in ckpt.tensors]
    scales = [t for t in ckpt.tensors.values() if is_scale_name(t.name)]
    quantizable = sorted(
        t.name
        for t in ckpt.tensors.values()
        if default_should_quantize(t.name, t.shape, t.dtype)
        and not any(p.search(t.name) for p in ignore_p)
        and (not only_p or any(p.search(t.name) for p in only_p))
    )
    if fp8:
        granularity, fp8_name = _fp8_format(ckpt, fp8)
        scale_names = {t.name for t in scales}
        bf16 = (t.numel * 2 if t.dtype in _FP8_NAMES else t.nbytes for t in ckpt.tensors.values() if t.name not in scale_names)
        after = {"bfloat16": sum(bf16)}
    else:
        granularity, fp8_name = None, None
        after = _after_bytes(ckpt, set(quantizable))
    report = CheckpointReport(
        path=str(path),
        shards=len(ckpt.shards),
        tensors=len(ckpt.tensors),
        total_bytes=sum(t.nbytes for t in ckpt.tensors.values()),
        dtypes=dtypes,
        quantized_weights=len(quantized),
        scale_tensors=len(scales),
        unquantized_tensors=len(ckpt.tensors) - len(quantized) - len(scales),
        quantizable=quantizable,
        bytes_after=after,
        quantization_config=ckpt.quantization_config,
        granularity=granularity,
        fp8_dtype=fp8_name,
        tensor_list=[
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "shard": t.shard}
            for t in sorted(ckpt.tensors.values(), key=lambda t: t.name)
        ],
    )
    if error:
        _measure(ckpt, report, quantizable[:limit] if limit else quantizable, parse_fp8_dtype(fp8_dtype), device, progress)
    return report


def _matrix_terms(read: Callable[[int, int], torch.Tensor], n: int, k: int, step: int, fp8_dtype: torch.dtype,
                  device: torch.device) -> dict[str, list[float]]:  # fmt: skip
    """{granularity: [noise, signal]} of one (N, K) matrix read in row chunks by `read(r0, r1)`.

    Chunks are whole 128-row blocks, so 'block' and 'row' scales are the ones of the whole matrix.
    For 'tensor', a second pass quantizes each chunk plus one extra row holding the matrix's
    largest magnitude: the chunk then gets exactly the whole matrix's scale.
    """
    terms = {g: [0.0, 0.0] for g in GRANULARITIES}
    amax: torch.Tensor | None = None
    for r0, r1 in iter_row_ranges(n, step):
        w = read(r0, r1).to(device)
        for g in ("block", "row"):
            noise, signal = _error_terms(w, g, fp8_dtype)
            terms[g][0] += noise
            terms[g][1] += signal
        m = w.abs().max()
        amax = m if amax is None else torch.maximum(amax, m)  # exact, in the weight's dtype
    for r0, r1 in iter_row_ranges(n, step):
        w = read(r0, r1).to(device)
        extra = torch.zeros(1, k, dtype=w.dtype, device=device)
        extra[0, 0] = amax
        q, s = quantize_weight(torch.cat([w, extra]), "tensor", fp8_dtype)
        wf = w.float()
        diff = dequantize_weight(q[:-1], s, torch.float32) - wf
        terms["tensor"][0] += float(diff.double().pow(2).sum())
        terms["tensor"][1] += float(wf.double().pow(2).sum())
    return terms


def _measure(ckpt: Checkpoint, report: CheckpointReport, names: list[str], fp8_dtype: torch.dtype, device: str,
             progress: bool, chunk_elements: int = CHUNK_ELEMENTS) -> None:  # fmt: skip
    if not names:
        raise CheckpointError(
            f"{ckpt.root}: no high-precision linear weights to measure"
            + (" (the checkpoint is already FP8; --error needs the BF16/FP16/FP32 original)" if report.quantized_weights else "")
        )
    dev = torch.device(device if device != "cuda" or torch.cuda.is_available() else "cpu")
    totals = {g: [0.0, 0.0] for g in GRANULARITIES}
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(ckpt.tensors[name].shard, []).append(name)
    bar = tqdm(total=sum(ckpt.tensors[n].nbytes for n in names), unit="B", unit_scale=True, unit_divisor=1024,
               desc="measuring", disable=not progress)  # fmt: skip
    for shard in ckpt.shards:
        with ShardReader(ckpt.shard_path(shard)) as reader:
            for name in by_shard.get(shard, []):
                info = ckpt.tensors[name]
                n, k = info.shape[-2:]
                step = max(GROUP_SIZE, (chunk_elements // max(k, 1)) // GROUP_SIZE * GROUP_SIZE)
                terms = {g: [0.0, 0.0] for g in GRANULARITIES}
                for e in [None] if len(info.shape) == 2 else range(info.shape[0]):

                    def read(r0: int, r1: int, e: int | None = e) -> torch.Tensor:
                        if e is None:
                            return reader.read(name, (slice(r0, r1),))
                        return reader.read(name, (slice(e, e + 1), slice(r0, r1)))[0]

                    for g, (noise, signal) in _matrix_terms(read, n, k, step, fp8_dtype, dev).items():
                        terms[g][0] += noise
                        terms[g][1] += signal
                    bar.update(n * k * DTYPE_SIZES[info.dtype])
                rel, sq = {}, {}
                for g, (noise, signal) in terms.items():
                    rel[g] = math.sqrt(noise / signal) if signal else 0.0
                    sq[g] = _sqnr(signal, noise)
                    totals[g][0] += noise
                    totals[g][1] += signal
                report.errors.append(LayerError(name, info.shape, rel, sq))
    bar.close()
    order = {n: i for i, n in enumerate(names)}
    report.errors.sort(key=lambda e: order[e.name])
    report.total_error = {
        g: {"rel_error": math.sqrt(n / s) if s else 0.0, "sqnr_db": _sqnr(s, n)} for g, (n, s) in totals.items()
    }
