"""The rollout sampler: greedy equals transformers' greedy generate token for token; sampled
tokens follow the intended distribution; top-k / top-p masks are exact; determinism; EOS
handling; and a bounded number of compiled programs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.sampling import (SamplingConfig, _generate_program, bucket_length,
                               filter_logits, generate)
from tests.hf_reference import left_padded_batch, make_hf_model, save_hf_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("qwen2", seed=21)
    directory = save_hf_model_dir(hf_model, str(tmp_path_factory.mktemp("sampler")))
    return hf_model, load_hf_model(directory, param_dtype="float32")


def _prompts(rng, lengths, total, vocab=256):
    return left_padded_batch(rng, lengths, total, vocab, low=3)


def test_greedy_equals_transformers_generate(tiny):
    hf_model, ours = tiny
    tokens, mask = _prompts(np.random.default_rng(0), [7, 4, 2], 7)
    eos = 5
    config = SamplingConfig(max_new_tokens=12, greedy=True, eos_token_ids=(eos,),
                            prompt_bucket=8)
    rollout = generate(ours, tokens, mask, jax.random.key(0), config)
    with torch.no_grad():
        reference = hf_model.generate(
            input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask),
            do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    reference = reference[:, tokens.shape[1]:].numpy()
    for row in range(3):
        length = int(rollout.lengths[row])
        expected = reference[row]
        if eos in expected:
            expected = expected[:list(expected).index(eos) + 1]
        np.testing.assert_array_equal(np.asarray(rollout.tokens[row, :length]), expected)
        assert bool(rollout.truncated[row]) == (eos not in expected)


def test_same_key_same_tokens_and_groups_differ(tiny):
    _, ours = tiny
    tokens, mask = _prompts(np.random.default_rng(1), [5, 3], 5)
    config = SamplingConfig(max_new_tokens=10, num_generations=4, prompt_bucket=8)
    a = generate(ours, tokens, mask, jax.random.key(7), config)
    b = generate(ours, tokens, mask, jax.random.key(7), config)
    c = generate(ours, tokens, mask, jax.random.key(8), config)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert a.tokens.shape == (8, 10)
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    assert len({tuple(np.asarray(a.tokens[i])) for i in range(4)}) > 1


def test_eos_ends_rows_and_masks_after(tiny):
    _, ours = tiny
    tokens, mask = _prompts(np.random.default_rng(2), [4] * 6, 4)
    # with a 256-token vocab and 40 steps, making a quarter of the vocab EOS ends most rows
    config = SamplingConfig(max_new_tokens=40, eos_token_ids=tuple(range(0, 256, 4)),
                            prompt_bucket=4)
    rollout = generate(ours, tokens, mask, jax.random.key(3), config)
    for row in range(6):
        length = int(rollout.lengths[row])
        row_tokens = np.asarray(rollout.tokens[row])
        assert np.asarray(rollout.mask[row]).sum() == length
        if not bool(rollout.truncated[row]):
            assert row_tokens[length - 1] % 4 == 0
            assert all(t % 4 for t in row_tokens[:length - 1])
        assert (row_tokens[length:] == 0).all()
    assert (~np.asarray(rollout.truncated)).any()


def test_sampling_follows_the_distribution():
    """Chi-square test of 20000 categorical draws with temperature 0.7 over 8 tokens."""
    from scipy import stats
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(1, 8)) * 2, jnp.float32)
    config = SamplingConfig(temperature=0.7)
    from qerl_jax.sampling import choose_tokens
    keys = jax.random.split(jax.random.key(11), 20000)
    tokens, logprobs = jax.vmap(lambda k: choose_tokens(logits, k, config))(keys)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=8)
    scaled = np.asarray(logits[0], np.float64) / 0.7
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    _, p_value = stats.chisquare(counts, probs * counts.sum())
    assert p_value > 1e-3, (counts, probs)
    np.testing.assert_allclose(np.asarray(logprobs).ravel(),
                               np.log(probs[np.asarray(tokens).ravel()]), rtol=1e-5, atol=1e-6)


def test_top_k_and_top_p_masks_are_exact():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    for top_k in (1, 5, 49):
        kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), 1.0, top_k, 1.0)))
        for row in range(4):
            np.testing.assert_array_equal(np.sort(np.nonzero(kept[row])[0]),
                                          np.sort(np.argsort(-logits[row])[:top_k]))
    for top_p in (0.1, 0.5, 0.9):
        kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), 1.0, 0, top_p)))
        for row in range(4):
            order = np.argsort(-logits[row].astype(np.float64))
            probs = np.exp(logits[row][order] - logits[row].max())
            probs /= probs.sum()
            before = np.cumsum(probs) - probs
            expected = np.sort(order[before < top_p])
            np.testing.assert_array_equal(np.sort(np.nonzero(kept[row])[0]), expected)


def test_bucketing_bounds_compiles(tiny):
    _, ours = tiny
    config = SamplingConfig(max_new_tokens=4, greedy=True, prompt_bucket=8)
    before = _generate_program._cache_size()
    rng = np.random.default_rng(6)
    for length in (1, 3, 5, 8, 2, 7):   # all fall in the 8-token bucket
        tokens, mask = _prompts(rng, [length, length], length)
        generate(ours, tokens, mask, jax.random.key(0), config)
    assert _generate_program._cache_size() - before == 1
    assert [bucket_length(n, 64) for n in (1, 64, 65, 256, 257, 600)] == [64, 64, 128, 256,
                                                                           512, 1024]


def test_new_prompt_lengths_in_a_bucket_compile_nothing(tiny, caplog):
    """Prompts of a new length inside a known bucket run without any XLA compile: the sampler
    program is reused and the bucket padding of host (numpy) prompts happens on the host, not
    in an eager jnp.pad program per distinct length (a training run meets many lengths)."""
    import logging
    _, ours = tiny
    config = SamplingConfig(max_new_tokens=4, greedy=True, prompt_bucket=8)
    rng = np.random.default_rng(7)
    key = jax.random.key(0)
    tokens, mask = _prompts(rng, [3, 3], 3)
    generate(ours, tokens, mask, key, config)   # the program and any one-off eager op
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        for length in (1, 5, 8, 2, 7):
            tokens, mask = _prompts(rng, [length, length], length)
            generate(ours, tokens, mask, key, config)
    compiles = [r.getMessage()[:120] for r in caplog.records
                if r.getMessage().startswith("Compiling")]
    assert not compiles, compiles


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="temperature=0"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4': one of \('auto', "):
        SamplingConfig(kv_cache_dtype="int4")


def test_an_8_bit_kv_cache_changes_the_next_token_log_probs_by_little(tiny):
    """A prefill and 10 decode steps of the tiny float32 model along fixed tokens (three
    left-padded prompts) with an init_kv_cache(..., 'float8_e4m3fn') cache against the float32
    cache (e4m3 keeps 3 mantissa bits: each cached value within 2^-4 relative): each step's
    KL(exact || 8-bit) <= 3e-3 nats and every log-prob of the vocabulary within 0.3 nats
    (measured 7.2e-4 and 0.116 on this random model, whose distributions are near uniform);
    an int8 cache (within half an int8 step, absmax / 254, per value): KL <= 2e-4 and every
    log-prob within 0.1 (measured 5.0e-5 and 0.035).
    generate() with kv_cache_dtype='float8_e4m3fn' gives the same tokens for the same key and
    finite log-probs."""
    from qerl_jax.models.kv_cache import init_kv_cache
    from qerl_jax.models.transformer import decode_step, prefill

    _, ours = tiny
    tokens, mask = _prompts(np.random.default_rng(5), [7, 4, 2], 7)
    forced = np.random.default_rng(6).integers(3, 200, (3, 10)).astype(np.int32)

    def log_probs(dtype):
        cache = init_kv_cache(ours.config, 3, 17, dtype)
        logits, cache = prefill(ours, jnp.asarray(tokens), jnp.asarray(mask), cache)
        steps = [logits]
        for t in range(10):
            logits, cache = decode_step(ours, jnp.asarray(forced[:, t]), cache)
            steps.append(logits)
        return np.asarray(jax.nn.log_softmax(jnp.stack(steps), axis=-1))

    exact, eight_bit = log_probs(None), log_probs("float8_e4m3fn")
    kl = (np.exp(exact) * (exact - eight_bit)).sum(-1)
    assert kl.max() <= 3e-3 and np.abs(eight_bit - exact).max() <= 0.3
    integer = log_probs("int8")
    kl = (np.exp(exact) * (exact - integer)).sum(-1)
    assert kl.max() <= 2e-4 and np.abs(integer - exact).max() <= 0.1
    config = SamplingConfig(max_new_tokens=6, num_generations=2, prompt_bucket=8,
                            kv_cache_dtype="float8_e4m3fn")
    a = generate(ours, tokens, mask, jax.random.key(2), config)
    b = generate(ours, tokens, mask, jax.random.key(2), config)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert np.isfinite(np.asarray(a.logprobs)).all()


def test_ahead_of_time_program_from_shapes_equals_the_jitted_one(tiny):
    """compile_generate compiles from shapes only (nothing of the model needs to be on the
    device): its executable gives the jitted program's tokens and log-probs exactly, refuses
    other shapes with a TypeError instead of recompiling, and takes only bucket lengths."""
    from flax import nnx

    from qerl_jax.sampling import compile_generate, generate_from_states, padded_prompt_shape
    _, ours = tiny
    tokens, mask = _prompts(np.random.default_rng(4), [6, 3], 6)
    config = SamplingConfig(max_new_tokens=9, num_generations=3, prompt_bucket=8)
    graphdef, state = nnx.split(ours)
    key = jax.random.fold_in(jax.random.key(3), 1)
    shape = padded_prompt_shape(tokens.shape, config)
    assert shape == (2, 8)
    compiled = compile_generate(graphdef, jax.eval_shape(lambda: (state,)), shape,
                                jax.ShapeDtypeStruct(key.shape, key.dtype), config)
    ahead = generate_from_states(graphdef, (state,), tokens, mask, key, config,
                                 compiled=compiled)
    jitted = generate_from_states(graphdef, (state,), tokens, mask, key, config)
    for name in ("tokens", "logprobs", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(ahead, name)),
                                      np.asarray(getattr(jitted, name)))
    longer, longer_mask = _prompts(np.random.default_rng(5), [10, 3], 10)
    with pytest.raises(TypeError):
        generate_from_states(graphdef, (state,), longer, longer_mask, key, config,
                             compiled=compiled)
    with pytest.raises(ValueError, match="not a bucket"):
        compile_generate(graphdef, (state,), (2, 6), key, config)



def test_stop_lengths_end_rows_at_their_budgets(tiny):
    """Per-row budgets (what benchmarks/rollout.py --lengths replays): a row ends after its
    budget unless EOS comes first; the tokens before that are the unbudgeted run's (same key,
    rows independent), the rest 0 and masked; ahead-of-time compiled, the same; a budget list
    of the wrong length or below 1 is refused with one line."""
    from flax import nnx

    from qerl_jax.sampling import compile_generate, generate_from_states, padded_prompt_shape
    _, ours = tiny
    tokens, mask = _prompts(np.random.default_rng(6), [5, 3], 5)
    config = SamplingConfig(max_new_tokens=12, num_generations=3, prompt_bucket=8,
                            eos_token_ids=(7, 11))
    graphdef, state = nnx.split(ours)
    key = jax.random.key(9)
    free = generate_from_states(graphdef, (state,), tokens, mask, key, config)
    budgets = np.array([1, 3, 12, 6, 2, 9], np.int32)
    capped = generate_from_states(graphdef, (state,), tokens, mask, key, config,
                                  stop_lengths=budgets)
    free_lengths = np.asarray(free.lengths)
    lengths = np.asarray(capped.lengths)
    np.testing.assert_array_equal(lengths, np.minimum(free_lengths, budgets))
    for row in range(6):
        length = lengths[row]
        np.testing.assert_array_equal(np.asarray(capped.tokens[row, :length]),
                                      np.asarray(free.tokens[row, :length]))
        assert (np.asarray(capped.tokens[row, length:]) == 0).all()
        assert np.asarray(capped.mask[row]).sum() == length
        ended_by_eos = not bool(free.truncated[row]) and free_lengths[row] <= budgets[row]
        assert bool(capped.truncated[row]) == (not ended_by_eos)
    assert (lengths < free_lengths).any()   # some budget cut a row short
    shape = padded_prompt_shape(tokens.shape, config)
    compiled = compile_generate(graphdef, jax.eval_shape(lambda: (state,)), shape,
                                jax.ShapeDtypeStruct(key.shape, key.dtype), config,
                                stop_lengths=True)
    ahead = generate_from_states(graphdef, (state,), tokens, mask, key, config,
                                 compiled=compiled, stop_lengths=budgets)
    np.testing.assert_array_equal(np.asarray(ahead.tokens), np.asarray(capped.tokens))
    np.testing.assert_array_equal(np.asarray(ahead.lengths), lengths)
    for bad in (budgets[:5], np.zeros(6, np.int32), budgets.astype(np.float32)):
        with pytest.raises(ValueError, match=r"^stop_lengths: expected 6 integers >= 1"):
            generate_from_states(graphdef, (state,), tokens, mask, key, config,
                                 stop_lengths=bad)


def _quantized_tiny_with_lora():
    """tiny_qwen2 with one decoder layer (7 projections: each check below is per weight) in
    NVFP4 (bf16 compute) with a rank-8 LoRA whose B is nonzero."""
    from flax import nnx

    from qerl_jax.lora import LoRAConfig, add_lora
    from qerl_jax.model_quant.quantize import quantize_model
    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.layers import Linear
    from qerl_jax.models.transformer import init_model
    model = init_model(tiny_qwen2(param_dtype="bfloat16", compute_dtype="bfloat16",
                                  num_hidden_layers=1), seed=3)
    quantize_model(model, "nvfp4")
    add_lora(model, LoRAConfig(rank=8, alpha=8.0), jax.random.key(4))
    for index, (_, layer) in enumerate((path, node) for path, node in nnx.iter_graph(model)
                                       if isinstance(node, Linear)):
        value = layer.lora_b.get_value()
        layer.lora_b.set_value(0.05 * jax.random.normal(jax.random.key(100 + index),
                                                        value.shape, value.dtype))
    return model


def test_dequantize_once_gives_the_per_step_rollout():
    """SamplingConfig.dequantize_once on the XLA path (no kernels, every batch dequantizes):
    each quantized weight becomes its dequantize(compute dtype), transposed, once; the
    rollout's tokens equal the per-step path's for the same key and its log-probs agree within
    1e-5 (the same bf16 weights; the dot may sum in another order). With the kernel layout
    (Pallas interpret mode) only a batch above the fused kernels' M limit (64) dequantizes, and
    then with the dequantize kernel's values; a 66-row rollout on that path gives the per-step
    tokens and log-probs the same way."""
    import copy

    from flax import nnx

    from qerl_jax.model_quant.kernel_setup import disable_decode_attention, enable_kernels
    from qerl_jax.models.decode_fusion import dequantize_for_rollout
    from qerl_jax.quant import KernelOptions, QuantizedWeight
    from qerl_jax.quant.kernel_registry import unregister_kernels

    unregister_kernels("cpu")   # the XLA path: nothing another test registered for the CPU
    disable_decode_attention("cpu")
    model = _quantized_tiny_with_lora()
    tokens, mask = _prompts(np.random.default_rng(8), [6, 3], 6, vocab=128)   # tiny_qwen2's
    config = SamplingConfig(max_new_tokens=8, num_generations=3, prompt_bucket=8)
    per_step = generate(model, tokens, mask, jax.random.key(5), config)
    once = generate(model, tokens, mask, jax.random.key(5),
                    dataclasses.replace(config, dequantize_once=True))
    np.testing.assert_array_equal(np.asarray(once.tokens), np.asarray(per_step.tokens))
    np.testing.assert_allclose(np.asarray(once.logprobs), np.asarray(per_step.logprobs),
                               atol=1e-5)
    assert np.isfinite(np.asarray(per_step.logprobs)).all()

    copied = copy.deepcopy(model)
    quantized = {path: node.weight.get_value() for path, node in nnx.iter_graph(copied)
                 if isinstance(getattr(node, "weight", None), nnx.Variable)
                 and isinstance(node.weight.get_value(), QuantizedWeight)}
    assert dequantize_for_rollout(copied, 6) == len(quantized) == 7   # 1 layer x 7
    nodes = dict(nnx.iter_graph(copied))
    for path, weight in quantized.items():   # now a dense [in, out] kernel
        np.testing.assert_array_equal(np.asarray(nodes[path].weight.get_value(), np.float32),
                                      np.asarray(weight.dequantize(jnp.bfloat16).T, np.float32))

    laid_out = copy.deepcopy(model)
    try:
        enable_kernels(laid_out, KernelOptions(decode_attention=False), platform="cpu",
                       interpret=True, tile_k=256)
        # the sampler's own preparation (pair views, grouped operands) then the dense weights:
        # 3 prompts x 22 generations = 66 rows take the dequantize-then-dot path
        wide_config = SamplingConfig(max_new_tokens=3, num_generations=22, prompt_bucket=8)
        rows_per_step = generate(laid_out, tokens[:, :6], mask[:, :6], jax.random.key(6),
                                 wide_config)
        rows_once = generate(laid_out, tokens[:, :6], mask[:, :6], jax.random.key(6),
                             dataclasses.replace(wide_config, dequantize_once=True))
        np.testing.assert_array_equal(np.asarray(rows_once.tokens),
                                      np.asarray(rows_per_step.tokens))
        np.testing.assert_allclose(np.asarray(rows_once.logprobs),
                                   np.asarray(rows_per_step.logprobs), atol=1e-5)
        assert np.isfinite(np.asarray(rows_per_step.logprobs)).all()
        assert dequantize_for_rollout(copy.deepcopy(laid_out), 64) == 0   # fused kernels
        wide = copy.deepcopy(laid_out)
        weights = {path: node.weight.get_value() for path, node in nnx.iter_graph(wide)
                   if isinstance(getattr(node, "weight", None), nnx.Variable)
                   and isinstance(node.weight.get_value(), QuantizedWeight)}
        assert dequantize_for_rollout(wide, 65) == 7
        nodes = dict(nnx.iter_graph(wide))
        for path, weight in weights.items():
            np.testing.assert_array_equal(
                np.asarray(nodes[path].weight.get_value(), np.float32),
                np.asarray(weight.kernel_dense(True).T, np.float32))
    finally:
        unregister_kernels("cpu")
        disable_decode_attention("cpu")


def test_shrink_schedule_halves_down_to_the_minimum_and_the_shards():
    from qerl_jax.sampling import shrink_schedule
    on = SamplingConfig(shrink_batch=True, shrink_min_rows=8)
    assert shrink_schedule(512, on) == (512, 256, 128, 64, 32, 16, 8)
    assert shrink_schedule(512, SamplingConfig()) == (512,)   # off
    assert shrink_schedule(15, on) == (15,)                    # 7 rows < 8
    assert shrink_schedule(48, on) == (48, 24, 12)
    assert shrink_schedule(48, on, shards=8) == (48,)          # rows over 8 devices: none
    assert shrink_schedule(7, dataclasses.replace(on, shrink_min_rows=1)) == (7, 3, 1)
    with pytest.raises(ValueError, match="shrink_min_rows=0 must be positive"):
        SamplingConfig(shrink_min_rows=0)


def test_row_keys_draw_the_same_token_wherever_the_row_sits():
    from qerl_jax.sampling import choose_tokens
    logits = jax.random.normal(jax.random.key(0), (6, 50)) * 3
    rows = jnp.arange(6, dtype=jnp.int32) * 7 + 3
    order = jnp.array([4, 0, 5, 2, 1, 3])
    config = SamplingConfig(top_k=20, top_p=0.9)
    tokens, logprobs = choose_tokens(logits, jax.random.key(1), config, rows)
    moved, moved_logprobs = choose_tokens(logits[order], jax.random.key(1), config, rows[order])
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(tokens)[np.asarray(order)])
    np.testing.assert_array_equal(np.asarray(moved_logprobs),
                                  np.asarray(logprobs)[np.asarray(order)])
    # a row drawn alone from fold_in(key, row) is the same draw
    alone, _ = choose_tokens(logits[2:3], jax.random.key(1), config, rows[2:3])
    assert int(alone[0]) == int(tokens[2])


def test_a_shrinking_batch_samples_what_the_full_batch_samples(tiny):
    """SamplingConfig.shrink_batch: 8 rows whose budgets and EOS end most of them early decode
    in loops of 8, 4 and 2 rows (the finished rows and their KV cache rows dropped); every
    row's tokens, lengths, mask and truncation equal the full batch's (the same per-row keys,
    shrink_min_rows = 8: one loop), its log-probs within 1e-5 (float32; a smaller batch's dot
    may sum in another order). Ahead-of-time compiled, the same."""
    from flax import nnx

    from qerl_jax.sampling import compile_generate, generate_from_states, padded_prompt_shape
    _, ours = tiny
    tokens, mask = _prompts(np.random.default_rng(11), [6, 4], 6)
    config = SamplingConfig(max_new_tokens=16, num_generations=4, prompt_bucket=8,
                            eos_token_ids=(7, 11), shrink_batch=True, shrink_min_rows=2)
    full_config = dataclasses.replace(config, shrink_min_rows=8)
    budgets = np.array([2, 16, 3, 1, 5, 4, 16, 2], np.int32)
    graphdef, state = nnx.split(ours)
    key = jax.random.key(12)
    shrunk = generate_from_states(graphdef, (state,), tokens, mask, key, config,
                                  stop_lengths=budgets)
    full = generate_from_states(graphdef, (state,), tokens, mask, key, full_config,
                                stop_lengths=budgets)
    for name in ("tokens", "lengths", "mask", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(shrunk, name)),
                                      np.asarray(getattr(full, name)), err_msg=name)
    np.testing.assert_allclose(np.asarray(shrunk.logprobs), np.asarray(full.logprobs),
                               atol=1e-5)
    assert np.isfinite(np.asarray(full.logprobs)).all()
    lengths = np.asarray(full.lengths)
    assert (lengths > 8).sum() <= 2 and lengths.max() > 8   # the 2-row loop ran
    # without budgets (EOS alone) the same holds
    eos_config = dataclasses.replace(config, eos_token_ids=tuple(range(0, 256, 3)))
    shrunk = generate_from_states(graphdef, (state,), tokens, mask, key, eos_config)
    full = generate_from_states(graphdef, (state,), tokens, mask, key,
                                dataclasses.replace(eos_config, shrink_min_rows=8))
    np.testing.assert_array_equal(np.asarray(shrunk.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(shrunk.lengths), np.asarray(full.lengths))
    shape = padded_prompt_shape(tokens.shape, config)

    def loops(config):   # while loops in the program (StableHLO)
        padded = jnp.zeros(shape, jnp.int32)
        return _generate_program.lower(graphdef, (state,), padded, padded.astype(bool), key,
                                       None, config=config,
                                       cache_length=shape[1] + 16).as_text().count(
                                           "stablehlo.while")
    # one decode loop (of 8 rows), two (8, 4) and three (8, 4, 2): each adds the same whiles
    one, two, three = (loops(dataclasses.replace(eos_config, shrink_min_rows=rows))
                       for rows in (8, 4, 2))
    assert three - two == two - one > 0
    compiled = compile_generate(graphdef, jax.eval_shape(lambda: (state,)), shape,
                                jax.ShapeDtypeStruct(key.shape, key.dtype), eos_config)
    ahead = generate_from_states(graphdef, (state,), tokens, mask, key, eos_config,
                                 compiled=compiled)
    np.testing.assert_array_equal(np.asarray(ahead.tokens), np.asarray(shrunk.tokens))


def test_a_shrinking_batch_dequantizes_once_only_for_the_loops_that_would_dequantize():
    """shrink_batch with dequantize_once on the kernel layout (Pallas interpret mode): 66 rows
    take the dequantize-then-dot path and 33 the fused kernels (dequantizes_at), so the 66-row
    loop runs the dense copy and the 33-row loop the quantized weights; tokens equal the same
    schedule's without dequantize_once, log-probs within 1e-5 (the same bf16 values)."""
    import copy

    from qerl_jax.model_quant.kernel_setup import disable_decode_attention, enable_kernels
    from qerl_jax.models.decode_fusion import dequantizes_at
    from qerl_jax.quant import KernelOptions
    from qerl_jax.quant.kernel_registry import unregister_kernels
    from qerl_jax.sampling import generate_from_states

    unregister_kernels("cpu")
    disable_decode_attention("cpu")
    laid_out = copy.deepcopy(_quantized_tiny_with_lora())
    try:
        assert dequantizes_at(laid_out, 66)   # the XLA path: every batch dequantizes
        enable_kernels(laid_out, KernelOptions(decode_attention=False), platform="cpu",
                       interpret=True, tile_k=256)
        assert dequantizes_at(laid_out, 65) and not dequantizes_at(laid_out, 64)
        tokens, mask = _prompts(np.random.default_rng(8), [6, 3, 5], 6, vocab=128)
        config = SamplingConfig(max_new_tokens=4, num_generations=22, prompt_bucket=8,
                                shrink_batch=True, shrink_min_rows=33)
        budgets = np.where(np.arange(66) % 2 == 0, 1, 4).astype(np.int32)
        from flax import nnx
        graphdef, state = nnx.split(laid_out)
        per_step = generate_from_states(graphdef, (state,), tokens, mask, jax.random.key(6),
                                        config, stop_lengths=budgets)
        once = generate_from_states(graphdef, (state,), tokens, mask, jax.random.key(6),
                                    dataclasses.replace(config, dequantize_once=True),
                                    stop_lengths=budgets)
        np.testing.assert_array_equal(np.asarray(once.tokens), np.asarray(per_step.tokens))
        np.testing.assert_allclose(np.asarray(once.logprobs), np.asarray(per_step.logprobs),
                                   atol=1e-5)
        assert np.isfinite(np.asarray(per_step.logprobs)).all()
        assert np.asarray(once.lengths).max() == 4
    finally:
        unregister_kernels("cpu")
        disable_decode_attention("cpu")


