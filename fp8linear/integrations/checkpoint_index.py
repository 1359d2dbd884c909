"""The tensors of a safetensors checkpoint folder, from its headers only: names, files, shapes, dtypes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint_format import path_in_checkpoint

__all__ = ["EXPERT_NAME_SETS", "TensorInfo", "CheckpointIndex", "index_checkpoint"]

# Per-expert projection names on disk: (gate, up, down) for Qwen/DeepSeek and for Mixtral.
EXPERT_NAME_SETS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class TensorInfo:
    """Where a checkpoint tensor lives and what it is (read from the safetensors header)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3", "BF16"


@dataclass
class CheckpointIndex:
    """All tensors of a safetensors checkpoint folder, by (possibly renamed) name."""

    root: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.root, Path):
            raise TypeError(f"root must be a pathlib.Path, got {type(self.root).__name__}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> TensorInfo | None:
        return self.tensors.get(name)


def index_checkpoint(path: str | os.PathLike) -> CheckpointIndex:
    """Read the headers of a safetensors checkpoint folder (single file or sharded with an index)."""
    from safetensors import safe_open

    root = Path(path).resolve()
    if not root.is_dir():
        raise ValueError(f"expected a checkpoint folder, got {str(path)!r} (not a directory)")
    index_file = root / "model.safetensors.index.json"
    if index_file.is_file():
        with open(index_file, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file}: expected a non-empty 'weight_map' object")
        files = sorted({path_in_checkpoint(root, v, f"{index_file.name} weight_map", resolve_links=True) for v in weight_map.values()})
    else:
        files = sorted(p.resolve() for p in root.glob("*.safetensors"))
        files = [path_in_checkpoint(root, p.name, "shard", resolve_links=True) for p in files]
    if not files:
        bins = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(bins[:3])}: pickle checkpoints are not supported)" if bins else ""
        raise ValueError(f"no *.safetensors files in {root}{hint}")
    index = CheckpointIndex(root)
    for file in files:
        if not file.is_file():
            raise ValueError(f"checkpoint shard {file.name} is listed but missing in {root}")
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if name in index.tensors:
                    raise ValueError(f"tensor {name!r} appears in both {index.tensors[name].file.name} and {file.name}")
                index.tensors[name] = TensorInfo(name, file, tuple(sl.get_shape()), sl.get_dtype())
    return index
