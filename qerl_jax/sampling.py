"""Jit-compiled rollout sampler: one prefill per prompt, G samples decoded from a shared KV cache.

generate(model, prompts, mask, key, config) runs:
  1. prefill of the P left-padded prompts (bucketed length) into a static-shape cache;
  2. the cache and last logits repeated G times (each prompt's KV reused by its G samples, no
     recomputation);
  3. a lax.while_loop of one-token decode steps that exits as soon as every sequence has emitted
     an EOS id, or at max_new_tokens (with SamplingConfig.shrink_batch, one such loop per batch
     size of shrink_schedule, the rows still generating gathered between them).
Every random draw is fold_in(key, step) (with shrink_batch, fold_in(fold_in(key, step), row)):
the same key gives the same tokens.
On a device mesh (qerl_jax.parallel.mesh) the prompts, the KV cache and every per-row array of
the loop are split by rows over the data (and FSDP) axes; the weights keep their own shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from qerl_jax import registry
from qerl_jax.lora import cast_adapters_for_compute
from qerl_jax.models.decode_fusion import (dequantize_for_rollout, dequantizes_at,
                                           prepare_decode)
from qerl_jax.models.kv_cache import KVCache, init_kv_cache
from qerl_jax.models.transformer import CausalLM, decode_step, prefill
from qerl_jax.parallel.distributed import put_global
from qerl_jax.parallel.mesh import (BATCH_AXES, batch_spec, constrain_logical, constrain_rows,
                                     path_names)

logger = logging.getLogger(__name__)


# "auto" = the compute dtype
KV_CACHE_DTYPES = registry.KV_CACHE_DTYPES.names()


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How completions are drawn.

    temperature: logits are divided by it (ignored when greedy).
    top_p: nucleus mass kept (1.0 = off). top_k: tokens kept (0 = off).
    greedy: argmax decoding. eos_token_ids: ids that end a completion.
    num_generations: G samples per prompt. max_new_tokens: completion length limit.
    prompt_bucket: prompt lengths are left-padded up to a multiple of this (power-of-two
      buckets above it), so a run compiles a handful of programs.
    kv_cache_dtype: "auto" = the compute dtype; "int8" / "float8_e4m3fn" = 8-bit codes with a
      float32 scale per token and kv head (qerl_jax.models.kv_cache), half the cache bytes.
    dequantize_once: a rollout whose rows (prompts x generations) take a dequantize-then-dot
      path for the quantized weights (more rows than the fused 4-bit kernels take, or no
      kernels) dequantizes each weight once, after the prefill, instead of at every decode
      step (qerl_jax.models.decode_fusion.dequantize_for_rollout): faster at large batches, for
      the dense weights' memory during the decode loop.
    shrink_batch: the decode loop drops finished rows: whenever at most half of its rows are
      still generating, it gathers them (and their KV cache rows) and goes on with half as many
      rows, while the half is >= shrink_min_rows (shrink_schedule; rows on one device only).
      Each row then draws from its own key, fold_in(step key, row), so a row samples the same
      tokens wherever it sits; the program holds one decode loop per batch size (longer
      compiles).
    shrink_min_rows: the smallest batch shrink_batch halves down to.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    eos_token_ids: tuple[int, ...] = ()
    num_generations: int = 1
    prompt_bucket: int = 64
    kv_cache_dtype: str = "auto"
    dequantize_once: bool = False
    shrink_batch: bool = False
    shrink_min_rows: int = 8

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: one of "
                             f"{KV_CACHE_DTYPES}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be positive")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (or set greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.num_generations <= 0:
            raise ValueError(f"num_generations={self.num_generations} must be positive")
        if self.prompt_bucket <= 0:
            raise ValueError(f"prompt_bucket={self.prompt_bucket} must be positive")
        if self.shrink_min_rows <= 0:
            raise ValueError(f"shrink_min_rows={self.shrink_min_rows} must be positive")


@struct.dataclass
class Rollout:
    """Sampled completions of P prompts x G generations (B = P*G rows, prompt-major).

    tokens: [B, N] int32 completion ids (0 after the end). logprobs: [B, N] float32 log-prob of
    each sampled token under the sampling distribution (temperature, top-k, top-p applied;
    0 for greedy). mask: [B, N] bool, True for generated tokens up to and including EOS.
    lengths: [B] int32 number of generated tokens. truncated: [B] bool, no EOS within N.
    """

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array


def bucket_length(length: int, bucket: int) -> int:
    """Smallest allowed padded length >= length: multiples of `bucket` up to 4*bucket, then
    powers of two (times bucket)."""
    if length <= 0:
        raise ValueError(f"prompt length {length} must be positive")
    multiples = -(-length // bucket)
    if multiples <= 4:
        return multiples * bucket
    return bucket * (1 << math.ceil(math.log2(multiples)))


# ------------------------------------------------------------------------------ token choice
def filter_logits(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Temperature, then top-k, then top-p (nucleus) masking. logits [B, V] float32 ->
    [B, V] with excluded tokens at -inf. Top-p keeps the smallest prefix of tokens sorted by
    probability whose mass reaches top_p (ties at the boundary kept, as in HF)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < top_p
        # threshold = the smallest kept logit; everything below it is dropped
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1,
                            keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def choose_tokens(logits: jax.Array, key: jax.Array, config: SamplingConfig,
                  rows: jax.Array | None = None):
    """Draws one token per row. Returns (tokens [B] int32, logprobs [B] float32).
    rows: [B] int ids of the rows: row i then draws from fold_in(key, rows[i]) alone (the
    same token at any position in the batch); None: one draw over the whole [B, V] from key."""
    if config.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, jnp.zeros(tokens.shape, jnp.float32)
    filtered = filter_logits(logits, config.temperature, config.top_k, config.top_p)
    if rows is None:
        tokens = jax.random.categorical(key, filtered, axis=-1)
    else:
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows)
        tokens = jax.vmap(jax.random.categorical)(row_keys, filtered)
    tokens = tokens.astype(jnp.int32)
    logprobs = jax.nn.log_softmax(filtered, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def _constrain_cache(cache: KVCache, mesh) -> KVCache:
    """The cache's rows over the mesh's batch axes, its keys' and values' kv heads over the
    tensor axis (where they divide)."""
    if mesh is None:
        return cache
    keys, values = constrain_logical((cache.keys, cache.values), mesh,
                                     ("batch", None, "heads", None))
    key_scales, value_scales = constrain_logical((cache.key_scales, cache.value_scales), mesh,
                                                 ("batch", None, "heads"))
    valid, next_position, index = constrain_rows(
        (cache.valid, cache.next_position, cache.index), mesh)
    return KVCache(keys=keys, values=values, valid=valid, next_position=next_position,
                   index=index, key_scales=key_scales, value_scales=value_scales)


def _repeat_rows(tree, times: int):
    return jax.tree_util.tree_map(
        lambda leaf: jnp.repeat(leaf, times, axis=0) if leaf.ndim >= 1 else leaf, tree)


def shrink_schedule(rows: int, config: SamplingConfig, shards: int = 1) -> tuple[int, ...]:
    """The decode loops' batch sizes: (rows,) without config.shrink_batch, or when the rows are
    split over several devices (shards > 1: gathering rows across them would copy the gathered
    cache onto every device); else rows, rows // 2, ... while the half is >=
    config.shrink_min_rows."""
    sizes = [rows]
    while config.shrink_batch and shards == 1:
        smaller = sizes[-1] // 2
        if smaller < max(config.shrink_min_rows, 1):
            break
        sizes.append(smaller)
    return tuple(sizes)


def _batch_shards(mesh) -> int:
    """How many parts the mesh splits the rows into (1 without a mesh)."""
    if mesh is None:
        return 1
    sizes = dict(mesh.shape)
    return math.prod(sizes.get(axis, 1) for axis in BATCH_AXES)


def _take_rows(cache: KVCache, order: jax.Array) -> KVCache:
    """The cache's rows `order` (int [b']), one layer's arrays after the other: each gather
    waits for the previous one (optimization barriers), so a layer's old rows are freed before
    the next layer's new rows are made and the gathered cache never coexists with all of the
    old one."""
    layers = [cache.layer(i) for i in range(len(cache.keys))]
    gathered = []
    for i, arrays in enumerate(layers):
        taken = tuple(jnp.take(array, order, axis=0) for array in arrays)
        if i + 1 < len(layers):   # the next layer's gather starts after this one
            taken, layers[i + 1] = jax.lax.optimization_barrier((taken, layers[i + 1]))
        gathered.append(taken)
    return cache.with_layers(gathered).replace(
        valid=jnp.take(cache.valid, order, axis=0),
        next_position=jnp.take(cache.next_position, order, axis=0))


# ------------------------------------------------------------------------------ the program
@functools.partial(jax.jit, static_argnames=("graphdef", "config", "cache_length", "mesh"))
def _generate_program(graphdef, states, prompt_tokens, prompt_mask, key, stop_lengths=None, *,
                      config: SamplingConfig, cache_length: int, mesh=None):
    def prepared_model():
        # a fresh Variable per leaf (nnx.merge of the same state twice shares its Variables, so
        # one copy's in-place changes would show in the other)
        model = nnx.merge(graphdef, *jax.tree_util.tree_map(lambda leaf: leaf, states))
        cast_adapters_for_compute(model)  # once here, not at every decode step
        prepare_decode(model)  # grouped [A_q | A_k | A_v], [A_gate | A_up], operands, prefetch
        return model

    model = prepared_model()
    # The cache is allocated inside the program: the while_loop updates it in place and XLA
    # frees it at the end (no host-side buffer to donate or copy).
    cache = _constrain_cache(
        init_kv_cache(model.config, prompt_tokens.shape[0], cache_length,
                      None if config.kv_cache_dtype == "auto" else config.kv_cache_dtype), mesh)
    logits, cache = prefill(model, prompt_tokens, prompt_mask, cache, empty_cache=True)
    groups = config.num_generations
    if groups > 1:
        logits = jnp.repeat(logits, groups, axis=0)
        cache = KVCache(keys=_repeat_rows(cache.keys, groups),
                        values=_repeat_rows(cache.values, groups),
                        valid=jnp.repeat(cache.valid, groups, axis=0),
                        next_position=jnp.repeat(cache.next_position, groups, axis=0),
                        index=cache.index,
                        key_scales=_repeat_rows(cache.key_scales, groups),
                        value_scales=_repeat_rows(cache.value_scales, groups))
    batch = logits.shape[0]
    sizes = shrink_schedule(batch, config, _batch_shards(mesh))
    if config.shrink_batch:
        logger.info("shrink_batch: decode loops of %s rows%s", "/".join(map(str, sizes)),
                    " (the rows are split over several devices: no shrinking)"
                    if _batch_shards(mesh) > 1 else "")
    dense_model = None

    def model_for(rows: int):
        """The model a decode loop of `rows` rows runs: with dequantize_once and a batch that
        would dequantize some weight at every step, a copy whose weights the first such batch
        (the largest) would dequantize are dense (made once, after the prefill; every later
        such loop shares it), else the quantized model."""
        nonlocal dense_model
        if not config.dequantize_once or not dequantizes_at(model, rows):
            return model
        if dense_model is None:
            dense_model = prepared_model()
            dequantize_for_rollout(dense_model, rows, after=logits)  # after the prefill's temporaries
        return dense_model

    steps = config.max_new_tokens
    eos = jnp.asarray(config.eos_token_ids or (-1,), jnp.int32)

    def decode_loop(decoder, carry, row_ids, budgets, next_size):
        """Decode steps while some row generates (and, with next_size, while more than
        next_size do); row_ids: each row's id in the rollout (its draws' key) or None."""

        def cond(carry):
            step, _, _, done, _, _ = carry
            going = (step < steps) & ~jnp.all(done)
            if next_size:
                going = going & (jnp.sum(~done) > next_size)
            return going

        def body(carry):
            step, tokens, logprobs, done, logits, cache = carry
            token, logprob = choose_tokens(logits, jax.random.fold_in(key, step), config,
                                           row_ids)
            token = jnp.where(done, 0, token)
            logprob = jnp.where(done, 0.0, logprob)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, step))
            logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None], (0, step))
            active = ~done
            done = done | jnp.isin(token, eos)
            if budgets is not None:   # a row's budget: it ends after budgets[row] tokens
                done = done | (step + 1 >= budgets)
            logits, cache = decode_step(decoder, token, cache, active=active)
            return (step + 1, *constrain_rows((tokens, logprobs, done, logits), mesh),
                    _constrain_cache(cache, mesh))

        return jax.lax.while_loop(cond, body, carry)

    carry = (jnp.zeros((), jnp.int32), *constrain_rows(
        (jnp.zeros((batch, steps), jnp.int32), jnp.zeros((batch, steps), jnp.float32),
         jnp.zeros((batch,), jnp.bool_), logits), mesh), _constrain_cache(cache, mesh))
    row_ids = jnp.arange(batch, dtype=jnp.int32) if config.shrink_batch else None
    budgets = stop_lengths
    all_tokens = all_logprobs = None
    for phase, size in enumerate(sizes):
        next_size = sizes[phase + 1] if phase + 1 < len(sizes) else 0
        carry = decode_loop(model_for(size), carry, row_ids, budgets, next_size)
        if not next_size:
            break
        # the loop's rows -> the full [batch, steps] buffers; the rows still generating (first,
        # in order) and finished ones up to next_size go on
        step, tokens, logprobs, done, logits, cache = carry
        if all_tokens is None:
            all_tokens, all_logprobs = tokens, logprobs
        else:
            all_tokens = all_tokens.at[row_ids].set(tokens)
            all_logprobs = all_logprobs.at[row_ids].set(logprobs)
        order = jnp.argsort(done, stable=True)[:next_size]
        row_ids = row_ids[order]
        if budgets is not None:
            budgets = budgets[order]
        carry = (step, *constrain_rows((tokens[order], logprobs[order], done[order],
                                         logits[order]), mesh),
                 _constrain_cache(_take_rows(cache, order), mesh))
    step, tokens, logprobs, done, _, _ = carry
    if all_tokens is not None:
        tokens = all_tokens.at[row_ids].set(tokens)
        logprobs = all_logprobs.at[row_ids].set(logprobs)
    # a row's length: tokens up to and including its first EOS, else all `step` tokens
    is_eos = jnp.isin(tokens, eos) & (jnp.arange(steps)[None, :] < step)
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, step)
    if stop_lengths is not None:   # a row without EOS ends at its budget
        first_eos = jnp.minimum(first_eos, jnp.maximum(stop_lengths, 1))
    lengths = first_eos.astype(jnp.int32)
    mask = jnp.arange(steps)[None, :] < lengths[:, None]
    truncated = ~(is_eos & mask).any(axis=1)   # no EOS within the row's own tokens
    return Rollout(tokens=jnp.where(mask, tokens, 0), logprobs=jnp.where(mask, logprobs, 0.0),
                   mask=mask, lengths=lengths, truncated=truncated)


def generate(model: CausalLM, prompt_tokens, prompt_mask, key: jax.Array,
             config: SamplingConfig) -> Rollout:
    """generate_from_states on nnx.split(model); see there."""
    graphdef, state = nnx.split(model)
    return generate_from_states(graphdef, (state,), prompt_tokens, prompt_mask, key, config)


def pad_prompts(prompt_tokens, prompt_mask, config: SamplingConfig,
                vocab_size: int | None = None):
    """[P, T] left-padded prompts -> (tokens int32, mask bool), both [P, bucket_length(T)]:
    more left padding up to the length bucket the sampler compiles for. Host prompts (numpy
    arrays, lists) are padded on the host, so a new T costs no XLA program (an eager jnp.pad
    would compile one per distinct [P, T]); device arrays are padded on the device. Raises
    ValueError naming both shapes unless they are equal and two-dimensional, and (with
    vocab_size) check_prompt_ids' error for an id outside the vocabulary."""
    on_device = isinstance(prompt_tokens, jax.Array) or isinstance(prompt_mask, jax.Array)
    xp = jnp if on_device else np
    check_prompt_ids(prompt_tokens, vocab_size)
    prompt_tokens = xp.asarray(prompt_tokens, xp.int32)
    prompt_mask = xp.asarray(prompt_mask, xp.bool_)
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
        raise ValueError(f"prompt_tokens {prompt_tokens.shape} and prompt_mask "
                         f"{prompt_mask.shape} must both be [P, T]")
    length = prompt_tokens.shape[1]
    pad = padded_prompt_shape(prompt_tokens.shape, config)[1] - length
    if pad:
        prompt_tokens = xp.pad(prompt_tokens, ((0, 0), (pad, 0)))
        prompt_mask = xp.pad(prompt_mask, ((0, 0), (pad, 0)))
    return jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask)


