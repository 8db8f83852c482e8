"""GPU smoke run of the model presets: random bf16 weights, a forward pass and cached decode.

For each preset: build the model on the device (random N(0, 0.02) weights, bf16), time a
full-sequence forward of [batch, prompt] tokens, a prefill into a static KV cache, and a few
one-token decode steps (cache donated), and record the device's peak memory. Prints a markdown
table and writes it (plus JSON) to --out.

    python benchmarks/model_smoke.py --presets qwen2p5_0p5b,qwen2p5_7b --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.models import decode_step, init_kv_cache, init_model, prefill, preset


def build_on_device(config, seed=0):
    # Eager init compiles one small program per distinct tensor shape; a single jit over the
    # whole constructor is one very large program to compile.
    return init_model(config, seed=seed)


def timed(fn, *args, repeats=5):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan"))


def run_preset(name, batch, prompt, decode_steps):
    config = preset(name, param_dtype="bfloat16", compute_dtype="bfloat16")
    start = time.perf_counter()
    model = build_on_device(config)
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - start
    tokens = jax.random.randint(jax.random.key(1), (batch, prompt), 0, config.vocab_size)
    mask = jnp.ones((batch, prompt), jnp.int32)

    forward = jax.jit(lambda m, t, a: m(t, a)[:, -1])
    forward_s, _ = timed(forward, model, tokens, mask)

    cache_len = prompt + decode_steps
    prefill_fn = jax.jit(prefill, donate_argnums=(3,))
    compile_start = time.perf_counter()
    logits, cache = prefill_fn(model, tokens, mask, init_kv_cache(config, batch, cache_len))
    jax.block_until_ready(logits)
    prefill_first_s = time.perf_counter() - compile_start
    prefill_s, _ = timed(lambda: prefill_fn(model, tokens, mask,
                                            init_kv_cache(config, batch, cache_len))[0])

    step = jax.jit(decode_step, donate_argnums=(2,))
    token = jnp.argmax(logits, axis=-1)
    logits, cache = step(model, token, cache)  # compile
    jax.block_until_ready(logits)
    step_times = []
    for _ in range(decode_steps - 1):
        token = jnp.argmax(logits, axis=-1)
        begin = time.perf_counter()
        logits, cache = step(model, token, cache)
        jax.block_until_ready(logits)
        step_times.append(time.perf_counter() - begin)
    finite = bool(jnp.isfinite(logits).all())
    return {
        "preset": name, "params_B": config.num_parameters() / 1e9, "batch": batch,
        "prompt": prompt, "init_s": init_s, "forward_ms": forward_s * 1e3,
        "prefill_first_call_s": prefill_first_s, "prefill_ms": prefill_s * 1e3,
        "decode_steps": len(step_times), "decode_ms_median": statistics.median(step_times) * 1e3,
        "decode_tokens_per_s": batch / statistics.median(step_times),
        "peak_GiB": peak_bytes() / 2**30, "logits_finite": finite,
    }


def markdown(rows, header):
    cols = ["preset", "params_B", "batch", "prompt", "forward_ms", "prefill_ms",
            "decode_ms_median", "decode_tokens_per_s", "peak_GiB", "logits_finite"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else
                                       str(row[c]) for c in cols) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", default="qwen2p5_0p5b,qwen2p5_7b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    rows = []
    for name in args.presets.split(","):
        rows.append(run_preset(name, args.batch, args.prompt, args.decode_steps))
        print(json.dumps(rows[-1]), flush=True)
        jax.clear_caches()
    device = jax.devices()[0]
    header = (f"Model smoke run, {datetime.date.today()}, {device.device_kind}, "
              f"JAX {jax.__version__}, command: python benchmarks/model_smoke.py "
              f"--presets {args.presets} --batch {args.batch} --prompt {args.prompt} "
              f"--decode-steps {args.decode_steps}")
    table = markdown(rows, header)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model_smoke.md"), "w") as handle:
        handle.write(table + "\n")
    with open(os.path.join(args.out, "model_smoke.json"), "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
