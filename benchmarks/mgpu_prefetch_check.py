"""Does prefetching the next launch's weights into L2 shorten a decode layer? (GPU only)

The sampler's decode step runs four 4-bit launches per layer with small XLA kernels between
them (norms, residual adds, the LoRA x @ A products, the SwiGLU): ~37 us per 14B layer in which
HBM is mostly idle (RESULTS.md, session 22). pallas_kernels.mgpu_nvfp4's `l2_prefetch` makes
every program of one launch, after its own K loop, prefetch part of the next launch's weights
into L2 (a hint; the results do not change).

Two measurements, M = 8, LoRA r32, the 14B launch shapes (--size):
- warm / cold: device time per call of the Mosaic GPU kernel alone on one weight called
  repeatedly (what fits of it stays in L2) against rotating copies (weights from HBM, as in
  mgpu_matmul_check.py --profile): the most that L2 hits can give a launch.
- pairs: launch 1, the XLA work the decoder runs between the two (an RMSNorm, or the SwiGLU,
  and the LoRA x @ A of launch 2), launch 2, then the XLA work back to launch 1's input; chained
  over copies of both weights so every rep streams them from HBM. Launch 1 prefetches per
  variant: nothing; the first 1-3 K tiles of each of launch 2's programs (`ahead`); or launch
  2's first 8 / 16 / 32 MB. Reported: device time per rep (all events; the trace) and wall time
  per rep, and launch 2's output against the no-prefetch variant's (must be bit-identical).

    python benchmarks/mgpu_prefetch_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import _common as common
import decode_profile
import kernel_profile

SHAPES = {  # launch name -> (N, K) of the weight
    "14b": {"q|k|v": (7168, 5120), "o": (5120, 5120), "gate|up": (27648, 5120),
            "down": (5120, 13824)},
    "32b": {"q|k|v": (7168, 5120), "o": (5120, 5120), "gate|up": (55296, 5120),
            "down": (5120, 27648)},
}
PAIRS = [("o", "gate|up", "norm"), ("gate|up", "down", "swiglu"), ("down", "q|k|v", "norm"),
         ("q|k|v", "o", "slice")]
MB_LINES = (1 << 20) // 128
VARIANTS = [("none", None), ("ahead 1", dict(ahead=1)), ("ahead 2", dict(ahead=2)),
            ("ahead 3", dict(ahead=3)), ("first 8 MB", dict(contiguous_lines=8 * MB_LINES)),
            ("first 16 MB", dict(contiguous_lines=16 * MB_LINES)),
            ("first 32 MB", dict(contiguous_lines=32 * MB_LINES))]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="14b", choices=sorted(SHAPES))
    parser.add_argument("--pairs", default="all",
                        help="comma-separated indices into PAIRS (0-3), or all")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def _permuted(key, n, k, count):
    """`count` copies of a random NVFP4 weight's permuted buffer and its tensor scale."""
    import jax
    from pallas_kernels import mgpu_nvfp4 as mg
    from pallas_kernels import nvfp4_matmul
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    packed = nvfp4_matmul.repack_nvfp4(*kernel_bench.random_checkpoint("nvfp4", n, k, key))
    first = jax.block_until_ready(mg.permute_packed(packed))
    return [first] + [first.copy() for _ in range(count - 1)], packed.tensor_scale


def _wall_us(fn, args, calls, runs=10):
    """Median wall time per chained rep (host launch overhead included: call a found it
    larger than the device time, so RESULTS.md reads the device column)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    return kernel_bench.median_time(fn, args, runs) / calls * 1e6


def _traced(fn, args, repeats, calls):
    """(all device us per call, {event name: us per call} of the 6 largest)."""
    import jax
    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="prefetch_")
    with jax.profiler.trace(trace_dir):
        for _ in range(repeats):
            jax.block_until_ready(fn(*args))
    events, _ = decode_profile.device_events(trace_dir)
    per_name: dict[str, float] = {}
    for name, duration in events:
        per_name[name] = per_name.get(name, 0.0) + duration / (calls * repeats)
    top = dict(sorted(per_name.items(), key=lambda kv: -kv[1])[:6])
    return sum(per_name.values()), {name[:60]: round(us, 2) for name, us in top.items()}


def warm_cold_rows(key, shapes, m, repeats):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import mgpu_nvfp4 as mg
    rows = []
    for i, (name, (n, k)) in enumerate(shapes.items()):
        nbytes = kernel_profile.weight_bytes("nvfp4", n, k)
        count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
        weights, ts = _permuted(jax.random.fold_in(key, i), n, k, count)
        x = jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.bfloat16)
        down = jax.random.normal(jax.random.fold_in(key, 200 + i), (m, 32), jnp.bfloat16)
        bt = 0.01 * jax.random.normal(jax.random.fold_in(key, 300 + i),
                                      (weights[0].shape[0] // (72 * -(-k // 256)) * 64, 32),
                                      jnp.bfloat16)
        for label, ws in (("cold (copies)", weights), ("warm (one weight)", [weights[0]] * count)):
            fn = jax.jit(lambda x, ws, d, bt: [mg.matmul_unscaled(x, w, n=n, k=k, lora_down=d,
                                                                  lora_bt=bt) for w in ws])
            total, _ = _traced(fn, (x, ws, down, bt), repeats, count)
            rows.append({"launch": name, "n": n, "k": k, "weights": label,
                         "call_us": round(total, 2), "TB_s": round(nbytes / total / 1e6, 3)})
            print(rows[-1], flush=True)
        del weights
    return rows


def _between(kind, y, k_next):
    """The decoder's XLA work after a launch: y float32 [M, N] -> bf16 [M, k_next]."""
    import jax.numpy as jnp
    if kind == "swiglu":
        gate, up = y[:, :k_next], y[:, k_next:2 * k_next]
        h = gate / (1.0 + jnp.exp(-gate)) * up
    else:
        reps = -(-k_next // y.shape[1])
        h = jnp.tile(y, (1, reps))[:, :k_next] if reps > 1 else y[:, :k_next]
        if kind == "norm":
            h = h * jnp.reciprocal(jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6))
    return h.astype(jnp.bfloat16)


