"""Weight formats (bf16, NVFP4, MXFP4, NF4) and the one linear op every projection uses."""

from qerl_jax.quant.linear_op import linear

__all__ = ["linear"]
