"""Held-out evaluation as a library: pass@1 of a policy on a task's examples (the trainer's
config.eval and the `python -m qerl_jax.evaluate` CLI), a PEFT LoRA adapter attached to a model,
and the noise-free model of a training run's checkpoint, read without writing anything.

Each completion is scored by the task's correctness reward (`Task.correctness_function`): whole
normalized answers (GSM8K numeric normalization, MATH math-verify, arithmetic exact integers),
never first characters.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable, Mapping, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx

from qerl_jax.data import encode_prompts
from qerl_jax.data.prompts import build_prompt_text
from qerl_jax.infra.checkpointing import TrainingCheckpoints
from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.run_record import RUN_FILE, current_config
from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora
from qerl_jax.model_setup import build_model
from qerl_jax.models.config import preset
from qerl_jax.models.safetensors_io import SafetensorsFile
from qerl_jax.models.tokenizer import decode_completion
from qerl_jax.rewards.registry import RewardFunction, get_reward_functions
from qerl_jax.rewards.scoring import reward_values
from qerl_jax.sampling import Rollout, SamplingConfig, generate
from qerl_jax.tasks import Task, get_task
from qerl_jax.warmup import require_cached_warmup, warmup_settings

logger = logging.getLogger(__name__)


def load_peft_adapter(model, directory: str) -> LoRAConfig:
    """Attaches a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    with open(os.path.join(directory, "adapter_config.json")) as handle:
        peft_config = json.load(handle)
    targets = peft_config["target_modules"]
    config = LoRAConfig(rank=int(peft_config["r"]), alpha=float(peft_config["lora_alpha"]),
                        target_modules=tuple(sorted(targets)))
    add_lora(model, config, jax.random.key(0))
    file = SafetensorsFile(os.path.join(directory, "adapter_model.safetensors"))
    loaded = 0
    for name in file.keys():
        parts = name.split(".")
        if "lora_A" not in parts and "lora_B" not in parts:
            continue
        layer_index = parts[parts.index("layers") + 1]
        block, projection = parts[parts.index("layers") + 2], parts[parts.index("layers") + 3]
        layer = getattr(getattr(model.layers[int(layer_index)], block), projection)
        value = np.asarray(file[name], np.float32).T
        if "lora_A" in parts:
            layer.lora_a.set_value(jax.numpy.asarray(value))
        else:
            layer.lora_b.set_value(jax.numpy.asarray(value))
        loaded += 1
    if loaded == 0:
        raise ValueError(f"{directory}: adapter_model.safetensors holds no lora_A/lora_B tensors")
    return config


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The run's current config: its last start's in run.json (either form run_record reads)."""
    try:
        config = current_config(workdir)
    except (KeyError, TypeError, AttributeError):   # a start without a config object
        config = None
    if not isinstance(config, dict):
        raise ConfigError(f"{os.path.join(workdir, RUN_FILE)}: its last start holds no config "
                          "object")
    return ml_collections.ConfigDict(config)


def _require_cached_warmup(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Refuses (ConfigError) a preset run whose cached warm-up model is missing or was made with
    other settings: build_model would train a new one into the run directory."""
    if config.model.hf_path or config.warmup.steps <= 0:
        return
    model_cfg = config.model
    # the architecture build_model's warm-up path initializes (the cache records it)
    architecture = preset(model_cfg.preset, param_dtype=model_cfg.param_dtype,
                          compute_dtype=model_cfg.compute_dtype, remat=model_cfg.remat,
                          **dict(model_cfg.overrides))
    require_cached_warmup(os.path.join(workdir, "warmup"), warmup_settings(
        architecture, steps=config.warmup.steps, learning_rate=config.warmup.learning_rate,
        batch_size=config.warmup.batch_size, seed=config.seed,
        prompt_style=config.data.prompt_style, max_operand=config.data.arithmetic_max_operand))


