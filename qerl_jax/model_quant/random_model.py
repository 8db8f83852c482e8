"""Random-weight models built tensor by tensor, for GPU benchmarks and shape-only runs.

`random_quantized_model` draws each projection and quantizes it inside one small jitted program,
so the dense bf16 copy of a large model never exists: peak memory is the quantized model
plus one dense projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.models.hf_io import tensor_specs, variable_at
from qerl_jax.models.layers import INIT_STD
from qerl_jax.models.transformer import abstract_model
from qerl_jax.quant.formats import get_format
from qerl_jax.model_quant.quantize import mark_quantized_params

_RANDOM_PROGRAMS: dict = {}


def _random_program(kind: str, shape: tuple, dtype: str, format_name: str | None):
    """One jitted program per (kind, shape, dtype, format): a random N(0, 0.02) tensor, quantized
    inside the same program for kind 'quantized' (the dense draw never leaves it)."""
    cache_key = (kind, shape, dtype, format_name)
    if cache_key in _RANDOM_PROGRAMS:
        return _RANDOM_PROGRAMS[cache_key]
    if kind == "quantized":
        fmt = get_format(format_name)

        def program(key):
            dense = (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
            return fmt.quantize(dense, check_finite=False)
    else:
        def program(key):
            return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    _RANDOM_PROGRAMS[cache_key] = jax.jit(program)
    return _RANDOM_PROGRAMS[cache_key]


def random_quantized_model(architecture, format_name: str, seed: int = 0, place=None):
    """A random-weight CausalLM with its projections already in `format_name`, built tensor by
    tensor into an abstract (shapes-only) model.

    Same kind of model as the trainer's init_model + quantize_model (N(0, 0.02) weights, unit
    norm scales, zero biases; q/k/v/o/gate/up/down in QuantizedParam, embeddings and lm_head
    dense), but the dense copy of the whole model never exists: each projection is drawn and
    quantized inside one small program and only its codes and scales are kept. Peak memory is
    the quantized model plus one dense projection. The draws differ from init_model's for the
    same seed (the benchmarks need shapes, not particular values). `place`: optional (model
    path, value) -> value putting each tensor where it will live as soon as it is drawn (e.g.
    qerl_jax.parallel.mesh.place_parameter: a 72B model is built straight onto its shards).
    """
    model = abstract_model(architecture)
    param_dtype = architecture.param_dtype
    base = jax.random.key(seed)
    for index, spec in enumerate(tensor_specs(architecture)):
        key = jax.random.fold_in(base, index)
        variable = variable_at(model, spec.path)
        shape = tuple(variable.get_value().shape)
        if spec.is_linear and get_format(format_name).is_quantized:
            # model layout [in, out]; the quantized weight is [out, in] = the HF layout
            value = _random_program("quantized", tuple(spec.hf_shape), "bfloat16",
                                    format_name)(key)
        elif spec.path[-1] == "scale":
            value = jnp.ones(shape, param_dtype)
        elif spec.path[-1] == "bias":
            value = jnp.zeros(shape, param_dtype)
        else:
            value = _random_program("dense", shape, param_dtype, None)(key)
        if place is not None:
            value = place(spec.path, value)
        variable.set_value(value)
    mark_quantized_params(model)
    leaves = jax.tree_util.tree_leaves(nnx.state(model))
    leftover = [leaf for leaf in leaves if isinstance(leaf, jax.ShapeDtypeStruct)]
    if leftover:
        raise RuntimeError(f"random_quantized_model left {len(leftover)} abstract tensors")
    jax.block_until_ready(leaves)
    return model
