"""Device time of the fused 4-bit matmul at decode M, from a profiler trace (not wall clock).

For each layer shape, format, K tile and decode tuning (pallas_kernels.blockwise_matmul
.DecodeTuning fields, e.g. "block_n=32,num_warps=8"), one jitted program applies the kernel
(with an unmerged rank-r LoRA in its epilogue, as in the model's rollout) to R distinct copies
of the weight, R large enough that the copies overflow the L2 cache twice over, so every call
streams its weight from HBM as it does in a decode step. The program runs under jax.profiler
and the device events are read back: the Pallas kernel's mean time per call, and the time of
everything the call launches (the kernel plus the split-K sum), from which the weight bandwidth
(codes + scales bytes / time) follows. A bf16 x @ W (cuBLAS) on the same shape, timed the same
way, is the reference row.

Why a trace: a wall-clock microbenchmark (kernels.py --launch-sweep) timed a 7B gate/up call at
135 us against 24 us in the decode-step profile, and its ranking of tilings did not hold in the
model. Kernel durations in a trace are what the decode-step profile reports too.

    python benchmarks/profile/kernel_profile.py --model 7b \
        --tunings "base;num_warps=8;block_n=32" --out $OUT
    python benchmarks/profile/kernel_profile.py --smoke --out /tmp/kernel_profile  # CPU, interpret
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

# run as a script from benchmarks/profile/: the shared helpers live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as harness  # noqa: E402
import decode_profile  # noqa: E402

# (name, N, K) per model; y[M, N] = x[M, K] @ W^T. "qkv" and "gate|up" are the concatenated
# weights of one layer (what a grouped launch would read).
SHAPES = {
    "7b": [("q/o", 3584, 3584), ("k/v", 512, 3584), ("gate/up", 18944, 3584),
           ("down", 3584, 18944), ("qkv", 4608, 3584), ("gate|up", 37888, 3584)],
    "14b": [("q/o", 5120, 5120), ("k/v", 1024, 5120), ("gate/up", 13824, 5120),
            ("down", 5120, 13824)],
    "32b": [("q/o", 5120, 5120), ("k/v", 1024, 5120), ("gate/up", 27648, 5120),
            ("down", 5120, 27648), ("qkv", 7168, 5120), ("gate|up", 55296, 5120)],
    "smoke": [("a", 256, 256), ("b", 128, 512)],
    # 32B-like K with N giving 660 (5 programs per SM x 132 SMs: one full wave at 96 registers
    # per thread), 792, 864 (the 32B gate|up launch: 1.31 waves) and 1320 (2 waves) row tiles
    # of 64: does the time follow the bytes, or the waves?
    "waves": [("660 tiles", 42240, 5120), ("792 tiles", 50688, 5120),
              ("864 tiles", 55296, 5120), ("1320 tiles", 84480, 5120)],
    # One full wave of 660 row tiles at K from 1280 to 10240: the time per K tile of a program
    # and what a program costs besides its K loop (the line's intercept).
    "kdepth": [("K 1280", 42240, 1280), ("K 2560", 42240, 2560), ("K 5120", 42240, 5120),
               ("K 10240", 42240, 10240)],
}
L2_DEFEAT_BYTES = 200 << 20  # > 2x the H100's 50 MiB and the H200's 60 MiB L2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--shapes", default="", help="comma list of shape names (default all)")
    parser.add_argument("--formats", default="nvfp4")
    parser.add_argument("--m", type=int, default=8, help="activation rows (decode batch)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank in the epilogue (0: none)")
    parser.add_argument("--tile-k", default="256", help="comma list of layout K tiles")
    parser.add_argument("--tunings", default="base",
                        help="';'-separated DecodeTuning settings ('base' = the defaults)")
    parser.add_argument("--repeats", type=int, default=3, help="traced runs of each program")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference rows")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.repeats = "smoke", 1
    return args


def weight_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes a call reads for the weight: codes + block scales (NF4: float32 absmax per 64)."""
    return n * k // 2 + n * k // {"nvfp4": 16, "mxfp4": 32, "nf4": 16}[fmt]