def _open_checkpoints(workdir: str) -> TrainingCheckpoints:
    """The run's checkpoints, opened read-only: nothing is created, cleaned or moved."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory}: no such directory (the run saved no checkpoint)")
    return TrainingCheckpoints(directory, read_only=True)


def model_from_run(workdir: str, step: int | None = None,
                   config: ml_collections.ConfigDict | None = None):
    """The noise-free model of a training run's checkpoint, read without writing anything.

    The base model is rebuilt as the config describes (a preset's cached warm-up is required,
    never retrained), LoRA is attached as the trainer does, and the checkpoint's trainable
    params replace the fresh ones.

    Args:
      workdir: the run directory (run.json, checkpoints/, warmup/).
      step: the checkpoint to restore; None = the newest.
      config: the run's config if already read (read_run_config).
    Returns:
      (model, tokenizer, config, step restored).
    """
    from qerl_jax.rl.optimizer import make_optimizer   # the optimizer state's structure

    config = read_run_config(workdir) if config is None else config
    checkpoints = _open_checkpoints(workdir)
    try:
        steps = checkpoints.all_steps()
        if not steps:
            raise ConfigError(f"{checkpoints.directory}: no complete checkpoint to evaluate")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ConfigError(f"--step {step}: no such checkpoint in {checkpoints.directory} "
                              f"(steps there: {steps})")
        _require_cached_warmup(config, workdir)
        model, tokenizer = build_model(config, workdir)
        lora_config = LoRAConfig(rank=config.lora.rank, alpha=config.lora.alpha,
                                 target_modules=tuple(config.lora.target_modules),
                                 train_norms=config.lora.train_norms)
        add_lora(model, lora_config, jax.random.fold_in(jax.random.key(config.seed), 1))
        graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
        template = {"trainable": trainable,
                    "opt_state": make_optimizer(config.train)[0].init(trainable)}
        try:
            arrays, meta = checkpoints.restore(template, step)
        except (ValueError, OSError, KeyError) as error:   # other shapes, missing files
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"{checkpoints.step_path(step)}: cannot be restored into the "
                              f"run's model ({reason})") from error
    finally:
        checkpoints.close()
    if meta.get("seed", config.seed) != config.seed:
        raise ConfigError(f"{checkpoints.directory} step {step}: checkpoint seed {meta['seed']} "
                          f"!= run.json config.seed {config.seed}")
    return nnx.merge(graphdef, arrays["trainable"], frozen), tokenizer, config, step


def decoded_completions(tokenizer, rollout: Rollout) -> list[str]:
    """Each rollout row's completion: its generated tokens as text (special tokens kept)."""
    return [decode_completion(tokenizer, rollout.tokens[row, :int(rollout.lengths[row])].tolist())
            for row in range(rollout.tokens.shape[0])]


