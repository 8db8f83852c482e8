"""A few full GRPO steps (rollout + train) on a random-weight model shape, on the GPU.

Builds the Trainer on a preset (random weights, quantized to --format, LoRA rank --rank), a
char-level tokenizer (the shapes are what matter), prompts padded to --prompt tokens (prompt
bucket) and --completion new tokens (a random model almost never samples EOS, so completions run
to the limit), G = --group. Prints per-step rollout / train time and peak device memory, and
writes a markdown table + JSON under --out.

    python benchmarks/grpo_step.py --preset qwen2p5_7b --format nvfp4 --steps 3 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile

import _common as common
import jax

from qerl_jax.models.char_tokenizer import build_char_tokenizer
from qerl_jax.trainer import Trainer


def make_config(args, tokenizer_dir):
    return common.grpo_config(preset=args.preset, format_name=args.format,
                              tokenizer_dir=tokenizer_dir, rank=args.rank, group=args.group,
                              prompts=args.prompts, prompt=args.prompt,
                              completion=args.completion, micro_batch=args.micro_batch,
                              steps=args.steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen2p5_7b")
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="grpo_step_")
    tokenizer_dir = os.path.join(workdir, "tokenizer")
    build_char_tokenizer(tokenizer_dir)
    trainer = Trainer(make_config(args, tokenizer_dir), os.path.join(workdir, "run"))
    history = trainer.train()
    rows = [{"step": m["step"], "rollout_s": m["time/rollout_s"], "train_s": m["time/train_s"],
             "generated_tokens_per_s": m["rollout_tokens_per_s"],
             "completion_length": m["completion_length"],
             "peak_GiB": m["peak_memory_bytes"] / 2**30} for m in history]
    header = (f"GRPO steps, {datetime.date.today()}, {jax.devices()[0].device_kind}, JAX "
              f"{jax.__version__}: {args.preset} random weights, {args.format} + LoRA r{args.rank}"
              f", {args.prompts} prompt(s) x G={args.group}, prompt {args.prompt}, completion "
              f"{args.completion}, micro-batch {args.micro_batch}, remat on. Command: python "
              f"benchmarks/grpo_step.py --preset {args.preset} --format {args.format} "
              f"--steps {args.steps}")
    lines = [header, "", "| step | rollout s | train s | generated tok/s | completion length |"
             " peak GiB |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['step']} | {row['rollout_s']:.2f} | {row['train_s']:.2f} | "
                     f"{row['generated_tokens_per_s']:.0f} | {row['completion_length']:.0f} | "
                     f"{row['peak_GiB']:.1f} |")
    table = "\n".join(lines)
    print(table, flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = f"grpo_{args.preset}_{args.format}"
    with open(os.path.join(args.out, name + ".md"), "w") as handle:
        handle.write(table + "\n")
    with open(os.path.join(args.out, name + ".json"), "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
