"""GPU check of the decode attention's LoRA shares (compiled Pallas, not interpret mode).

pallas_kernels.decode_attention with lora_a (the o-projection's LoRA A): the combine kernel
returns each query head's output row times that head's rows of A. For Qwen2.5-7B and -32B
attention shapes at batch 8 (and 7B at batch 64, one split: the XLA fallback), cache lengths
300 and 2000, rank 32: the shares against float64 products of the returned bf16 rows (tolerance
2^-20 of the largest |row| x |A| x D), their sum over heads against float64 x @ A, and the
output against the call without lora_a (bit for bit). Exit code 1 if a case fails.

    python benchmarks/decode_attention_lora_check.py --out $OUT
    python benchmarks/decode_attention_lora_check.py --interpret   # CPU dry run, small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.decode_attention import decode_attention  # noqa: E402

# (name, batch, kv heads, groups, head_dim, slots)
CASES = [("7b", 8, 4, 7, 128, 2304), ("32b", 8, 8, 5, 128, 2304), ("7b", 64, 4, 7, 128, 2304)]
SMALL = [("small", 3, 2, 3, 32, 96)]


def check(name, batch, kv_heads, groups, head_dim, slots, length, rank, interpret, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, kv_heads, groups, head_dim)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((batch, slots, kv_heads, head_dim)), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal((batch, slots, kv_heads, head_dim)), jnp.bfloat16)
    mask = jnp.asarray(rng.random((batch, slots)) < 0.95)
    lora_a = jnp.asarray(rng.standard_normal((kv_heads * groups * head_dim, rank)) * 0.05,
                         jnp.bfloat16)
    scale = head_dim ** -0.5
    plain = decode_attention(q, keys, values, mask, length, scale=scale, interpret=interpret)
    out, down = decode_attention(q, keys, values, mask, length, scale=scale, interpret=interpret,
                                 lora_a=lora_a)
    heads = kv_heads * groups
    rows = np.asarray(out, np.float64).reshape(batch, heads, head_dim)
    a = np.asarray(lora_a, np.float64).reshape(heads, head_dim, rank)
    exact = np.einsum("bhd,hdr->bhr", rows, a)
    bound = np.abs(rows).max() * np.abs(a).max() * head_dim
    got = np.asarray(down, np.float64).reshape(batch, heads, rank)
    share_error = float(np.abs(got - exact).max() / bound)
    sum_error = float(np.abs(got.sum(1) - exact.sum(1)).max() / (bound * heads))
    same_out = bool(np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32)))
    ok = same_out and share_error <= 2.0 ** -20 and sum_error <= 2.0 ** -20 and \
        bool(np.isfinite(got).all())
    return dict(case=name, batch=batch, kv_heads=kv_heads, groups=groups, head_dim=head_dim,
                slots=slots, length=length, rank=rank, share_error=share_error,
                sum_error=sum_error, output_unchanged=same_out, ok=ok)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the same as --interpret")
    args = parser.parse_args(argv)
    args.interpret = args.interpret or args.smoke
    rows = []
    for case in (SMALL if args.interpret else CASES):
        for length in ((40, 90) if args.interpret else (300, 2000)):
            row = check(*case, length=length, rank=32, interpret=args.interpret,
                        seed=len(rows))
            rows.append(row)
            print(row, flush=True)
    failures = sum(not row["ok"] for row in rows)
    print(f"decode attention LoRA check on {jax.devices()[0].device_kind}: "
          f"{len(rows) - failures} ok, {failures} failed", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_attention_lora_check.json"), "w") as handle:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "rows": rows, "failures": failures}, handle, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
