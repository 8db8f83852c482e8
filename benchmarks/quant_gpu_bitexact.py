"""GPU vs CPU quantizers, bit for bit: each format's codes and scales computed under jit on the
default device (the GPU) must equal those computed on the CPU backend of the same process.

Inputs (seeded): Gaussian and Student-t weights in float32 and bfloat16, plus blocks that are
all zero, huge (1e30), tiny (1e-30, below the fp8 subnormal range after scaling) and exact E2M1
ties. Prints a table and writes it under --out.

    python benchmarks/quant_gpu_bitexact.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant.formats import get_format


def weights(seed: int, dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (256, 512)
    gaussian = rng.normal(0, 0.02, shape).astype(np.float32)
    student = (rng.standard_t(3, shape) * 0.02).astype(np.float32)
    special = rng.normal(0, 1, shape).astype(np.float32)
    special[0, :64] = 0.0                                   # all-zero blocks
    special[1, :64] *= 1e30                                 # huge blocks
    special[2, :64] *= 1e-30                                # tiny blocks
    levels = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    special[3, :] = np.resize(np.concatenate([levels, -levels, [6.0]]), 512)  # E2M1 ties
    out = {"gaussian": gaussian, "student_t3": student, "special_blocks": special}
    return {name: np.asarray(jnp.asarray(w, dtype)) for name, w in out.items()}


def quantize_on(device, fmt, weight):
    with jax.default_device(device):
        array = jax.device_put(weight, device)
        quantized = jax.jit(lambda w: fmt.quantize(w, check_finite=False))(array)
        return jax.tree_util.tree_map(
            lambda leaf: np.atleast_1d(np.asarray(jax.device_get(leaf))), quantized)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    accelerator = jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, weight in weights(0, dtype).items():
            for format_name in ("nvfp4", "mxfp4", "nf4"):
                fmt = get_format(format_name)
                on_accelerator = quantize_on(accelerator, fmt, weight)
                on_cpu = quantize_on(cpu, fmt, weight)
                leaves_a = jax.tree_util.tree_leaves(on_accelerator)
                leaves_c = jax.tree_util.tree_leaves(on_cpu)
                identical = len(leaves_a) == len(leaves_c) and all(
                    a.dtype == c.dtype and a.shape == c.shape
                    and np.array_equal(a.view(np.uint8), c.view(np.uint8))
                    for a, c in zip(leaves_a, leaves_c))
                mismatched = sum(int((a.view(np.uint8) != c.view(np.uint8)).sum())
                                 for a, c in zip(leaves_a, leaves_c) if a.shape == c.shape)
                rows.append({"dtype": jnp.dtype(dtype).name, "weights": name,
                             "format": format_name, "bit_identical": identical,
                             "mismatched_bytes": mismatched})
                print(json.dumps(rows[-1]), flush=True)
    header = (f"GPU vs CPU quantizer bit-exactness, {datetime.date.today()}, "
              f"{accelerator.device_kind} vs CPU backend, JAX {jax.__version__}. Command: "
              "python benchmarks/quant_gpu_bitexact.py")
    lines = [header, "", "| input dtype | weights | format | bit-identical | mismatched bytes |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['weights']} | {r['format']} | {r['bit_identical']} | "
              f"{r['mismatched_bytes']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_gpu_bitexact.md"), "w") as handle:
        handle.write(table + "\n")


if __name__ == "__main__":
    main()
