"""Where the Mosaic GPU kernel's compile time goes: XLA programs with N launches of
pallas_kernels.mgpu_nvfp4's matmul (identical shapes, as a model's layers make them), timed
separately for tracing, lowering to StableHLO and XLA's compile (which compiles the Mosaic GPU
custom calls), against the same program on the Triton fused kernel.

The sampler with QERL_MOSAIC_NVFP4=1 compiles 4-5x slower than without (sessions 21: 32B
179-204 s against 36-49 s); this tells whether the cost is per launch (every layer's kernel
compiled again) or per distinct kernel.

    python benchmarks/mgpu_compile_time.py --counts 1,8,32 --out $OUT   # GPU only
"""

from __future__ import annotations

import argparse
import sys
import time

import _common as common


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,8,32")
    parser.add_argument("--n", type=int, default=5120)
    parser.add_argument("--k", type=int, default=5120)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def timed_compile(fn, args) -> dict:
    import jax
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return {"trace_s": traced_at - start, "lower_s": lowered_at - traced_at,
            "compile_s": compiled_at - lowered_at,
            "first_run_s": time.perf_counter() - compiled_at}


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import nvfp4_matmul
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import kernels as kernel_bench
    import kernel_profile

    n, k, m, rank = args.n, args.k, args.m, 32
    ckpt = kernel_bench.random_checkpoint("nvfp4", n, k, jax.random.key(1))
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    x, down, lora_b = kernel_profile.layer_inputs(jax.random.key(2), m, n, k, rank)
    permuted = mg.permute_packed(packed)
    operand = mg.lora_operand(lora_b, packed.tensor_scale, 2.0, n_pad=packed.codes.shape[0])
    config = bw.default_matmul_config(m, packed)
    rows = []
    for count in map(int, args.counts.split(",")):
        def mosaic(x, p, d, o, count=count):
            for _ in range(count):  # each launch reads the previous output: no CSE
                y = mg.mgpu_nvfp4_matmul(x, p, packed.tensor_scale, n=n, k=k, lora_down=d,
                                         lora_bt=o)
                x = y.astype(jnp.bfloat16)
            return x

        def triton(x, p, d, b, count=count):
            for _ in range(count):
                y = bw.blockwise_matmul(x, p, spec=nvfp4_matmul.NVFP4, config=config,
                                        lora_down=d, lora_b=b, lora_scale=2.0)
                x = y.astype(jnp.bfloat16)
            return x

        for name, fn, fn_args in (("Mosaic GPU", mosaic, (x, permuted, down, operand)),
                                  ("Triton fused", triton, (x, packed, down, lora_b))):
            row = {"kernel": name, "launches": count, **timed_compile(fn, fn_args)}
            row["compile_per_launch_s"] = row["compile_s"] / count
            rows.append(row)
            print(row, flush=True)
    meta = {**common.device_info(), "jax": jax.__version__}
    text = common.header_line(f"Compile time of N kernel launches, N={n}, K={k}, M={m}",
                              [meta]) + "\n\n" + common.markdown_table(rows, [
        ("kernel", "kernel"), ("launches", "launches"), ("trace_s", "trace s"),
        ("lower_s", "lower s"), ("compile_s", "XLA compile s"),
        ("compile_per_launch_s", "compile s per launch"), ("first_run_s", "first run s")])
    print(text, flush=True)
    common.write_outputs(args.out, "mgpu_compile_time", text,
                         {"argv": sys.argv, "rows": rows, **meta})


if __name__ == "__main__":
    main()
