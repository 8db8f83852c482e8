"""AQN: both schedules (the K=10 table of the released scripts), purity in (key, step), noise
only on decoder-layer norm scales, in float32, and no accumulation across steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qerl_jax.aqn import AQNSchedule, aqn_noisy_state, aqn_sigma
from qerl_jax.models import init_model, preset

RELEASED_K10 = [0.0, 1e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1e-4]


def test_released_code_table_k10():
    schedule = AQNSchedule(total_steps=100, sigma_start=1e-2, sigma_end=1e-4, stages=10)
    sigmas = [float(aqn_sigma(step, schedule)) for step in range(0, 100, 10)]
    np.testing.assert_allclose(sigmas, RELEASED_K10, rtol=2e-3)
    # within an interval the level holds; past the end it stays at the last level
    assert float(aqn_sigma(19, schedule)) == float(aqn_sigma(10, schedule))
    np.testing.assert_allclose(float(aqn_sigma(250, schedule)), 1e-4, rtol=1e-5)


def test_paper_schedule_float64_formula():
    schedule = AQNSchedule(total_steps=50, sigma_start=1e-2, sigma_end=5e-4, stages=5,
                           kind="paper")
    for step in range(50):
        stage = step * 5 // 50
        expected = 0.0 if stage == 0 else 1e-2 * (5e-4 / 1e-2) ** ((stage - 1) / 4)
        np.testing.assert_allclose(float(aqn_sigma(step, schedule)), expected, rtol=1e-5)


def test_schedule_traces_under_jit():
    schedule = AQNSchedule(total_steps=100)
    jitted = jax.jit(lambda s: aqn_sigma(s, schedule))
    assert float(jitted(jnp.int32(35))) == float(aqn_sigma(35, schedule))


def _state():
    model = init_model(preset("tiny_qwen2", param_dtype="bfloat16"), seed=0)
    return nnx.split(model)


def test_noise_is_pure_in_key_and_step_and_touches_only_decoder_norms():
    graphdef, state = _state()
    schedule = AQNSchedule(total_steps=10, stages=10)
    key = jax.random.key(3)
    a = aqn_noisy_state(state, key, 5, schedule)
    b = aqn_noisy_state(state, key, 5, schedule)
    c = aqn_noisy_state(state, key, 6, schedule)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    noisy = nnx.merge(graphdef, a)
    clean = nnx.merge(graphdef, state)
    layer_scale = noisy.layers[0].input_layernorm.scale.get_value()
    assert layer_scale.dtype == jnp.float32
    z = np.asarray(layer_scale) - np.asarray(clean.layers[0].input_layernorm.scale.get_value(),
                                             np.float32)
    sigma = float(aqn_sigma(5, schedule))
    assert 0.5 * sigma < z.std() < 1.5 * sigma
    # the final norm and all weights are untouched
    np.testing.assert_array_equal(np.asarray(noisy.norm.scale.get_value()),
                                  np.asarray(clean.norm.scale.get_value()))
    np.testing.assert_array_equal(np.asarray(noisy.layers[1].mlp.up_proj.weight.get_value()),
                                  np.asarray(clean.layers[1].mlp.up_proj.weight.get_value()))
    # different norms get different draws; a different step gives a different draw
    z2 = (np.asarray(noisy.layers[0].post_attention_layernorm.scale.get_value())
          - np.asarray(clean.layers[0].post_attention_layernorm.scale.get_value(), np.float32))
    assert not np.allclose(z, z2)
    other_step = nnx.merge(graphdef, c).layers[0].input_layernorm.scale.get_value()
    assert not np.allclose(np.asarray(other_step), np.asarray(layer_scale))


def test_nothing_accumulates_across_steps():
    graphdef, state = _state()
    schedule = AQNSchedule(total_steps=4, stages=4, sigma_start=0.1, sigma_end=0.01)
    key = jax.random.key(0)
    for step in range(4):
        noisy = aqn_noisy_state(state, key, step, schedule)
    direct = aqn_noisy_state(state, key, 3, schedule)
    for x, y in zip(jax.tree_util.tree_leaves(noisy), jax.tree_util.tree_leaves(direct)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    zero = aqn_noisy_state(state, key, 0, schedule)  # stage 0: no noise at all
    clean = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(
        np.asarray(nnx.merge(graphdef, zero).layers[1].input_layernorm.scale.get_value()),
        np.asarray(clean.layers[1].input_layernorm.scale.get_value(), np.float32))


def test_bad_schedule():
    with pytest.raises(ValueError, match=r"^unknown AQN schedule 'cosine'; known: "
                                         r"released_code, paper$"):
        AQNSchedule(total_steps=10, kind="cosine")
