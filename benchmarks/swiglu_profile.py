"""Device time of a SwiGLU MLP's gate|up at decode M: the grouped launch then XLA's SwiGLU (what
the model runs with config.quant.gate_up_pairs=False), against ONE launch over gate and up
interleaved into one weight (blockwise_matmul.interleave_gate_up: blocks of block_n / 2 rows of
each) whose epilogue splits each tile and applies the SwiGLU (blockwise_matmul_swiglu, what the
model runs by default since session 13),
and the same launch without the epilogue (the product alone), from a profiler trace (as
kernel_profile.py: R copies of the weights overflow the L2 twice, so every call streams its
weights from HBM).

Each row is the device time of everything one call launches, with an unmerged rank-r LoRA on
gate and up, as in the model's rollout; the SwiGLU rows give their largest difference from the
grouped launch's (one bf16 ulp is expected).

    python benchmarks/swiglu_profile.py --models 7b,32b --out $OUT
    python benchmarks/swiglu_profile.py --smoke --out /tmp/swiglu_profile   # CPU, interpret
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import _common as common
from kernel_profile import L2_DEFEAT_BYTES, traced_device_us, weight_bytes

# (I, H) of the gate and up weights [I, H] per model.
SHAPES = {"7b": (18944, 3584), "14b": (13824, 5120), "32b": (27648, 5120), "smoke": (80, 256)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="7b")
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.repeats = "smoke", 1
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    from pallas_kernels import blockwise_matmul as bw

    interpret = jax.default_backend() != "gpu"
    spec = kernel_bench.SPECS[args.format]
    rows = []
    started = time.perf_counter()
    key = jax.random.key(0)
    for model in common.split_list(args.models):
        if model not in SHAPES:
            raise SystemExit(f"unknown model {model!r}; known: {sorted(SHAPES)}")
        inner, hidden = SHAPES[model]
        x = jax.random.normal(jax.random.fold_in(key, 1), (args.m, hidden), jnp.bfloat16)
        down = jax.random.normal(jax.random.fold_in(key, 2), (args.m, 2 * args.rank),
                                 jnp.bfloat16)
        lora_bs = tuple(0.01 * jax.random.normal(jax.random.fold_in(key, 3 + i),
                                                 (args.rank, inner), jnp.bfloat16)
                        for i in range(2))
        pair = tuple(kernel_bench.repack(args.format, kernel_bench.random_checkpoint(
            args.format, inner, hidden, jax.random.fold_in(key, 5 + i))) for i in range(2))
        nbytes = 2 * weight_bytes(args.format, inner, hidden)
        count = 1 if args.smoke else max(2, math.ceil(L2_DEFEAT_BYTES / nbytes))
        copies = kernel_bench.copies(pair, count)
        lora = dict(lora_down=down, lora_bs=lora_bs, lora_scales=(2.0, 2.0))

        def unfused(x, copies):
            outs = []
            for gate_up in copies:
                gate, up = bw.blockwise_matmul_group(x, gate_up, spec=spec, interpret=interpret,
                                                     **lora)
                outs.append((jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32))
                            .astype(jnp.bfloat16))
            return outs

        half_block = bw.default_matmul_config(args.m, pair[0]).block_n // 2
        interleaved = [bw.interleave_gate_up(*gate_up, half_block) for gate_up in copies]
        lora_b_pair = bw.interleave_lora_b(*lora_bs, pair[0].codes.shape[0], half_block)

        def fused(x, weights):
            return [bw.blockwise_matmul_swiglu(x, w, spec=spec, out_n=inner,
                                               half_block=half_block, interpret=interpret,
                                               lora_down=down, lora_ranks=(args.rank,) * 2,
                                               lora_b=lora_b_pair, lora_scale=2.0)
                    for w in weights]

        down_padded = bw.pad_lora_down(down, (args.rank,) * 2)  # the product-only launch's

        def product_only(x, weights):
            return [bw.blockwise_matmul(x, w, spec=spec, interpret=interpret,
                                        lora_down=down_padded, lora_b=lora_b_pair,
                                        lora_scale=2.0) for w in weights]

        variants = [("grouped + XLA SwiGLU", copies, jax.jit(unfused), True),
                    ("interleaved, SwiGLU epilogue", interleaved, jax.jit(fused), True),
                    ("interleaved, product only (no SwiGLU)", interleaved,
                     jax.jit(product_only), False)]
        reference = None
        for label, operands, fn, compare in variants:
            row = {"model": model, "variant": label, "copies": count}
            try:
                y = fn(x, operands)[0].astype(jnp.float32)
                if reference is None:
                    reference = y
                if compare:
                    row["max_abs_diff_vs_unfused"] = float(jnp.max(jnp.abs(y - reference)))
                    row["max_abs_unfused"] = float(jnp.max(jnp.abs(reference)))
                _, row["call_us"], _ = traced_device_us(fn, (x, operands), args.repeats,
                                                        count, None)
                row["TB_s"] = nbytes / row["call_us"] / 1e6
            except Exception as error:  # record, go on
                row["error"] = common.describe_error(error)
            rows.append(row)
            print(row, flush=True)
        del interleaved
        del copies
    elapsed = time.perf_counter() - started
    header = common.header_line(
        f"gate|up + SwiGLU device us per call ({args.format}, M={args.m}, LoRA r{args.rank} on "
        f"gate and up, jax.profiler trace, {args.repeats} runs of R copies > "
        f"{L2_DEFEAT_BYTES >> 20} MiB; {elapsed:.0f} s)", [common.device_info()])
    lines = [header, "", "| model | variant | us per call | TB/s | max abs diff vs unfused "
             "(max abs) |", "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['variant']} | error: {row['error'][:120]} "
                         "| | |")
            continue
        diff = (f"{row['max_abs_diff_vs_unfused']:.3g} ({row['max_abs_unfused']:.3g})"
                if "max_abs_diff_vs_unfused" in row else "-")
        lines.append(f"| {row['model']} | {row['variant']} | {row['call_us']:.2f} | "
                     f"{row['TB_s']:.2f} | {diff} |")
    text = "\n".join(lines)
    print(text, flush=True)
    common.write_outputs(args.out, f"swiglu_profile_{args.format}_m{args.m}", text,
                         {"argv": sys.argv, "rows": rows, "jax": jax.__version__,
                          **common.device_info()})


if __name__ == "__main__":
    main()
