"""`Fp8BlockLinear`: an nn.Linear with FP8 weights and fine-grained dequant scales."""

from __future__ import annotations

import torch
from torch import nn

from .formats import SCALE_DTYPE, is_fp8_dtype, resolve_fp8_dtype
from .functional import dequantize_weight, fp8_linear, quantize_weight
from .reference import GRANULARITIES, weight_granularity, weight_scale_shape

__all__ = ["Fp8BlockLinear", "QuantizedDtypesMixin"]


class QuantizedDtypesMixin(nn.Module):
    """`.to(dtype)`, `.half()`, `.float()` leave FP8 weights and fp32 `*_scale_inv` alone.

    nn.Module casts every floating-point parameter, FP8 included: fp8 -> bf16 would silently
    dequantize without the scales. Device moves still apply.
    """

    def _apply(self, fn, recurse=True):
        protected = {
            id(p)
            for name, p in self._parameters.items()
            if p is not None and (is_fp8_dtype(p.dtype) or name.endswith("scale_inv"))
        }

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) in protected and isinstance(out, torch.Tensor) and out.dtype != t.dtype:
                out = t.to(device=out.device)
            return out

        return super()._apply(keep_dtype, recurse)


class Fp8BlockLinear(QuantizedDtypesMixin):
    """Linear layer y = x @ dequant(weight).T + bias with FP8 weights.

    Parameters (the DeepSeek-V3 / HF ``quant_method: "fp8"`` names):
      - ``weight``: FP8 (out_features, in_features)
      - ``weight_scale_inv``: fp32 dequant multipliers, shape per granularity:
        'block' (ceil(N/128), ceil(K/128)), 'row' (N, ceil(K/128)), 'tensor' ()
      - ``bias``: optional, high precision

    Activations are quantized on the fly per token in 1x128 groups. The granularity is
    read from the scale's shape, so loading a state dict of another granularity just works.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        granularity: str = "block",
        device: torch.device | str | None = None,
        fp8_dtype: torch.dtype | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        fp8_dtype = resolve_fp8_dtype(fp8_dtype, device)
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=fp8_dtype, device=device), requires_grad=False
        )
        scale_shape = weight_scale_shape((out_features, in_features), granularity)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(scale_shape, dtype=SCALE_DTYPE, device=device), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @property
    def granularity(self) -> str:
        return weight_granularity(self.weight.shape, self.weight_scale_inv.shape)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.weight.dtype

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        granularity: str = "block",
        fp8_dtype: torch.dtype | str | None = None,
        backend: str | None = None,
    ) -> "Fp8BlockLinear":
        """Quantize an nn.Linear (on its own device); the bias keeps its dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.device.type == "meta":
            raise ValueError("from_linear needs a materialised nn.Linear, got one on the meta device")
        fp8_dtype = resolve_fp8_dtype(fp8_dtype, w.device)
        w_q, w_s = quantize_weight(w, granularity, fp8_dtype)
        has_bias = linear.bias is not None
        mod = cls(
            linear.in_features, linear.out_features, bias=has_bias, granularity=granularity,
            device="meta", fp8_dtype=fp8_dtype, backend=backend,
        )
        mod.weight = nn.Parameter(w_q, requires_grad=False)
        mod.weight_scale_inv = nn.Parameter(w_s, requires_grad=False)
        if has_bias:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return mod

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        weight = state_dict.get(prefix + "weight")
        if weight is not None and weight.dtype != self.weight.dtype:
            # Parameter.copy_ would convert values (e4m3fn 448 is NaN in fnuz): refuse instead.
            raise TypeError(
                f"{prefix}weight is {weight.dtype} but this module holds {self.weight.dtype}; "
                "convert with fp8linear.e4m3fn_to_e4m3fnuz or build the module with that fp8_dtype"
            )
        scale = state_dict.get(prefix + "weight_scale_inv")
        if scale is not None and scale.shape != self.weight_scale_inv.shape:
            weight_granularity(self.weight.shape, scale.shape)  # ValueError unless a valid granularity
            self.weight_scale_inv = nn.Parameter(
                torch.empty(scale.shape, dtype=SCALE_DTYPE, device=self.weight_scale_inv.device), requires_grad=False
            )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def to_linear(self, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
        """A dequantized nn.Linear with the same weights (up to FP8 rounding) and bias."""
        lin = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=dtype
        )
        lin.weight = nn.Parameter(dequantize_weight(self.weight, self.weight_scale_inv, dtype))
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().to(dtype).clone())
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fp8_dtype(self.weight.dtype):
            raise TypeError(f"Fp8BlockLinear.weight must be FP8, got {self.weight.dtype}")
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, backend=self.backend)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, granularity={self.granularity}, "
            f"fp8_dtype={str(self.weight.dtype).removeprefix('torch.')}"
        )
