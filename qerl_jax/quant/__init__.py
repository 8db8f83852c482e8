"""Weight formats (bf16, NVFP4, MXFP4, NF4), the one linear op every projection uses, and its
backends (XLA reference, Triton, Mosaic GPU) with their options."""

from qerl_jax.quant.formats import (Format, bytes_per_parameter, get_format, known_formats,
                                    quantized_nbytes, register_format)
from qerl_jax.quant.qarray import QuantizedWeight
from qerl_jax.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from qerl_jax.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from qerl_jax.quant.nf4 import nf4_dequantize, nf4_quantize
from qerl_jax.quant.linear_op import LoRAProduct, linear, linear_group, quantized_matmul
from qerl_jax.quant.dispatch import (register_backend, registered_backends, select_matmul_path,
                                     unregister_backend, unregister_backends)
from qerl_jax.quant.linear_swiglu import linear_swiglu, prepare_swiglu_lora_b
from qerl_jax.quant.kernel_options import KernelOptions

__all__ = ["QuantizedWeight", "Format", "bytes_per_parameter", "get_format", "known_formats",
           "quantized_nbytes", "register_format", "nvfp4_dequantize", "nvfp4_quantize",
           "mxfp4_dequantize", "mxfp4_quantize", "nf4_dequantize", "nf4_quantize", "LoRAProduct", "linear",
           "linear_group", "linear_swiglu", "prepare_swiglu_lora_b",
           "quantized_matmul", "register_backend", "registered_backends", "select_matmul_path",
           "unregister_backend", "unregister_backends", "KernelOptions"]
