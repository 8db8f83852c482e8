"""Evaluation CLI: pass@1 on a task's problems (GSM8K / MATH-500 jsonl, or a generated task's
held-out problems) for a base model plus a LoRA adapter, or for a training run's checkpoint (the
scoring is qerl_jax.evaluation's, as the trainer's held-out evaluation).

    python -m qerl_jax.evaluate --base /path/to/Qwen2.5-7B-Instruct --format nvfp4 \\
        --data ../shared/data/gsm8k/test.jsonl --task gsm8k [--peft DIR] \\
        [--temperature 0.6 --top_p 0.95 --n 4] --max_new_tokens 4096 --out results.json
    python -m qerl_jax.evaluate --run WORKDIR [--step N] --data ... --task gsm8k --out r.json
    python -m qerl_jax.evaluate --run WORKDIR --task arithmetic --limit 64 --out r.json

Greedy by default (--temperature 0); with a temperature, pass@1 is averaged over --n samples
per problem (the paper's protocol: 0.6 / 0.95 / 4096 tokens). Each completion is scored by the
task's correctness reward: whole normalized answers (GSM8K: numeric normalization; MATH:
math-verify), never first characters.

A run is evaluated as it was trained: its format, prompt style and chat template come from its
run.json (an explicit --prompt_style / --use_chat_template overrides, and the result records
it; a --format other than the run's is refused), and a generated task's problems are the run's
held-out ones (its seed and options). Nothing is written into the run directory; the result
goes to --out, every completion's record (prompt, completion, reward components, correct,
length, truncated; qerl_jax.infra.samples) to the .samples.jsonl file beside it; without --out
only the result, to stdout. Input errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from qerl_jax.data.prompts import PROMPT_STYLES
from qerl_jax.experiment_config import FIELDS
from qerl_jax.infra.errors import ConfigError
from qerl_jax.registry import FORMATS
from qerl_jax.tasks import get_task, task_names

HELD_OUT_COUNT = FIELDS["eval.num_examples"].default   # a generated task's problems by default


def samples_path(out: str) -> str:
    """The sample records' file beside the result file `out` (r.json -> r.samples.jsonl)."""
    return os.path.splitext(out)[0] + ".samples.jsonl"


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m qerl_jax.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="HF checkpoint directory of the base model")
    parser.add_argument("--format", choices=FORMATS.names(),
                        help="the base model's format (default bf16); with --run the run's "
                             "config.quant.format, and another value is refused")
    parser.add_argument("--peft", help="PEFT LoRA adapter directory (with --base)")
    parser.add_argument("--run", help="training run directory: evaluates one of its "
                                      "checkpoints, writing nothing there")
    parser.add_argument("--step", type=int,
                        help="with --run: the checkpoint step to evaluate (default the newest)")
    parser.add_argument("--data",
                        help="the rows of a --task read from files: a .jsonl/.parquet file or "
                             "a hub dataset name (a generated task takes none)")
    parser.add_argument("--task", choices=task_names(), required=True,
                        help="the task of the problems (its correctness reward scores)")
    parser.add_argument("--limit", type=int, default=0,
                        help=f"first N problems (0 = all; a generated task: {HELD_OUT_COUNT})")
    parser.add_argument("--n", type=int, default=1, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=1024)
    parser.add_argument("--max_prompt_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--prompt_style", choices=PROMPT_STYLES.names(),
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
    reads_files = get_task(args.task).reads_files
    if reads_files and not args.data:
        parser.error(f"--task {args.task} reads --data (a .jsonl/.parquet file or a hub "
                     "dataset name)")
    if args.data and not reads_files:
        parser.error(f"--task {args.task} generates its problems; leave --data out")
    return args


def _prompt_settings(args, run_config) -> dict:
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


def _problems(args, run_config) -> list:
    """The problems to evaluate: --data's rows (the first --limit), or a generated task's
    held-out problems (never a training question) for the run's seed and options with --run,
    else --seed and the task's defaults."""
    from qerl_jax.tasks import load_examples

    task = get_task(args.task)
    try:
        if task.reads_files:
            return load_examples(task, args.data, limit=args.limit or None)
        if task.held_out is None:
            raise ConfigError(f"--task {task.name}: generates no held-out problems")
        options = task.option_values(None if run_config is None else run_config.data)
        seed = args.seed if run_config is None else run_config.seed
        training = load_examples(task, seed=seed, **options)
        return task.held_out(options, seed, args.limit or HELD_OUT_COUNT, training)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--data {args.data}: {error}") from error


def _reward_names(args, run_config) -> tuple[str, ...] | None:
    """The reward components of the sample records: the run's rewards when it trained on
    --task, else (None) the task's own."""
    if run_config is None or run_config.data.task != args.task:
        return None
    return tuple(run_config.rewards.names)


def run_evaluation(args) -> dict:
    """Loads the model the arguments name, evaluates it, returns the result record."""
    # JAX and transformers load here, after the arguments parsed (`--help` stays fast)
    from qerl_jax.evaluation import (evaluate_model, load_peft_adapter, model_from_run,
                                     read_run_config)
    from qerl_jax.models.hf_io import load_hf_model
    from qerl_jax.models.tokenizer import eos_token_ids, load_tokenizer
    from qerl_jax.sampling import SamplingConfig

    run_config = None
    if args.run:
        run_config = read_run_config(args.run)
        if args.format is not None and args.format != run_config.quant.format:
            raise ConfigError(f"--format {args.format}: run {args.run} was trained with "
                              f"config.quant.format {run_config.quant.format!r}; leave "
                              "--format out to evaluate it as trained")
    prompt = _prompt_settings(args, run_config)
    examples = _problems(args, run_config)
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
    result = evaluate_model(model, tokenizer, examples, task=args.task, sampling=sampling,
                            max_prompt_length=args.max_prompt_length,
                            batch_size=args.batch_size, prompt_style=prompt["prompt_style"],
                            use_chat_template=prompt["use_chat_template"], seed=args.seed,
                            data=None if run_config is None else run_config.data,
                            reward_names=_reward_names(args, run_config),
                            with_samples=True)
    samples = [{"step": record.get("step"), **sample} for sample in result.pop("samples")]
    return {**result, **record, "samples": samples}


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
    samples = result.pop("samples")
    if args.out:
        result["samples_file"] = samples_path(args.out)
    print(json.dumps(result, indent=1))
    if args.out:
        from qerl_jax.infra.atomic_io import write_json_atomic
        from qerl_jax.infra.samples import write_samples_file
        write_samples_file(result["samples_file"], samples)
        write_json_atomic(args.out, result, indent=1)
    return {**result, "samples": samples}


if __name__ == "__main__":
    main()
