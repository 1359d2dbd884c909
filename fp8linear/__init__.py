"""fp8linear: FP8 linear layers with DeepSeek-V3-style fine-grained scaling for PyTorch."""

from .formats import (
    activation_max,
    default_fp8_dtype,
    e4m3fn_to_e4m3fnuz,
    fp8_max,
)
from .functional import (
    block_fp8_matmul,
    dequantize_weight,
    fp8_linear,
    grouped_fp8_matmul,
    quantize_activation,
    quantize_weight,
)
from .module import Fp8BlockLinear, share_input_quantization
from .norm import FusedRMSNorm, fuse_rms_norms_

__version__ = "0.1.0"

__all__ = [
    "Fp8BlockLinear",
    "share_input_quantization",
    "FusedRMSNorm",
    "fuse_rms_norms_",
    "quantize_activation",
    "quantize_weight",
    "dequantize_weight",
    "block_fp8_matmul",
    "fp8_linear",
    "grouped_fp8_matmul",
    "default_fp8_dtype",
    "fp8_max",
    "activation_max",
    "e4m3fn_to_e4m3fnuz",
    "__version__",
]
