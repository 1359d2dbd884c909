"""The save hook of models holding fp8linear modules, attached where transformers is installed."""

from __future__ import annotations

from torch import nn

__all__ = ["attach_save_hook_if_transformers"]


def attach_save_hook_if_transformers(model: nn.Module) -> None:
    """Give a transformers model holding fp8linear modules the quantizer whose hooks its
    ``save_pretrained`` calls to write the checkpoint format (:mod:`.hf_quantizer`, imported only here and only when needed: transformers is optional); other
    modules are left alone."""
    if not callable(getattr(model, "save_pretrained", None)):
        return
    try:
        from .hf_quantizer import attach_save_hook
    except ImportError:  # transformers missing or < 5: nothing to hook
        return
    attach_save_hook(model)
