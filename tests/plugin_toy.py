"""A plug-in from outside the package: one weight format, one loss normalizer, one reward and one
task, each registered on import, so that `--config.imports=tests.plugin_toy` makes them
selectable by name (tests/test_plugins.py trains the tiny model with them).

toy_int8: int8 codes with one float32 absmax scale per block of 16 along K (8.25 bits per
weight); the XLA path dequantizes it with `toy_int8_dequantize`.
"""

from __future__ import annotations

import jax.numpy as jnp

from qerl_jax.data.sources import Example
from qerl_jax.quant.formats import Format, register_format, validate_weight
from qerl_jax.quant.qarray import QuantizedWeight
from qerl_jax.rewards.registry import register_reward
from qerl_jax.rl.losses import register_loss_normalizer
from qerl_jax.tasks import Task, register_task

BLOCK = 16


def toy_int8_quantize(weight, *, name: str = "weight", check_finite: bool = True):
    """W [N, K] -> QuantizedWeight: codes int8 [N, K], block_scales float32 [N, K/16]."""
    validate_weight(weight, block_size=BLOCK, format_name="toy_int8", name=name,
                    check_finite=check_finite)
    rows, cols = weight.shape
    blocks = weight.astype(jnp.float32).reshape(rows, cols // BLOCK, BLOCK)
    scales = jnp.max(jnp.abs(blocks), axis=-1) / 127.0
    codes = jnp.round(blocks / jnp.where(scales == 0, 1.0, scales)[..., None])
    return QuantizedWeight(codes=codes.astype(jnp.int8).reshape(rows, cols),
                           block_scales=scales, format="toy_int8", shape=(rows, cols),
                           dtype=str(weight.dtype))


def toy_int8_dequantize(quantized: QuantizedWeight, dtype=None):
    """QuantizedWeight -> W [N, K] = codes * the block's scale, in `dtype`."""
    rows, cols = quantized.shape
    blocks = quantized.codes.astype(jnp.float32).reshape(rows, cols // BLOCK, BLOCK)
    dense = (blocks * quantized.block_scales[..., None]).reshape(rows, cols)
    return dense.astype(dtype or quantized.dtype)


register_format(Format(
    name="toy_int8", bits=8, block_size=BLOCK, bytes_per_parameter=1 + 4 / BLOCK,
    quantize=toy_int8_quantize, dequantize=toy_int8_dequantize,
    description="int8 codes, float32 absmax per 16 (a plug-in example)"))


@register_loss_normalizer("toy_sequence_sum", global_denominator=True)
def toy_sequence_sum(masked, mask, sequences, global_valid_tokens, config):
    """sum l m / sequences: each sequence's token losses summed, averaged over sequences."""
    del mask, global_valid_tokens, config
    return masked.sum(), jnp.asarray(sequences, jnp.float32)


@register_reward("toy_contains_gold")
def toy_contains_gold(completion: str, gold: str) -> float:
    """1.0 when the gold answer appears in the completion."""
    return 1.0 if gold and gold in completion else 0.0


def toy_doubling_problems(options, seed: int) -> list[Example]:
    """'a+a=' for a in 0..9 (gold 2a), repeated: a fixed set, whatever the seed."""
    del options, seed
    return [Example(f"{a}+{a}=", str(2 * a)) for _ in range(4) for a in range(10)]


register_task(Task("toy_doubling", correctness="toy_contains_gold",
                   default_rewards=("toy_contains_gold",), generate=toy_doubling_problems,
                   description="'a+a=' problems (a plug-in example)"))
