"""Integrations of fp8linear with model libraries (transformers first).

Import the submodule you need; nothing here imports transformers eagerly::

    from fp8linear.integrations.transformers import quantize_model_, from_pretrained, Fp8LinearConfig
"""

__all__: list[str] = []
