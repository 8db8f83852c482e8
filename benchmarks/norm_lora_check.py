"""The decode RMSNorm + LoRA x @ A kernel (pallas_kernels/rmsnorm_lora.py) on the GPU: outputs
against float64, and device time against what XLA runs for the same work.

For each shape (hidden H, stacked rank R: a layer's q|k|v adapters are 3 x 32, gate|up 2 x 32)
one jitted program applies the operation to `--copies` distinct inputs x and LoRA A matrices
(as the decode step's layers do, so A streams from HBM and not from L2) and is traced
(kernel_profile's method); the table gives the device time per application (here the rows'
sums of squares are a kernel of their own; in the model XLA may fuse them into the residual
add):

  xla      RMSNorm as the model's module computes it, then normed @ A in bf16 (XLA: a norm
           fusion, a split-K gemm and its reduction at decode M)
  pallas   the kernel (chunk = its columns per program) and the XLA sum of its shares

Check: normed within 2^-7 |ref| of float64 (one bf16 ulp; +1e-6), down within one bf16 ulp of the float64
product of the kernel's own normed output and the bf16 A (+1e-5 sum |normed| |A|): the bounds of
tests/pallas_kernels/test_rmsnorm_lora.py.

    python benchmarks/norm_lora_check.py --out $OUT
    python benchmarks/norm_lora_check.py --smoke --out /tmp/norm_lora   # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _common as common

SHAPES = {"32b q|k|v": (5120, 96), "32b gate|up": (5120, 64), "7b q|k|v": (3584, 96),
          "7b gate|up": (3584, 64), "smoke": (320, 24)}
EPS = 1e-6


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="32b q|k|v,32b gate|up,7b q|k|v,7b gate|up")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--chunks", default="64,128,256", help="comma list of kernel chunks")
    parser.add_argument("--copies", type=int, default=64, help="A matrices per program")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shape, CPU interpret mode")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.copies, args.repeats, args.chunks = "smoke", 2, 1, "128"
    unknown = set(common.split_list(args.shapes)) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
    return args


def check(x, scale, lora_a, normed, down) -> dict:
    """Largest errors relative to the bounds (<= 1 passes) and the pass flag."""
    import numpy as np
    x64 = np.asarray(x, np.float64)
    expected = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS) * np.asarray(
        scale, np.float64)[None, :]
    normed64 = np.asarray(normed, np.float64)
    norm_ratio = np.max(np.abs(normed64 - expected)
                        / (2.0 ** -7 * np.abs(expected) + 1e-6))
    a64 = np.asarray(lora_a.astype("bfloat16") if hasattr(lora_a, "astype") else lora_a,
                     np.float64)
    product = normed64 @ a64
    bound = 2.0 ** -8 * np.abs(product) + 1e-5 * (np.abs(normed64) @ np.abs(a64))
    down_ratio = np.max(np.abs(np.asarray(down, np.float64) - product) / bound)
    return {"normed_error_over_bound": float(norm_ratio),
            "down_error_over_bound": float(down_ratio),
            "passed": bool(norm_ratio <= 1.0 and down_ratio <= 1.0)}


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernel_profile
    from pallas_kernels.rmsnorm_lora import (RMSNormLoRAConfig, rmsnorm_lora_down,
                                             rmsnorm_lora_down_reference)

    interpret = args.smoke
    if not interpret and jax.default_backend() != "gpu":
        raise SystemExit("norm_lora_check.py times the compiled kernel: it needs a GPU "
                         "(or --smoke on the CPU)")
    key = jax.random.key(0)
    rows = []
    started = time.perf_counter()
    for name in common.split_list(args.shapes):
        h, r = SHAPES[name]
        xs = [(jax.random.normal(jax.random.fold_in(key, 1000 + i), (args.m, h), jnp.float32)
               * 4).astype(jnp.bfloat16) for i in range(args.copies)]
        scale = 1 + 0.2 * jax.random.normal(jax.random.fold_in(key, 2), (h,), jnp.float32)
        lora_as = [(jax.random.normal(jax.random.fold_in(key, 10 + i), (h, r), jnp.float32)
                    / h ** 0.5).astype(jnp.bfloat16) for i in range(args.copies)]
        variants = [("xla", None)] + [(f"pallas chunk {c}", int(c))
                                      for c in common.split_list(args.chunks)]
        for variant, chunk in variants:
            if chunk is None:
                fn = jax.jit(lambda xs, s, lora_as: [
                    rmsnorm_lora_down_reference(x, s, a, eps=EPS) for x, a in zip(xs, lora_as)])
            else:
                config = RMSNormLoRAConfig(chunk=chunk)
                fn = jax.jit(lambda xs, s, lora_as, config=config: [
                    rmsnorm_lora_down(x, s, a, eps=EPS, config=config, interpret=interpret)
                    for x, a in zip(xs, lora_as)])
            outputs = fn(xs, scale, lora_as)
            row = {"shape": name, "h": h, "r": r, "m": args.m, "variant": variant,
                   **check(xs[0], scale, lora_as[0], *outputs[0])}
            _, call_us, _ = kernel_profile.traced_device_us(
                fn, (xs, scale, lora_as), args.repeats, args.copies, None)
            row["device_us"] = call_us
            rows.append(row)
            print(row, flush=True)
    text = report(rows, args, time.perf_counter() - started)
    print(text, flush=True)
    common.write_outputs(args.out, f"norm_lora_check_m{args.m}", text,
                         {"argv": sys.argv, "rows": rows, "jax": jax.__version__,
                          **common.device_info()})
    if not all(row["passed"] for row in rows):
        raise SystemExit("norm_lora_check: an output is outside its bound (table above)")


def report(rows, args, elapsed) -> str:
    header = common.header_line(
        f"Decode RMSNorm + LoRA x @ A at M={args.m}, {args.copies} A matrices per program "
        f"(trace device time per application; {elapsed:.0f} s)", [common.device_info()])
    lines = [header, "", "| shape | H | R | variant | device us | normed err / bound | "
             "down err / bound | check |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['h']} | {r['r']} | {r['variant']} | "
                     f"{r['device_us']:.2f} | {r['normed_error_over_bound']:.2f} | "
                     f"{r['down_error_over_bound']:.2f} | "
                     f"{'pass' if r['passed'] else 'FAIL'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
