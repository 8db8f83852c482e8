"""Supervised warm-up of a model from scratch on the synthetic arithmetic task.

The tiny CPU default starts from random weights; a short supervised phase teaches the answer
format and some arithmetic, so that GRPO's rewards are not all zero. The result (HF checkpoint
+ char tokenizer) is cached in the workdir and reused by later runs and resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.data.prompts import build_prompt_text
from qerl_jax.infra.errors import ConfigError
from qerl_jax.models.hf_io import load_hf_model, save_hf_model
from qerl_jax.models.tokenizer import load_tokenizer
from qerl_jax.models.transformer import CausalLM
from qerl_jax.data.arithmetic import arithmetic_problems

logger = logging.getLogger(__name__)


def arithmetic_target(question: str, answer: str, eos: str) -> str:
    """The completion the warm-up teaches: the think/answer format around the exact result."""
    return f"<think>{question}</think><answer>{answer}</answer>{eos}"


def _encode_pairs(tokenizer, pairs, prompt_style):
    rows, targets = [], []
    for question, answer in pairs:
        prompt = tokenizer(build_prompt_text(tokenizer, question, style=prompt_style),
                           add_special_tokens=False)["input_ids"]
        completion = tokenizer(arithmetic_target(question, answer, tokenizer.eos_token),
                               add_special_tokens=False)["input_ids"]
        rows.append(prompt + completion)
        targets.append([0] * len(prompt) + [1] * len(completion))
    length = max(len(row) for row in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), np.bool_)
    loss_mask = np.zeros((len(rows), length), np.float32)
    for i, (row, target) in enumerate(zip(rows, targets)):  # left padding, as in rollouts
        tokens[i, length - len(row):] = row
        mask[i, length - len(row):] = True
        loss_mask[i, length - len(row):] = target
    return tokens, mask, loss_mask


def supervised_warmup(model: CausalLM, tokenizer, *, steps: int, learning_rate: float,
                      batch_size: int, seed: int, prompt_style: str = "plain",
                      max_operand: int = 20) -> list[float]:
    """Trains all of `model`'s params by next-token cross-entropy on the completions.

    Returns the loss curve. Every draw comes from `seed`.
    """
    problems = arithmetic_problems(steps * batch_size, seed=seed + 10_000,
                                   max_operand=max_operand)
    pairs = [(p["question"], p["answer"]) for p in problems]
    tokens, mask, loss_mask = _encode_pairs(tokenizer, pairs, prompt_style)
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, max(steps // 10, 1), steps), weight_decay=0.01)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens, mask, loss_mask):
        def loss_fn(params):
            net = nnx.merge(graphdef, params, rest)
            logits = net(tokens, mask)[:, :-1]
            log_probs = jax.nn.log_softmax(logits, axis=-1)
            target = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
            weights = loss_mask[:, 1:]
            return -(target * weights).sum() / weights.sum()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for step in range(steps):
        rows = slice(step * batch_size, (step + 1) * batch_size)
        params, opt_state, loss = train_step(params, opt_state, tokens[rows], mask[rows],
                                             loss_mask[rows])
        losses.append(float(loss))
        if step % max(steps // 5, 1) == 0 or step == steps - 1:
            logger.info("warm-up step %d/%d: loss %.4f", step + 1, steps, losses[-1])
    nnx.update(model, params)
    return losses


def _settings_mismatch(marker: str, settings: dict) -> list[str]:
    """Fields whose cached value differs from `settings` (all of them for an old marker)."""
    try:
        with open(marker) as handle:
            cached = json.load(handle).get("settings", {})
    except (json.JSONDecodeError, AttributeError):
        cached = {}
    return [f"{name}: cached {cached.get(name, '<missing>')!r} vs now {value!r}"
            for name, value in settings.items() if cached.get(name) != value]


def warmup_settings(architecture, *, steps: int, learning_rate: float, batch_size: int,
                    seed: int, prompt_style: str, max_operand: int) -> dict:
    """Every setting a cached warm-up depends on, as its marker file records them.

    Args:
      architecture: the model's ModelConfig; fields that do not change the weights (remat,
        the attention implementation and its query chunk) are left out.
    """
    settings = {"steps": steps, "learning_rate": learning_rate, "batch_size": batch_size,
                "seed": seed, "prompt_style": prompt_style, "max_operand": max_operand,
                "architecture": {name: value for name, value in
                                 dataclasses.asdict(architecture).items()
                                 if name not in ("remat", "attention_query_chunk",
                                                 "attention_implementation")}}
    return json.loads(json.dumps(settings))   # the form it takes after a round trip


def require_cached_warmup(directory: str, settings: dict) -> None:
    """Raises ConfigError (one line naming `directory`) unless it holds a complete warm-up made
    with `settings`. Reads only: for loading a finished run without ever training a warm-up."""
    marker = os.path.join(directory, "warmup_done.txt")
    if not os.path.isfile(marker):
        raise ConfigError(f"{directory}: no cached warm-up model ({marker} is missing); this "
                          "run's model cannot be rebuilt without redoing its warm-up")
    different = _settings_mismatch(marker, settings)
    if different:
        raise ConfigError(f"{directory}: cached warm-up was made with other settings ("
                          + "; ".join(different) + ")")


def cached_warmup_model(directory: str, make_model, tokenizer_builder, *, steps: int,
                        learning_rate: float, batch_size: int, seed: int,
                        prompt_style: str = "plain", max_operand: int = 20):
    """Loads the warmed-up model + tokenizer from `directory`, or trains and saves them there.

    make_model() -> a fresh CausalLM; tokenizer_builder(path) writes the tokenizer. The
    tokenizer lives in its own subdirectory: next to a config.json with model_type qwen2,
    AutoTokenizer would pick Qwen2Tokenizer and tokenize differently.

    The marker file records every setting the warm-up depends on (its hyperparameters, the seed
    and the architecture); a cache made with other settings is never reused silently: it raises
    a ConfigError naming the fields that differ.
    """
    marker = os.path.join(directory, "warmup_done.txt")
    tokenizer_directory = os.path.join(directory, "tokenizer")
    model = make_model()
    settings = warmup_settings(model.config, steps=steps, learning_rate=learning_rate,
                               batch_size=batch_size, seed=seed, prompt_style=prompt_style,
                               max_operand=max_operand)
    if os.path.isfile(marker):
        different = _settings_mismatch(marker, settings)
        if different:
            raise ConfigError(f"{directory}: cached warm-up was made with other settings ("
                             + "; ".join(different) + "). Delete the directory to redo the "
                             "warm-up, or use another workdir.")
        tokenizer = load_tokenizer(tokenizer_directory)
        loaded = load_hf_model(directory, param_dtype=model.config.param_dtype,
                               compute_dtype=model.config.compute_dtype,
                               remat=model.config.remat)
        logger.info("warm-up: reusing the cached model in %s", directory)
        return loaded, tokenizer
    os.makedirs(directory, exist_ok=True)
    tokenizer_builder(tokenizer_directory)
    tokenizer = load_tokenizer(tokenizer_directory)
    losses = supervised_warmup(model, tokenizer, steps=steps, learning_rate=learning_rate,
                               batch_size=batch_size, seed=seed, prompt_style=prompt_style,
                               max_operand=max_operand)
    save_hf_model(model, directory)
    write_json_atomic(marker, {"settings": settings, "final_loss": losses[-1]}, indent=1)
    return model, tokenizer