def pair_rows(key, shapes, pair, m, repeats):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import mgpu_nvfp4 as mg
    first, second, kind = pair
    (n1, k1), (n2, k2) = shapes[first], shapes[second]
    nbytes = sum(kernel_profile.weight_bytes("nvfp4", n, k) for n, k in ((n1, k1), (n2, k2)))
    count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
    w1, _ = _permuted(jax.random.fold_in(key, 1), n1, k1, count)
    w2, _ = _permuted(jax.random.fold_in(key, 2), n2, k2, count)
    a1 = 0.05 * jax.random.normal(jax.random.fold_in(key, 3), (k1, 32), jnp.bfloat16)
    a2 = 0.05 * jax.random.normal(jax.random.fold_in(key, 4), (k2, 32), jnp.bfloat16)

    def operand(w, k, salt):
        rows = w.shape[0] // (72 * -(-k // 256)) * 64
        return 0.01 * jax.random.normal(jax.random.fold_in(key, salt), (rows, 32), jnp.bfloat16)

    bt1, bt2 = operand(w1[0], k1, 5), operand(w2[0], k2, 6)
    x = jax.random.normal(jax.random.fold_in(key, 7), (m, k1), jnp.bfloat16)
    back = "norm" if kind != "norm" else "slice"
    rows, reference = [], None
    for label, options in VARIANTS:
        def chain(x, w1s, w2s, a1, a2, bt1, bt2, options=options):
            outs = []
            for p, q in zip(w1s, w2s):
                plan = None if options is None else mg.l2_prefetch_for(q, k=k2, **options)
                y1 = mg.matmul_unscaled(x, p, n=n1, k=k1,
                                        lora_down=jnp.dot(x, a1,
                                                          preferred_element_type=jnp.float32),
                                        lora_bt=bt1, l2_prefetch=plan)
                x2 = _between(kind, y1, k2)
                y2 = mg.matmul_unscaled(x2, q, n=n2, k=k2,
                                        lora_down=jnp.dot(x2, a2,
                                                          preferred_element_type=jnp.float32),
                                        lora_bt=bt2)
                outs.append(y2[:, :8])
                x = _between(back, y2, k1)
            return outs
        fn = jax.jit(chain)
        args = (x, w1, w2, a1, a2, bt1, bt2)
        try:
            outs = jax.block_until_ready(fn(*args))
            total, top = _traced(fn, args, repeats, count)
            wall = _wall_us(fn, args, count)
        except Exception as error:  # a variant that does not compile is a row, not a stop
            rows.append({"pair": f"{first} > {second}", "variant": label,
                         "error": f"{type(error).__name__}: {str(error)[:300]}"})
            print(rows[-1], flush=True)
            continue
        got = np.asarray(outs[-1], np.float32)
        if reference is None:
            reference = got
        rows.append({"pair": f"{first} > {second}", "between": kind, "variant": label,
                     "device_us_per_rep": round(total, 2), "wall_us_per_rep": round(wall, 2),
                     "bit_identical": bool(np.array_equal(got, reference)),
                     "copies": count, "top_events_us": top})
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    import jax
    shapes = SHAPES[args.size]
    pairs = PAIRS if args.pairs == "all" else [PAIRS[int(i)] for i in args.pairs.split(",")]
    key = jax.random.key(0)
    start = time.perf_counter()
    rows = warm_cold_rows(key, shapes, args.m, args.repeats)
    for i, pair in enumerate(pairs):
        rows += pair_rows(jax.random.fold_in(key, 10 + i), shapes, pair, args.m, args.repeats)
    result = {"size": args.size, "m": args.m, "rows": rows,
              "elapsed_s": time.perf_counter() - start, **common.device_info()}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"mgpu_prefetch_{args.size}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
