"""Device time of the decode attention (pallas_kernels/decode_attention.py) over a rollout's
cache lengths, from a profiler trace (not wall clock).

For each model's attention shape (batch B, kv heads, query heads per kv head, head dim 128), a
2304-slot cache (prompt 256 + 2048 new tokens, as benchmarks/rollout.py) and each cache length
in --lengths, one jitted program runs the kernel (and its combine) on R distinct copies of the
cache, R large enough that the copies overflow the L2 twice over, as the 28-64 layers' caches
do in a decode step. The table gives the device us per call (every kernel the call launches)
at each length and their mean: with lengths spread evenly over [256, 2304], the mean is the
attention's average cost per layer and decode step of a rollout. Each setting
(DecodeAttentionConfig fields, e.g. "balanced=0" or "splits=18") is checked against the float32
reference first.

    python benchmarks/profile/attention_profile.py --models 7b,32b --settings "base;balanced=0" --out $OUT
    python benchmarks/profile/attention_profile.py --smoke --out /tmp/attention_profile   # CPU, interpret
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

# run as a script from benchmarks/profile/: the shared helpers live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as harness  # noqa: E402
from kernel_profile import L2_DEFEAT_BYTES, traced_device_us  # noqa: E402

# (kv heads, query heads per kv head, head dim) of Qwen2.5 models.
SHAPES = {"7b": (4, 7, 128), "14b": (8, 5, 128), "32b": (8, 5, 128), "smoke": (2, 3, 16)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="7b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2304)
    parser.add_argument("--lengths", default="256,512,768,1024,1280,1536,1792,2048,2304")
    parser.add_argument("--settings", default="base;balanced=0",
                        help="';'-separated DecodeAttentionConfig settings ('base' = defaults)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.batch, args.slots, args.lengths, args.repeats = (
            "smoke", 2, 96, "17,96", 1)
    return args


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from pallas_kernels import decode_attention as da

    interpret = args.smoke
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    parsed = {s: ({} if s == "base" else da.parse_config(s)) for s in settings}
    lengths = [int(v) for v in harness.split_list(args.lengths)]
    if any(not 1 <= v <= args.slots for v in lengths):
        raise SystemExit(f"--lengths {lengths}: each must be in [1, --slots={args.slots}]")
    rows = []
    key = jax.random.key(0)
    started = time.perf_counter()
    for model in harness.split_list(args.models):
        if model not in SHAPES:
            raise SystemExit(f"unknown model {model!r}; known: {sorted(SHAPES)}")
        kv_heads, groups, head_dim = SHAPES[model]
        cache_shape = (args.batch, args.slots, kv_heads, head_dim)
        cache_bytes = 2 * 2 * math.prod(cache_shape)
        count = 1 if interpret else max(2, math.ceil(L2_DEFEAT_BYTES / cache_bytes))
        q = jax.random.normal(jax.random.fold_in(key, 1), (args.batch, kv_heads, groups,
                                                           head_dim), jnp.bfloat16)
        caches = [(jax.random.normal(jax.random.fold_in(key, 10 + i), cache_shape, jnp.bfloat16),
                   jax.random.normal(jax.random.fold_in(key, 500 + i), cache_shape,
                                     jnp.bfloat16)) for i in range(count)]
        mask = jnp.ones((args.batch, args.slots), bool)
        scale = head_dim ** -0.5
        for setting in settings:
            config = da.DecodeAttentionConfig(**parsed[setting])
            fn = jax.jit(lambda q, caches, length, config=config: [
                da.decode_attention(q, k, v, mask, length, scale=scale, config=config,
                                    interpret=interpret) for k, v in caches])
            row = {"model": model, "batch": args.batch, "slots": args.slots,
                   "setting": setting, "copies": count, "us": {}}
            try:
                for length in lengths:
                    length_arr = jnp.asarray(length, jnp.int32)
                    got = fn(q, caches, length_arr)[0].astype(jnp.float32)
                    visible = jnp.arange(args.slots)[None, :] < length
                    ref = da.decode_attention_reference(q, *caches[0], mask & visible,
                                                        scale=scale)
                    error = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                    row["max_rel_err"] = max(row.get("max_rel_err", 0.0), error)
                    _, call_us, _ = traced_device_us(fn, (q, caches, length_arr),
                                                     args.repeats, count, None)
                    row["us"][str(length)] = call_us
                row["mean_us"] = sum(row["us"].values()) / len(row["us"])
            except Exception as e:  # a setting Triton cannot compile: record, go on
                row["error"] = harness.describe_error(e)
            rows.append(row)
            print(row, flush=True)
        del caches
    elapsed = time.perf_counter() - started
    text = report(rows, lengths, args, elapsed)
    print(text, flush=True)
    harness.write_outputs(args.out, f"attention_profile_b{args.batch}", text,
                         {"argv": sys.argv, "rows": rows, "jax": jax.__version__,
                          **harness.device_info()})


def report(rows, lengths, args, elapsed) -> str:
    header = harness.header_line(
        f"Decode-attention device us per call (batch {args.batch}, {args.slots}-slot cache, "
        f"jax.profiler trace, {args.repeats} runs of R cache copies > {L2_DEFEAT_BYTES >> 20} "
        f"MiB; {elapsed:.0f} s)", [harness.device_info()])
    lines = [header, "",
             "| model | setting | " + " | ".join(f"len {v}" for v in lengths)
             + " | mean | max rel err |",
             "|---|---|" + "---|" * (len(lengths) + 2)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['setting']} | failed: "
                         f"{r['error'][:80].replace('|', '/')} |" + " |" * (len(lengths) + 1))
            continue
        lines.append(f"| {r['model']} | {r['setting']} | "
                     + " | ".join(f"{r['us'][str(v)]:.2f}" for v in lengths)
                     + f" | {r['mean_us']:.2f} | {r['max_rel_err']:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