def layer_inputs(key, m: int, n: int, k: int, rank: int):
    """The activations x [m, k] and the LoRA epilogue's down [m, rank] and B [rank, n] (None
    at rank 0), bf16, drawn from `key` (shared with triton_ir.py)."""
    import jax
    import jax.numpy as jnp
    x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.bfloat16)
    if not rank:
        return x, None, None
    down = jax.random.normal(jax.random.fold_in(key, 2), (m, rank), jnp.bfloat16)
    lora_b = 0.01 * jax.random.normal(jax.random.fold_in(key, 3), (rank, n), jnp.bfloat16)
    return x, down, lora_b


def traced_device_us(fn, args, repeats: int, calls: int, kernel_marker: str | None):
    """(mean us per call of events whose name contains kernel_marker, mean us per call of all
    device events, number of marker events) over `repeats` traced runs of fn(*args)."""
    import jax
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="kernel_profile_")
    with jax.profiler.trace(trace_dir):
        for _ in range(repeats):
            jax.block_until_ready(fn(*args))
    events, _ = decode_profile.device_events(trace_dir)
    total = sum(duration for _, duration in events)
    marked = [duration for name, duration in events
              if kernel_marker is not None and kernel_marker in name]
    per_call = calls * repeats
    return (sum(marked) / per_call if marked else float("nan"), total / per_call, len(marked))


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _kernel_cases as kernel_cases
    from pallas_kernels import blockwise_matmul as bw

    interpret = args.smoke
    wanted = set(harness.split_list(args.shapes))
    shapes = [s for s in SHAPES[args.model] if not wanted or s[0] in wanted]
    if wanted - {s[0] for s in shapes}:
        raise SystemExit(f"unknown shapes {sorted(wanted - {s[0] for s in shapes})} for "
                         f"{args.model}; known: {[s[0] for s in SHAPES[args.model]]}")
    tunings = [t.strip() for t in args.tunings.split(";") if t.strip()]
    parsed = {t: ({} if t == "base" else bw.parse_tuning(t)) for t in tunings}
    rows = []
    key = jax.random.key(0)
    started = time.perf_counter()
    for name, n, k in shapes:
        x, down, lora_b = layer_inputs(key, args.m, n, k, args.rank)
        if not args.no_bf16:
            dense = 0.02 * jax.random.normal(jax.random.fold_in(key, 4), (k, n), jnp.bfloat16)
            count = 1 if interpret else max(2, math.ceil(L2_DEFEAT_BYTES / (2 * n * k)))
            ws = kernel_cases.copies(dense, count)
            fn = jax.jit(lambda x, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32)
                                        .astype(jnp.bfloat16) for w in ws])
            _, total_us, _ = traced_device_us(fn, (x, ws), args.repeats, count, None)
            rows.append({"shape": name, "n": n, "k": k, "format": "bf16", "tile_k": "-",
                         "tuning": "-", "config": "XLA dot", "copies": count,
                         "kernel_us": total_us, "call_us": total_us,
                         "TB_s": 2 * n * k / total_us / 1e6})
            print(rows[-1], flush=True)
            del ws, dense
        for fmt in harness.split_list(args.formats):
            spec = kernel_cases.SPECS[fmt]
            for tile_k in (int(t) for t in harness.split_list(args.tile_k)):
                ckpt = kernel_cases.random_checkpoint(fmt, n, k, jax.random.fold_in(key, 5))
                packed = kernel_cases.repack(fmt, ckpt, tile_k=tile_k)
                nbytes = weight_bytes(fmt, n, k)
                count = 1 if interpret else max(2, math.ceil(L2_DEFEAT_BYTES / nbytes))
                ws = kernel_cases.copies(packed, count)
                reference = kernel_cases.reference(fmt, x, ckpt).astype(jnp.float32)
                if args.rank:
                    reference = reference + 2.0 * jnp.dot(down, lora_b,
                                                          preferred_element_type=jnp.float32)
                first_output = None  # the first tuning's output: later ones are compared
                for tuning in tunings:
                    config = bw.default_matmul_config(args.m, packed,
                                                      bw.DecodeTuning(**parsed[tuning]))
                    fn = jax.jit(lambda x, ws, down, lora_b, config=config: [
                        bw.blockwise_matmul(x, w, spec=spec, config=config,
                                            interpret=interpret, lora_x_a=down,
                                            lora_b=lora_b, lora_scale=2.0) for w in ws])
                    row = {"shape": name, "n": n, "k": k, "format": fmt, "tile_k": tile_k,
                           "tuning": tuning, "config": _short(config), "copies": count}
                    try:
                        y = fn(x, ws, down, lora_b)[0].astype(jnp.float32)
                        error = float(jnp.max(jnp.abs(y - reference))
                                      / jnp.max(jnp.abs(reference)))
                        if first_output is None:
                            first_output = y
                        row["max_abs_diff_vs_first"] = float(
                            jnp.max(jnp.abs(y - first_output)))
                        marker = f"{fmt}_matmul"
                        kernel_us, call_us, found = traced_device_us(
                            fn, (x, ws, down, lora_b), args.repeats, count, marker)
                        row.update(kernel_us=kernel_us, call_us=call_us,
                                   TB_s=nbytes / call_us / 1e6, max_rel_err=error,
                                   kernel_events=found)
                    except Exception as e:  # a tuning Triton cannot compile: record, go on
                        row.update(error=harness.describe_error(e))
                    rows.append(row)
                    print(row, flush=True)
                del ws, packed
    elapsed = time.perf_counter() - started
    text = report(rows, args, elapsed)
    print(text, flush=True)
    harness.write_outputs(args.out, f"kernel_profile_{args.model}_m{args.m}", text,
                         {"argv": sys.argv, "rows": rows, "jax": jax.__version__,
                          **harness.device_info()})