def pass_at_1(sample: Callable[[np.ndarray, np.ndarray, jax.Array], Rollout], tokenizer,
              examples, *, correctness: RewardFunction, samples_per_problem: int,
              max_prompt_length: int, batch_size: int, prompt_style: str,
              use_chat_template: bool = True, seed: int = 0,
              rewards: Mapping[str, RewardFunction] | None = None,
              with_samples: bool = False) -> dict:
    """pass@1 of the policy `sample` draws from: the fraction of all completions that
    `correctness` (a task's correctness reward) scores above 0.

    Args:
      sample: (prompt tokens [P, T], prompt mask [P, T], key) -> Rollout of P *
        samples_per_problem rows, prompt-major (generate / generate_from_states).
      examples: the problems, scored in batches of `batch_size`; batch b's key is
        fold_in(key(seed), b * batch_size).
      correctness: f(completion, gold) -> reward; one that raises counts as wrong.
      rewards: name -> reward function, each completion's reward components in its sample
        record (with_samples).
      with_samples: also return every completion's record (infra.samples, without step and
        advantage) under 'samples'.
    Returns:
      {'pass@1', 'problems', 'samples_per_problem', 'pass@1_std_over_samples', 'mean_length'
      (generated tokens per completion)[, 'samples']}.
    """
    components = dict(rewards or {})
    scores, lengths, records = [], [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        texts = [build_prompt_text(tokenizer, e.question, style=prompt_style,
                                   use_chat_template=use_chat_template) for e in chunk]
        prompts = encode_prompts(tokenizer, texts, max_prompt_length)
        rollout = jax.device_get(sample(prompts.tokens, prompts.mask,
                                        jax.random.fold_in(jax.random.key(seed), start)))
        for row, text in enumerate(decoded_completions(tokenizer, rollout)):
            length = int(rollout.lengths[row])
            problem = row // samples_per_problem
            gold = chunk[problem].gold
            correct, *values = reward_values(text, gold, [correctness, *components.values()])
            scores.append(1.0 if correct > 0 else 0.0)
            lengths.append(length)
            if with_samples:
                records.append({
                    "problem": start + problem, "sample": row % samples_per_problem,
                    "prompt": texts[problem], "completion": text,
                    "rewards": dict(zip(components, values)), "correct": correct > 0,
                    "length": length, "truncated": bool(rollout.truncated[row])})
    per_problem = np.asarray(scores).reshape(len(examples), samples_per_problem)
    result = {"pass@1": float(per_problem.mean()), "problems": len(examples),
              "samples_per_problem": samples_per_problem,
              "pass@1_std_over_samples": float(per_problem.mean(axis=0).std()),
              "mean_length": float(np.mean(lengths))}
    return {**result, "samples": records} if with_samples else result


def evaluation_due(step: int, config: ml_collections.ConfigDict) -> bool:
    """Whether the trainer evaluates before `step`: at step 0, every eval.every_steps steps and
    at train.total_steps (eval.every_steps 0: never)."""
    every = config.eval.every_steps
    return bool(every) and (step % every == 0 or step == config.train.total_steps)


def held_out_sampling(config: ml_collections.ConfigDict, eos_token_ids) -> SamplingConfig:
    """The held-out evaluation's greedy decoding: eval.max_new_tokens tokens (0: the
    rollouts'), the rollouts' prompt buckets."""
    rollout = config.rollout
    return SamplingConfig(max_new_tokens=config.eval.max_new_tokens or rollout.max_new_tokens,
                          greedy=True, num_generations=1, prompt_bucket=rollout.prompt_bucket,
                          eos_token_ids=eos_token_ids)


def held_out_metrics(sample, tokenizer, examples, config: ml_collections.ConfigDict,
                     correctness: RewardFunction, step: int) -> dict:
    """The trainer's held-out evaluation: greedy pass@1 of `sample` (one completion per
    problem) on `examples` with the config's prompt settings, one log line.

    Returns:
      {'eval/pass@1', 'eval/mean_length' (tokens per completion), 'eval/num_examples',
      'time/eval_s'}.
    """
    started = time.perf_counter()
    data = config.data
    result = pass_at_1(sample, tokenizer, examples, correctness=correctness,
                       samples_per_problem=1, max_prompt_length=data.max_prompt_length,
                       batch_size=config.eval.batch_size, prompt_style=data.prompt_style,
                       use_chat_template=data.use_chat_template, seed=config.seed)
    seconds = time.perf_counter() - started
    logger.info("step %d: held-out pass@1 %.4f on %d examples (greedy, %.1f s)", step,
                result["pass@1"], result["problems"], seconds)
    return {"eval/pass@1": result["pass@1"], "eval/mean_length": result["mean_length"],
            "eval/num_examples": result["problems"], "time/eval_s": seconds}


def evaluate_model(model, tokenizer, examples, *, task: str | Task, sampling: SamplingConfig,
                   max_prompt_length: int, batch_size: int, prompt_style: str,
                   use_chat_template: bool = True, seed: int = 0,
                   data: Mapping | None = None, reward_names: Sequence[str] | None = None,
                   with_samples: bool = False) -> dict:
    """pass@1 of `model` on `examples` of `task` (scored by its correctness reward under the
    options in `data`, a config.data section), completions drawn with `sampling`; with_samples:
    every completion's record under 'samples', its reward components those of `reward_names`
    (default the task's training rewards)."""
    task = get_task(task)
    names = task.reward_names(data) if reward_names is None else reward_names
    return pass_at_1(lambda tokens, mask, key: generate(model, tokens, mask, key, sampling),
                     tokenizer, examples, correctness=task.correctness_function(data),
                     samples_per_problem=sampling.num_generations,
                     max_prompt_length=max_prompt_length, batch_size=batch_size,
                     prompt_style=prompt_style, use_chat_template=use_chat_template, seed=seed,
                     rewards=get_reward_functions(list(names)) if names else {},
                     with_samples=with_samples)
