"""What does the Mosaic GPU path's single copy cost the kernels that read the kernel layout? (GPU)

On the Mosaic GPU path (the default on Hopper since session 26; QERL_MOSAIC_NVFP4=0 turns it
off), with QERL_MOSAIC_SINGLE_COPY (its default), an NVFP4 weight is stored only in the Mosaic
GPU kernel's permuted layout. Prefill and the training passes (M > 64: a Pallas dequantize
kernel, then one XLA dot) read it with pallas_kernels.permuted_dequantize (since session 25);
with QERL_MOSAIC_PERMUTED_DEQUANTIZE=0 they first rebuild the kernel layout with
pallas_kernels.mgpu_nvfp4.kernel_layout_from_permuted, inside their jit. Per weight shape
(the 7B / 14B launch shapes; a gate|up pair as one weight of 2 N rows) this times, wall clock
per call (median, kernels.median_time):
- "unpermute": kernel_layout_from_permuted (a broadcast-shift-transpose fusion);
- "dequantize": the Pallas dequantize kernel on the kernel layout (what the two-copy layout
  runs), bf16 W [N, K];
- "unpermute + dequantize": both in one jit (what the single copy runs);
- "XLA dequantize": bf16 W straight from the permuted buffer in jnp
  (mgpu_nvfp4.permuted_dequantize_reference; xla_dequantize_equal: bit for bit the Pallas
  kernel's W);
- "permuted dequantize": the Triton kernel that decodes the permuted tiles directly
  (pallas_kernels.permuted_dequantize; permuted_dequantize_equal: bit for bit the Pallas
  kernel's W; session 25 call f also timed a scattered-store variant, since removed);
and the 4-bit buffer's bytes read + written per second for the unpermute.
Session 24 also timed a static gather and session 25 a "planes first" unpermute (10-20% under
the unpermute; RESULTS.md): removed, the kernel replaces both.

    python benchmarks/unpermute_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import time

import _common as common

SHAPES = {"7b": {"q": (3584, 3584), "gate|up": (2 * 18944, 3584), "down": (3584, 18944)},
          "14b": {"q|k|v": (7168, 5120), "gate|up": (2 * 13824, 5120), "down": (5120, 13824)},
          "tiny": {"w": (256, 512)}}  # a CPU smoke run (Pallas interpreted)


def measure(size: str, name: str, n: int, k: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from kernels import median_time
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels.nvfp4_matmul import NVFP4
    from pallas_kernels.permuted_dequantize import permuted_dequantize
    lines = n // 64 * (-(-k // 256)) * mg.TILE_LINES
    bits = jax.random.bits(jax.random.key(0), (lines, 128), jnp.uint8)
    scale_codes = jnp.full((lines // mg.TILE_LINES, 8, 128), 0x38, jnp.uint8)  # scale 1.0
    buffer = bits.reshape(-1, mg.TILE_LINES, 128).at[:, 64:].set(scale_codes).reshape(lines, 128)

    def unpermute(b):
        return mg.kernel_layout_from_permuted(b, rows=n, k=k)

    def dequantize(codes, scales):
        packed = bw.PackedWeight(codes=codes, scales=scales,
                                 tensor_scale=jnp.ones((1,), jnp.float32), fmt="nvfp4", n=n,
                                 k=k, tile_k=256)
        return bw.blockwise_dequantize(packed, spec=NVFP4,
                                       interpret=jax.default_backend() != "gpu")

    fast = jax.jit(unpermute)
    codes, scales = fast(buffer)
    both = jax.jit(lambda b: dequantize(*unpermute(b)))
    reference = both(buffer)
    direct = jax.jit(lambda b: mg.permuted_dequantize_reference(b, jnp.float32(1), n=n, k=k).astype(
        jnp.bfloat16))
    kernel = jax.jit(lambda b: permuted_dequantize(b, jnp.float32(1), n=n, k=k,
                                                   interpret=jax.default_backend() != "gpu"))
    seconds = {
        "unpermute": median_time(fast, (buffer,), repeats),
        "dequantize": median_time(jax.jit(dequantize), (codes, scales), repeats),
        "unpermute + dequantize": median_time(both, (buffer,), repeats),
        "XLA dequantize": median_time(direct, (buffer,), repeats),
    }
    seconds["permuted dequantize"] = median_time(kernel, (buffer,), repeats)
    row = dict(size=size, weight=name, n=n, k=k, buffer_MiB=buffer.size / 2**20,
               xla_dequantize_equal=bool(jnp.array_equal(direct(buffer), reference)),
               permuted_dequantize_equal=bool(jnp.array_equal(kernel(buffer), reference)))
    for label, value in seconds.items():
        row[f"{label} us"] = 1e6 * value
    row["unpermute GB/s"] = 2 * buffer.size / seconds["unpermute"] / 1e9  # read + written
    row["permuted dequantize GB/s"] = (  # 4-bit read + bf16 written
        (buffer.size + 2 * n * k) / seconds["permuted dequantize"] / 1e9)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="7b,14b")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=".")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke run: --sizes tiny --repeats 1 (Pallas interpreted)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.repeats = "tiny", 1
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(SHAPES))
    if unknown:
        parser.error(f"--sizes: {unknown} not in {sorted(SHAPES)}")
    import jax
    begin = time.perf_counter()
    meta = {**common.device_info(), "jax": jax.__version__}
    rows = [measure(size, name, n, k, args.repeats)
            for size in sizes for name, (n, k) in SHAPES[size].items()]
    columns = [(key, key) for key in rows[0]]
    text = common.header_line(f"Unpermuting the single copy, {time.perf_counter() - begin:.0f} s",
                              [meta]) + "\n\n" + common.markdown_table(rows, columns)
    print(text, flush=True)
    common.write_outputs(args.out, "unpermute_check", text, {"rows": rows, **meta})
    return 0 if all(row["xla_dequantize_equal"] and row["permuted_dequantize_equal"]
                     for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
