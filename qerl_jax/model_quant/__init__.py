"""Whole-model quantization: quantize or load a 4-bit model, compressed-tensors import/export,
random quantized models, and the Pallas kernels on a model. Sits above qerl_jax.models (the
architecture) and qerl_jax.quant (formats, the linear op, backends), which know nothing of each
other's insides."""