def padded_prompt_shape(prompt_shape: tuple[int, int], config: SamplingConfig) -> tuple[int, int]:
    """The [P, T_bucket] shape pad_prompts gives [P, T] prompts: the key of a sampler program."""
    count, length = prompt_shape
    return count, bucket_length(length, config.prompt_bucket)


def _replicated(mesh):
    """Whole on every device of `mesh` (None without one)."""
    return None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _prompt_sharding(shape, mesh):
    """Rows over the batch axes of `mesh` (None without one)."""
    if mesh is None:
        return None
    return jax.sharding.NamedSharding(mesh, batch_spec(shape, dict(mesh.shape), BATCH_AXES))


def compile_generate(graphdef, abstract_states: tuple, prompt_shape: tuple[int, int],
                     key, config: SamplingConfig, mesh=None,
                     stop_lengths: bool = False) -> jax.stages.Compiled:
    """Compiles the sampler program ahead of time from shapes only.

    Args:
      graphdef: as for generate_from_states (static).
      abstract_states: the states' shapes and dtypes (e.g. jax.eval_shape of the states): no
        weights need to be on the device while XLA compiles and autotunes.
      prompt_shape: (P, T_bucket), already bucketed (padded_prompt_shape).
      key: the PRNG key the program will get, or its jax.ShapeDtypeStruct.
      mesh: the device mesh the states are placed on (their abstract values then carry their
        shardings), or None.
      stop_lengths: compile for generate_from_states' per-row stop_lengths (an int32 [P * G]
        input) instead of none.
    Returns the executable for generate_from_states(..., compiled=); it raises TypeError when
    called with other shapes or dtypes (no silent recompilation).
    """
    count, length = prompt_shape
    if length != bucket_length(length, config.prompt_bucket):
        raise ValueError(f"prompt_shape {prompt_shape}: length {length} is not a bucket of "
                         f"prompt_bucket={config.prompt_bucket} (use padded_prompt_shape)")
    rows = _prompt_sharding((count, length), mesh)
    tokens = jax.ShapeDtypeStruct((count, length), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((count, length), jnp.bool_, sharding=rows)
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=_replicated(mesh))
    budgets = None
    if stop_lengths:
        budgets = jax.ShapeDtypeStruct((count * config.num_generations,), jnp.int32,
                                       sharding=_prompt_sharding(
                                           (count * config.num_generations,), mesh))
    return _generate_program.lower(graphdef, tuple(abstract_states), tokens, mask, key, budgets,
                                   config=config, cache_length=length + config.max_new_tokens,
                                   mesh=mesh).compile()


