"""Evaluation CLI: pass@1 on GSM8K / MATH-500 jsonl for a base model plus a LoRA adapter, or
for a training run's checkpoint. Its scoring (`pass_at_1`) is also the trainer's held-out
evaluation (config.eval).

    python -m qerl_jax.evaluate --base /path/to/Qwen2.5-7B-Instruct --format nvfp4 \\
        --data ../shared/data/gsm8k/test.jsonl --task gsm8k [--peft DIR] \\
        [--temperature 0.6 --top_p 0.95 --n 4] --max_new_tokens 4096 --out results.json
    python -m qerl_jax.evaluate --run WORKDIR [--step N] --data ... --task gsm8k --out r.json

Greedy by default (--temperature 0); with a temperature, pass@1 is averaged over --n samples
per problem (the paper's protocol: 0.6 / 0.95 / 4096 tokens). Whole normalized answers are
compared (GSM8K: numeric normalization; MATH: math-verify), never first characters.

A run is evaluated as it was trained: its format, prompt style and chat template come from its
run.json (an explicit --prompt_style / --use_chat_template overrides, and the result records
it; a --format other than the run's is refused). Nothing is written into the run directory;
the result goes to --out, else only to stdout. Input errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Callable

import jax
import ml_collections
import numpy as np
from flax import nnx

from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.infra.checkpointing import TrainingCheckpoints
from qerl_jax.experiment_config import FORMATS
from qerl_jax.data import encode_prompts, load_examples
from qerl_jax.data.prompts import build_prompt_text
from qerl_jax.infra.errors import ConfigError
from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora
from qerl_jax.model_setup import build_model
from qerl_jax.models.config import preset
from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.models.safetensors_io import SafetensorsFile
from qerl_jax.models.tokenizer import decode_completion, eos_token_ids, load_tokenizer
from qerl_jax.rewards.arithmetic import arithmetic_last_integer_reward, arithmetic_reward
from qerl_jax.rewards.gsm8k import gsm8k_numeric_reward
from qerl_jax.rewards.math_answers import math_accuracy_reward
from qerl_jax.infra.run_record import RUN_FILE, current_config
from qerl_jax.sampling import Rollout, SamplingConfig, generate
from qerl_jax.warmup import require_cached_warmup, warmup_settings

logger = logging.getLogger(__name__)

PROMPT_STYLES = ("paper", "system", "plain")   # build_prompt_text's styles


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


def correctness(task: str, completion: str, gold: str, *,
                arithmetic_phrasing: str = "expression") -> float:
    """1.0 for a correct final answer, else 0.0: GSM8K numeric, arithmetic exact integer (the
    first integer for '7+5=' problems, the last for 'What is 7 + 5?', as the task's rewards
    read them), MATH math-verify."""
    if task == "gsm8k":
        return gsm8k_numeric_reward(completion, gold) / 2.0
    if task == "arithmetic":
        reward = (arithmetic_last_integer_reward if arithmetic_phrasing == "question"
                  else arithmetic_reward)
        return reward(completion, gold)
    return math_accuracy_reward(completion, gold)


def pass_at_1(sample: Callable[[np.ndarray, np.ndarray, jax.Array], Rollout], tokenizer,
              examples, *, task: str, samples_per_problem: int, max_prompt_length: int,
              batch_size: int, prompt_style: str, use_chat_template: bool = True,
              seed: int = 0, arithmetic_phrasing: str = "expression") -> dict:
    """pass@1 of the policy `sample` draws from: the mean correctness over every completion.

    Args:
      sample: (prompt tokens [P, T], prompt mask [P, T], key) -> Rollout of P *
        samples_per_problem rows, prompt-major (generate / generate_from_states).
      examples: the problems, scored in batches of `batch_size`; batch b's key is
        fold_in(key(seed), b * batch_size).
    Returns:
      {'pass@1', 'problems', 'samples_per_problem', 'pass@1_std_over_samples', 'mean_length'
      (generated tokens per completion)}.
    """
    scores, lengths = [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        texts = [build_prompt_text(tokenizer, e.question, style=prompt_style,
                                   use_chat_template=use_chat_template) for e in chunk]
        prompts = encode_prompts(tokenizer, texts, max_prompt_length)
        rollout = jax.device_get(sample(prompts.tokens, prompts.mask,
                                        jax.random.fold_in(jax.random.key(seed), start)))
        for row in range(rollout.tokens.shape[0]):
            length = int(rollout.lengths[row])
            text = decode_completion(tokenizer, rollout.tokens[row, :length].tolist())
            scores.append(correctness(task, text, chunk[row // samples_per_problem].gold,
                                      arithmetic_phrasing=arithmetic_phrasing))
            lengths.append(length)
    per_problem = np.asarray(scores).reshape(len(examples), samples_per_problem)
    return {"pass@1": float(per_problem.mean()), "problems": len(examples),
            "samples_per_problem": samples_per_problem,
            "pass@1_std_over_samples": float(per_problem.mean(axis=0).std()),
            "mean_length": float(np.mean(lengths))}


def evaluate(model, tokenizer, examples, *, task: str, sampling: SamplingConfig,
             max_prompt_length: int, batch_size: int, prompt_style: str,
             use_chat_template: bool = True, seed: int = 0) -> dict:
    """pass@1 of `model` on `examples`, completions drawn with `sampling` (pass_at_1)."""
    return pass_at_1(lambda tokens, mask, key: generate(model, tokens, mask, key, sampling),
                     tokenizer, examples, task=task,
                     samples_per_problem=sampling.num_generations,
                     max_prompt_length=max_prompt_length, batch_size=batch_size,
                     prompt_style=prompt_style, use_chat_template=use_chat_template, seed=seed)


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="HF checkpoint directory of the base model")
    parser.add_argument("--format", choices=FORMATS,
                        help="the base model's format (default bf16); with --run the run's "
                             "config.quant.format, and another value is refused")
    parser.add_argument("--peft", help="PEFT LoRA adapter directory (with --base)")
    parser.add_argument("--run", help="training run directory: evaluates one of its "
                                      "checkpoints, writing nothing there")
    parser.add_argument("--step", type=int,
                        help="with --run: the checkpoint step to evaluate (default the newest)")
    parser.add_argument("--data", required=True, help="GSM8K or MATH-500 jsonl")
    parser.add_argument("--task", choices=("gsm8k", "math"), required=True)
    parser.add_argument("--limit", type=int, default=0, help="first N problems (0 = all)")
    parser.add_argument("--n", type=int, default=1, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=1024)
    parser.add_argument("--max_prompt_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--prompt_style", choices=PROMPT_STYLES,
                        help="default: the run's config.data.prompt_style with --run, else "
                             "paper")
    parser.add_argument("--use_chat_template", choices=("true", "false"),
                        help="default: the run's config.data.use_chat_template with --run, "
                             "else true")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling keys")
    parser.add_argument("--out", help="write the result JSON here (else it is only printed)")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an input error instead of one line")
    args = parser.parse_args(argv)
    if bool(args.base) == bool(args.run):
        parser.error("give exactly one of --base (with optional --peft) or --run")
    if args.run and args.peft:
        parser.error("--peft goes with --base; a --run's adapters come from its checkpoint")
    if args.step is not None and not args.run:
        parser.error("--step goes with --run")
    return args


def _prompt_settings(args, run_config: ml_collections.ConfigDict | None) -> dict:
    """The prompt style and chat template to evaluate with, and where each came from: the
    command line, else the run's config, else the defaults."""
    settings = {}
    run_data = run_config.data if run_config is not None else None
    for name, given, default in (
            ("prompt_style", args.prompt_style, "paper"),
            ("use_chat_template",
             None if args.use_chat_template is None else args.use_chat_template == "true",
             True)):
        run_value = None if run_data is None else run_data.get(name, default)
        if given is not None:
            settings[name], settings[f"{name}_from"] = given, "command line"
        elif run_value is not None:
            settings[name], settings[f"{name}_from"] = run_value, "run"
        else:
            settings[name], settings[f"{name}_from"] = default, "default"
        if run_data is not None:
            settings[f"run_{name}"] = run_value
    return settings


