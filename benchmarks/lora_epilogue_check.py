"""GPU check of the fused kernels' LoRA epilogue (compiled Pallas, not interpret mode).

For NVFP4, MXFP4 and NF4 weights of Qwen2.5-7B layer shapes, M in {1, 8, 64} and LoRA ranks 8
and 32: `linear(x, W, b, lora=LoRAProduct(A, B, 2))` on the kernel-layout weight (fused kernel
with (x @ A) @ B in its epilogue) against the same on the checkpoint-layout weight (XLA
dequantize + dot, LoRA as separate dots): output, dx, dA and dB within 2^-5 * max|reference|
(tests/quant/test_kernel_dispatch.py's tolerance for this comparison). Exit code 1 if any case
fails, so a job script can fall back to --no-lora-epilogue.

    python benchmarks/lora_epilogue_check.py --out $OUT
    python benchmarks/lora_epilogue_check.py --quick --out $OUT   # a 16-case subset
    python benchmarks/lora_epilogue_check.py --interpret      # CPU dry run, small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as common  # noqa: E402
from qerl_jax.quant.formats import get_format  # noqa: E402
from qerl_jax.quant.kernel_dispatch import register_kernels, to_kernel_layout  # noqa: E402
from qerl_jax.quant.linear_op import LoRAProduct, linear  # noqa: E402

SHAPES = [("q/o", 3584, 3584), ("k/v", 512, 3584), ("gate/up", 18944, 3584),
          ("down", 3584, 18944)]
TOLERANCE = 2.0 ** -5


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.abs(actual - expected).max() / (np.abs(expected).max() or 1.0))


def check_case(format_name, n, k, m, rank, seed):
    rng = np.random.default_rng(seed)
    dense = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    quantized = get_format(format_name).quantize(dense, name="check.proj")
    prepared = to_kernel_layout(quantized)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32)
    a = jnp.asarray(rng.standard_normal((k, rank)) * 0.05, jnp.float32)
    b = jnp.asarray(rng.standard_normal((rank, n)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)

    @jax.jit
    def forward_and_grads(x, a, b, weight):
        y, vjp = jax.vjp(lambda x, a, b: linear(x, weight, bias, compute_dtype=jnp.bfloat16,
                                                lora=LoRAProduct(a, b, 2.0)), x, a, b)
        return (y, *vjp(dy))

    kernel = forward_and_grads(x, a, b, prepared)
    reference = forward_and_grads(x, a, b, quantized)
    lowered = str(jax.make_jaxpr(lambda x: linear(x, prepared, bias, compute_dtype=jnp.bfloat16,
                                                  lora=LoRAProduct(a, b, 2.0)))(x))
    errors = {label: relative_error(got, want)
              for label, got, want in zip(("y", "dx", "dA", "dB"), kernel, reference)}
    return errors, f"{format_name}_matmul_lora" in lowered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="q/o and down shapes, M in {1, 8}, rank 32 (and 8 for NVFP4)")
    args = parser.parse_args(argv)
    tuning = common.apply_decode_tuning_from_env()  # $QERL_DECODE_TUNING: the kernels checked
    platform = jax.default_backend()
    register_kernels(platform, interpret=args.interpret)
    shapes = [("small", 200, 320)] if args.interpret else SHAPES
    if args.quick and not args.interpret:
        shapes = [shape for shape in SHAPES if shape[0] in ("q/o", "down")]
    rows, failures = [], 0
    for format_name in ("nvfp4", "mxfp4", "nf4"):
        for layer, n, k in shapes:
            for m in ((1, 8) if args.quick else (1, 8, 64)):
                for rank in ((8, 32) if format_name == "nvfp4" or not args.quick else (32,)):
                    try:
                        seed = zlib.crc32(f"{format_name}/{n}/{k}/{m}/{rank}".encode())
                        errors, in_kernel = check_case(format_name, n, k, m, rank, seed)
                        ok = in_kernel and all(e <= TOLERANCE for e in errors.values())
                    except Exception as error:  # noqa: BLE001 - report, count, go on
                        errors, in_kernel, ok = {"error": repr(error)[:300]}, False, False
                    failures += not ok
                    row = dict(format=format_name, layer=layer, n=n, k=k, m=m, rank=rank,
                               epilogue_kernel=in_kernel, ok=ok, **errors)
                    rows.append(row)
                    print(row, flush=True)
    print(f"LoRA epilogue check on {jax.devices()[0].device_kind}: {len(rows) - failures} ok, "
          f"{failures} failed (tolerance {TOLERANCE} * max|reference|)"
          + (f"; decode tuning {tuning}" if tuning else ""), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lora_epilogue_check.json"), "w") as handle:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "decode_tuning": tuning, "rows": rows, "failures": failures}, handle,
                      indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