def _embedding_rows(states) -> int | None:
    """Rows of the model's token embedding table among `states` (nnx states or their abstract
    values), or None where there is none."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(states)[0]:
        if "embed_tokens" in path_names(path) and len(getattr(leaf, "shape", ())) == 2:
            return int(leaf.shape[0])
    return None


def check_prompt_ids(prompt_tokens, vocab_size: int | None) -> None:
    """Raises ValueError naming the first prompt id outside [0, vocab_size) (row, column,
    value) of [P, T] prompts, checked as given (before any int32 cast could wrap a large id):
    the embedding lookup gives NaN for an id past the table and another row's vector for a
    negative one, and every token sampled after it would be garbage. Padding positions are
    checked too (they are embedded as well). Costs one host copy of device prompts. Skipped
    while tracing, for arrays another process holds part of, for other than two dimensions
    (pad_prompts names those) and without a known vocabulary size."""
    if vocab_size is None or isinstance(prompt_tokens, jax.core.Tracer) or (
            isinstance(prompt_tokens, jax.Array) and not prompt_tokens.is_fully_addressable):
        return
    ids = np.asarray(prompt_tokens)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row, column = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"prompt_tokens: id {int(ids[row, column])} at row {row}, column "
                         f"{column} is outside the model's vocabulary [0, {vocab_size}) "
                         f"({int(bad.sum())} such ids in all)")


def generate_from_states(graphdef, states: tuple, prompt_tokens, prompt_mask, key: jax.Array,
                         config: SamplingConfig,
                         compiled: jax.stages.Compiled | None = None, mesh=None,
                         stop_lengths=None) -> Rollout:
    """Samples config.num_generations completions for each left-padded prompt.

    Args:
      graphdef, states: the (possibly quantized / LoRA) model as nnx.split gives it; the
        graphdef is static and the states are inputs, so new weights (e.g. AQN-noised norm
        scales, updated LoRA) do not recompile.
      prompt_tokens: [P, T] int, left-padded. prompt_mask: [P, T], 1 for real tokens.
      key: PRNG key for the whole batch (fold_in by step; with shrink_batch then by row).
      compiled: compile_generate's executable for these shapes and this config (None: the
        jitted program, compiled on first use of each shape).
      mesh: the device mesh the states are placed on (qerl_jax.parallel.mesh): the prompts'
        rows are split over its batch axes (with several processes, every process passes the
        same prompts and key); None: one device.
      stop_lengths: optional [P * G] int budgets >= 1: row r ends after stop_lengths[r] tokens
        unless EOS ends it first; a row ended by its budget is marked truncated, as at
        max_new_tokens. Benchmarks replay a measured completion-length distribution on
        random-weight models this way.
    Returns:
      Rollout with B = P * G rows, row p*G + g = generation g of prompt p.
    Raises ValueError for a prompt id outside the embedding table (check_prompt_ids).
    """
    prompt_tokens, prompt_mask = pad_prompts(prompt_tokens, prompt_mask, config,
                                             vocab_size=_embedding_rows(states))
    if stop_lengths is not None:
        stop_lengths = np.asarray(stop_lengths)
        count = prompt_tokens.shape[0] * config.num_generations
        if stop_lengths.shape != (count,) or not np.issubdtype(stop_lengths.dtype, np.integer) \
                or stop_lengths.min() < 1:
            raise ValueError(f"stop_lengths: expected {count} integers >= 1 (P * G rows), got "
                             f"{stop_lengths.dtype}{list(stop_lengths.shape)}")
        stop_lengths = stop_lengths.astype(np.int32)
    if mesh is not None:
        rows = _prompt_sharding(prompt_tokens.shape, mesh)
        prompt_tokens, prompt_mask = (put_global(prompt_tokens, rows),
                                      put_global(prompt_mask, rows))
        key = put_global(key, _replicated(mesh))
        if stop_lengths is not None:
            stop_lengths = put_global(stop_lengths,
                                      _prompt_sharding(stop_lengths.shape, mesh))
    if compiled is not None:   # compiled with or without budgets; a mismatch is a TypeError
        return compiled(tuple(states), prompt_tokens, prompt_mask, key, stop_lengths)
    total = prompt_tokens.shape[1] + config.max_new_tokens
    return _generate_program(graphdef, tuple(states), prompt_tokens, prompt_mask, key,
                             None if stop_lengths is None else jnp.asarray(stop_lengths),
                             config=config, cache_length=total, mesh=mesh)
