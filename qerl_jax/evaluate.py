"""Evaluation CLI: pass@1 on GSM8K / MATH-500 jsonl for a base model plus a LoRA checkpoint.

    python -m qerl_jax.evaluate --base /path/to/Qwen2.5-7B-Instruct --format nvfp4 \\
        --data ../shared/data/gsm8k/test.jsonl --task gsm8k [--peft DIR | --run WORKDIR] \\
        [--temperature 0.6 --top_p 0.95 --n 4] --max_new_tokens 4096 --out results.json

Greedy by default (--temperature 0); with a temperature, pass@1 is averaged over --n samples
per problem (the paper's protocol: 0.6 / 0.95 / 4096 tokens). Whole normalized answers are
compared (GSM8K: numeric normalization; MATH: math-verify), never first characters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import jax
import ml_collections
import numpy as np

from qerl_jax.data import encode_prompts, load_examples
from qerl_jax.data.prompts import build_prompt_text
from qerl_jax.lora import LoRAConfig, add_lora
from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.models.safetensors_io import SafetensorsFile
from qerl_jax.models.tokenizer import decode_completion, eos_token_ids, load_tokenizer
from qerl_jax.rewards.gsm8k import gsm8k_numeric_reward
from qerl_jax.rewards.math_answers import math_accuracy_reward
from qerl_jax.sampling import SamplingConfig, generate

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


def model_from_run(workdir: str):
    """The noise-free model of a training run's last checkpoint (config from run.json)."""
    from qerl_jax.trainer import Trainer
    with open(os.path.join(workdir, "run.json")) as handle:
        config = ml_collections.ConfigDict(json.load(handle)["config"])
    trainer = Trainer(config, workdir)
    if not trainer.restore_latest():
        raise FileNotFoundError(f"{workdir}: no checkpoint to evaluate")
    return trainer.model(), trainer.tokenizer


def correctness(task: str, completion: str, gold: str) -> float:
    if task == "gsm8k":
        return gsm8k_numeric_reward(completion, gold) / 2.0
    return math_accuracy_reward(completion, gold)


def evaluate(model, tokenizer, examples, *, task: str, sampling: SamplingConfig,
             max_prompt_length: int, batch_size: int, prompt_style: str, seed: int = 0) -> dict:
    scores = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        texts = [build_prompt_text(tokenizer, e.question, style=prompt_style) for e in chunk]
        prompts = encode_prompts(tokenizer, texts, max_prompt_length)
        rollout = jax.device_get(generate(model, prompts.tokens, prompts.mask,
                                          jax.random.fold_in(jax.random.key(seed), start),
                                          sampling))
        group = sampling.num_generations
        for row in range(rollout.tokens.shape[0]):
            text = decode_completion(tokenizer,
                                     rollout.tokens[row, :int(rollout.lengths[row])].tolist())
            scores.append(correctness(task, text, chunk[row // group].gold))
    per_problem = np.asarray(scores).reshape(len(examples), sampling.num_generations)
    return {"pass@1": float(per_problem.mean()), "problems": len(examples),
            "samples_per_problem": sampling.num_generations,
            "pass@1_std_over_samples": float(per_problem.mean(axis=0).std())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="HF checkpoint directory of the base model")
    parser.add_argument("--format", default="bf16", help="bf16 | nvfp4 | mxfp4 | nf4")
    parser.add_argument("--peft", help="PEFT LoRA adapter directory")
    parser.add_argument("--run", help="training workdir (evaluates its last checkpoint)")
    parser.add_argument("--data", required=True, help="GSM8K or MATH-500 jsonl")
    parser.add_argument("--task", choices=("gsm8k", "math"), required=True)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=1024)
    parser.add_argument("--max_prompt_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--prompt_style", default="paper")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the result JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if bool(args.base) == bool(args.run):
        parser.error("give exactly one of --base (with optional --peft) or --run")
    if args.run:
        model, tokenizer = model_from_run(args.run)
    else:
        tokenizer = load_tokenizer(args.base)
        if args.format == "bf16":
            model = load_hf_model(args.base, param_dtype="bfloat16")
        else:
            from qerl_jax.quant.model_quantization import load_quantized_hf_model
            model, _ = load_quantized_hf_model(args.base, args.format)
        if args.peft:
            load_peft_adapter(model, args.peft)
    greedy = args.temperature == 0.0
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=greedy,
                              temperature=1.0 if greedy else args.temperature, top_p=args.top_p,
                              num_generations=1 if greedy else args.n,
                              eos_token_ids=eos_token_ids(tokenizer, model.config.eos_token_id))
    examples = load_examples(args.task, args.data, limit=args.limit or None)
    result = evaluate(model, tokenizer, examples, task=args.task, sampling=sampling,
                      max_prompt_length=args.max_prompt_length, batch_size=args.batch_size,
                      prompt_style=args.prompt_style, seed=args.seed)
    result.update(vars(args))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