def run_evaluation(args) -> dict:
    """Loads the model the arguments name, evaluates it, returns the result record."""
    run_config = None
    if args.run:
        run_config = read_run_config(args.run)
        if args.format is not None and args.format != run_config.quant.format:
            raise ConfigError(f"--format {args.format}: run {args.run} was trained with "
                              f"config.quant.format {run_config.quant.format!r}; leave "
                              "--format out to evaluate it as trained")
    prompt = _prompt_settings(args, run_config)
    try:
        examples = load_examples(args.task, args.data, limit=args.limit or None)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--data {args.data}: {error}") from error
    record = {"task": args.task, "data": args.data, "limit": args.limit,
              "temperature": args.temperature, "top_p": args.top_p,
              "max_new_tokens": args.max_new_tokens,
              "max_prompt_length": args.max_prompt_length, "batch_size": args.batch_size,
              "seed": args.seed, **prompt}
    if args.run:
        model, tokenizer, run_config, step = model_from_run(args.run, args.step, run_config)
        record.update(format=run_config.quant.format, run=os.path.abspath(args.run), step=step,
                      run_seed=run_config.seed)
    else:
        tokenizer = load_tokenizer(args.base)
        record.update(format=args.format or "bf16", base=args.base, peft=args.peft)
        if record["format"] == "bf16":
            model = load_hf_model(args.base, param_dtype="bfloat16")
        else:
            from qerl_jax.model_quant.quantize import load_quantized_hf_model
            model, _ = load_quantized_hf_model(args.base, record["format"])
        if args.peft:
            load_peft_adapter(model, args.peft)
    greedy = args.temperature == 0.0
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=greedy,
                              temperature=1.0 if greedy else args.temperature, top_p=args.top_p,
                              num_generations=1 if greedy else args.n,
                              eos_token_ids=eos_token_ids(tokenizer, model.config.eos_token_id))
    result = evaluate(model, tokenizer, examples, task=args.task, sampling=sampling,
                      max_prompt_length=args.max_prompt_length, batch_size=args.batch_size,
                      prompt_style=prompt["prompt_style"],
                      use_chat_template=prompt["use_chat_template"], seed=args.seed)
    return {**result, **record}


def main(argv=None):
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        result = run_evaluation(args)
    except ConfigError as error:
        if args.debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result, indent=1))
    if args.out:
        write_json_atomic(args.out, result, indent=1)
    return result


if __name__ == "__main__":
    main()