def _short(config) -> str:
    if config.path != "fused":
        return config.path
    return (f"bm{config.block_m} bn{config.block_n} s{config.split_k} "
            f"{'wL' if config.weight_as_lhs else 'xL'} w{config.num_warps} st{config.num_stages}"
            + (f" {config.decoder}" if config.decoder else ""))


def report(rows, args, elapsed) -> str:
    header = harness.header_line(
        f"Fused-kernel device time at M={args.m} ({args.model} shapes, LoRA r{args.rank} "
        f"epilogue, jax.profiler trace, {args.repeats} runs of R weight copies > "
        f"{L2_DEFEAT_BYTES >> 20} MiB; {elapsed:.0f} s)", [harness.device_info()])
    lines = [header, "",
             "| shape | N x K | format | tile_k | tuning | config | kernel us | call us | TB/s "
             "| vs bf16 | max rel err | max abs diff vs first tuning |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bf16 = {r["shape"]: r["call_us"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['format']} | {r['tile_k']} "
                         f"| {r['tuning']} | {r['config']} | failed: "
                         f"{r['error'][:80].replace('|', '/')} | | | | | |")
            continue
        speedup = bf16.get(r["shape"], float("nan")) / r["call_us"]
        lines.append(
            f"| {r['shape']} | {r['n']} x {r['k']} | {r['format']} | {r['tile_k']} | "
            f"{r['tuning']} | {r['config']} | {r['kernel_us']:.2f} | {r['call_us']:.2f} | "
            f"{r['TB_s']:.2f} | {speedup:.2f}x | {r.get('max_rel_err', float('nan')):.1e} | "
            f"{r.get('max_abs_diff_vs_first', float('nan')):.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
