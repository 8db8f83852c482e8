"""Pallas GPU kernels: arrays in, arrays out; each file holds a kernel family, its jnp reference
and a public wrapper. Only qerl_jax.quant calls them."""
