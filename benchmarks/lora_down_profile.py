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
  pallas_c16  a Pallas kernel over A^T [r, K] (made once, outside the product): one program per
              16 columns of A reads all of K (no split-K, so no reduction kernel); _b256 / _s4
              variants: K step 256 instead of 512 / 4 pipeline stages instead of 3; _a: the
              same kernel reading A [K, r] as it is (32-byte rows of 16 columns)

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
VARIANTS = ("dot", "dot_f32", "mul_reduce", "pallas_c16", "pallas_c16_b256", "pallas_c16_s4",
            "pallas_c16_a")
# Pallas variants: (columns per program, K step, pipeline stages, A transposed).
PALLAS_VARIANTS = {"pallas_c16": (16, 512, 3, True), "pallas_c16_b256": (16, 256, 3, True),
                   "pallas_c16_s4": (16, 512, 4, True), "pallas_c16_a": (16, 512, 3, False)}


def pallas_columns_product(x, a_t, *, block_cols: int, block_k: int, num_stages: int,
                           interpret: bool, transposed: bool = True):
    """x [M <= 16, K] @ A where a_t = A^T [r, K] (transposed, else A [K, r] itself): bf16
    [M, r], one program per block_cols columns, each looping over all of K (float32
    accumulation)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    m, k = x.shape
    r = a_t.shape[0] if transposed else a_t.shape[1]
    block_k = min(block_k, k)
    if m > 16 or k % block_k or r % block_cols:
        raise ValueError(f"pallas_columns_product: M={m} > 16, K={k} or r={r} not tiled")

    def kernel(x_ref, a_ref, o_ref):
        c0 = pl.multiple_of(pl.program_id(0) * block_cols, block_cols)
        rows = lax.broadcasted_iota(jnp.int32, (16, block_k), 0) < m

        def body(t, acc):
            k0 = pl.multiple_of(t * block_k, block_k)
            xs = plgpu.load(x_ref.at[pl.ds(0, 16), pl.ds(k0, block_k)], mask=rows, other=0.0)
            if transposed:
                a_tile = a_ref[pl.ds(c0, block_cols), pl.ds(k0, block_k)]
                return acc + lax.dot_general(xs, a_tile, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32)
            a_tile = a_ref[pl.ds(k0, block_k), pl.ds(c0, block_cols)]
            return acc + lax.dot_general(xs, a_tile, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, k // block_k, body, jnp.zeros((16, block_cols), jnp.float32))
        out_rows = lax.broadcasted_iota(jnp.int32, (16, block_cols), 0) < m
        plgpu.store(o_ref.at[pl.ds(0, 16), pl.ds(c0, block_cols)], acc.astype(o_ref.dtype),
                    mask=out_rows)

    params = None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, r), jnp.bfloat16),
                          grid=(r // block_cols,), interpret=interpret,
                          compiler_params=params, name="lora_down_columns")(x, a_t)


def variant_fn(name: str, interpret: bool = False):
    import functools

    import jax.numpy as jnp

    if name in PALLAS_VARIANTS:
        block_cols, block_k, stages, transposed = PALLAS_VARIANTS[name]
        return functools.partial(pallas_columns_product, block_cols=block_cols,
                                 block_k=block_k, num_stages=stages, interpret=interpret,
                                 transposed=transposed)

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
                one = variant_fn(variant, interpret=jax.default_backend() != "gpu")
                operands = copies
                if variant in PALLAS_VARIANTS and PALLAS_VARIANTS[variant][3]:
                    # A^T, made once like the stacked A
                    operands = [jnp.asarray(a.T) for a in copies]
                fn = jax.jit(lambda x, copies, one=one: [one(x, a) for a in copies])
                got = np.asarray(fn(x, operands)[0], np.float64)
                error = float(np.abs(got - reference).max() / np.abs(reference).max())
                _, call_us, _ = traced_device_us(fn, (x, operands), args.repeats, count, None)
                del operands
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
