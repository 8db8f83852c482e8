"""Device time of the LoRA down product x @ A at decode M, written different ways, from a
profiler trace.

In the 7B NVFP4 batch-8 decode step the four x @ A products of a layer (q|k|v, o, gate|up,
down) cost ~16 us, more than the decode attention: XLA runs each as a split-K Triton gemm plus
a reduction kernel (RESULTS.md, sessions 7 and 11). This script times ways of writing the same
product, each in one jitted program over R copies of A (R large enough to overflow the L2 twice,
as a decode step's 28-64 layers do), and checks each against float64 numpy:

  dot         jnp.dot(x, A, preferred_element_type=bf16)  (the model's code)
  dot_f32     the same dot with a float32 result, cast to bf16 after
  mul_reduce  sum over K of x[:, :, None] * A[None] in float32 (an XLA reduction fusion)

    python benchmarks/lora_down_profile.py --models 7b,32b --out $OUT
    python benchmarks/lora_down_profile.py --smoke --out /tmp/lora_down_profile  # CPU
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import _common as common
from kernel_profile import L2_DEFEAT_BYTES, traced_device_us

# (name, K, r) of a layer's x @ A products (rank 32 per adapter; q|k|v and gate|up stacked).
SHAPES = {
    "7b": [("qkv", 3584, 96), ("o", 3584, 32), ("gate|up", 3584, 64), ("down", 18944, 32)],
    "14b": [("qkv", 5120, 96), ("o", 5120, 32), ("gate|up", 5120, 64), ("down", 13824, 32)],
    "32b": [("qkv", 5120, 96), ("o", 5120, 32), ("gate|up", 5120, 64), ("down", 27648, 32)],
    "smoke": [("a", 256, 32)],
}
VARIANTS = ("dot", "dot_f32", "mul_reduce")


def variant_fn(name: str):
    import jax.numpy as jnp

    def dot(x, a):
        return jnp.dot(x, a, preferred_element_type=jnp.bfloat16)

    def dot_f32(x, a):
        return jnp.dot(x, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def mul_reduce(x, a):
        products = x[:, :, None].astype(jnp.float32) * a[None].astype(jnp.float32)
        return jnp.sum(products, axis=1).astype(jnp.bfloat16)

    return {"dot": dot, "dot_f32": dot_f32, "mul_reduce": mul_reduce}[name]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="7b")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.repeats = "smoke", 1
    import jax
    import jax.numpy as jnp

    variants = common.split_list(args.variants)
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; "
                         f"known: {list(VARIANTS)}")
    rows = []
    started = time.perf_counter()
    key = jax.random.key(0)
    for model in common.split_list(args.models):
        if model not in SHAPES:
            raise SystemExit(f"unknown model {model!r}; known: {sorted(SHAPES)}")
        for name, k, r in SHAPES[model]:
            x = jax.random.normal(jax.random.fold_in(key, 1), (args.m, k), jnp.bfloat16)
            a0 = 0.02 * jax.random.normal(jax.random.fold_in(key, 2), (k, r), jnp.bfloat16)
            count = 1 if args.smoke else max(2, math.ceil(L2_DEFEAT_BYTES / (2 * k * r)))
            copies = [a0 + 0 * i for i in range(count)]  # distinct buffers, same values
            reference = np.asarray(x, np.float64) @ np.asarray(a0, np.float64)
            for variant in variants:
                one = variant_fn(variant)
                fn = jax.jit(lambda x, copies, one=one: [one(x, a) for a in copies])
                got = np.asarray(fn(x, copies)[0], np.float64)
                error = float(np.abs(got - reference).max() / np.abs(reference).max())
                _, call_us, _ = traced_device_us(fn, (x, copies), args.repeats, count, None)
                rows.append({"model": model, "shape": name, "k": k, "r": r, "variant": variant,
                             "copies": count, "call_us": call_us, "max_rel_err": error})
                print(rows[-1], flush=True)
            del copies
    elapsed = time.perf_counter() - started
    header = common.header_line(
        f"LoRA x @ A device us per call (M={args.m}, jax.profiler trace, {args.repeats} runs of "
        f"R copies of A > {L2_DEFEAT_BYTES >> 20} MiB; {elapsed:.0f} s)", [common.device_info()])
    lines = [header, "", "| model | shape | K x r | " + " | ".join(variants) + " | max rel err |",
             "|---|---|---|" + "---|" * (len(variants) + 1)]
    for model in common.split_list(args.models):
        for name, k, r in SHAPES[model]:
            cells = {row["variant"]: row for row in rows
                     if row["model"] == model and row["shape"] == name}
            lines.append(f"| {model} | {name} | {k} x {r} | "
                         + " | ".join(f"{cells[v]['call_us']:.2f}" for v in variants)
                         + f" | {max(c['max_rel_err'] for c in cells.values()):.1e} |")
    text = "\n".join(lines)
    print(text, flush=True)
    common.write_outputs(args.out, f"lora_down_profile_m{args.m}", text,
                         {"argv": sys.argv, "rows": rows, "jax": jax.__version__,
                          **common.device_info()})


if __name__ == "__main__":
    main()