def test_prompt_ids_outside_the_vocabulary_are_named(tiny):
    """An id past the embedding table (NaN) or negative (another row's vector) would poison
    every token after it: the sampler refuses it, naming its row, column and value, before any
    work: host and device prompts, padding positions, ids an int32 cast would wrap."""
    _, ours = tiny
    vocab = ours.config.vocab_size
    tokens, mask = _prompts(np.random.default_rng(3), [5, 3], 5)
    config = SamplingConfig(max_new_tokens=2, greedy=True, prompt_bucket=8)
    for value, row, column in ((vocab, 1, 4), (-1, 0, 2)):
        bad = tokens.copy()
        bad[row, column] = value
        with pytest.raises(ValueError, match=rf"id {value} at row {row}, column {column} "
                                             rf"is outside the model's vocabulary \[0, {vocab}\)"):
            generate(ours, bad, mask, jax.random.key(0), config)
    big = tokens.astype(np.int64)
    big[1, 0] = 2 ** 32 + 5  # int32 would wrap it to 5: refused as given
    with pytest.raises(ValueError, match=r"id 4294967301 at row 1, column 0 "):
        generate(ours, big, mask, jax.random.key(0), config)
    padding = tokens.copy()
    assert not mask[1, 0]
    padding[1, 0] = vocab  # a padding position is embedded too
    with pytest.raises(ValueError, match=r"at row 1, column 0 "):
        generate(ours, padding, mask, jax.random.key(0), config)
    on_device = tokens.copy()
    on_device[0, 1] = vocab
    with pytest.raises(ValueError, match=rf"id {vocab} at row 0, column 1 "):
        generate(ours, jnp.asarray(on_device), jnp.asarray(mask), jax.random.key(0), config)
    rollout = generate(ours, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0), config)
    assert np.isfinite(np.asarray(rollout.logprobs)).all()
