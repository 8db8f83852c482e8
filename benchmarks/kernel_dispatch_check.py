"""GPU check of the quantized linear op's kernel dispatch (qerl_jax/quant/kernel_dispatch.py).

On Qwen2.5-7B layer shapes, for NVFP4, MXFP4 and NF4 weights: (1) the kernel paths that
`linear` picks by M (fused kernel for M <= 64, Pallas dequantize kernel + XLA dot above) equal
the XLA path (jnp dequantize + dot on the checkpoint-layout weight) within
max|y - y_xla| <= 2^-6 * max|y_xla| (the kernels decode each weight exactly and apply the NVFP4
tensor scale to float32 sums, the XLA path rounds each w / tensor_scale to bf16; see
tests/quant/test_kernel_dispatch.py); (2) times `linear` forward at M in {1, 8, 64, 256, 2048}
and forward + backward (y and dx = dy @ W) at M = 2048 (and M = 64 with each small-M backward
option), for the kernel dispatch, the pure XLA path and a dense bf16 weight.

Timing: the op is applied to R copies of the weight (R such that the copies hold >= 160 MB of
packed weights, at most 8) unrolled in one jit; median of 7 calls after 2 warm-ups, divided by R.
Cases run in priority order under a wall-clock budget (--budget-seconds); each case is wrapped in
try/except, so one failure is reported and the rest still run.

    python benchmarks/kernel_dispatch_check.py --out $OUT/kernel_dispatch.json   # GPU
    python benchmarks/kernel_dispatch_check.py --smoke                           # CPU dry run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qerl_jax.quant import kernel_dispatch  # noqa: E402
from qerl_jax.quant.formats import get_format  # noqa: E402
from qerl_jax.quant.linear_op import linear, select_matmul_path  # noqa: E402

FORMATS = ("nvfp4", "mxfp4", "nf4")
# (layer, N, K) of Qwen2.5-7B, in priority order (largest weights first).
SHAPES_7B = [("gate/up", 18944, 3584), ("down", 3584, 18944), ("q/o", 3584, 3584),
             ("k/v", 512, 3584)]
M_VALUES = (1, 8, 64, 256, 2048)
FWD_BWD_M = (2048,)
SMOKE_SHAPES = [("smoke_a", 192, 320), ("smoke_b", 64, 128)]
SMOKE_M = (1, 8, 64, 100)
SMOKE_FWD_BWD_M = (100,)
TOLERANCE = 2.0 ** -6
L2_DEFEAT_BYTES = 160 << 20
MAX_COPIES = 8


def log(message: str) -> None:
    print(message, flush=True)


def packed_bytes(weight) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(weight))


def time_us(fn, *args, copies: int, repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6 / copies


@jax.jit
def forward_copies(x, weights):
    return tuple(linear(x, w, compute_dtype=jnp.bfloat16) for w in weights)


@jax.jit
def forward_backward_copies(x, dy, weights):
    outputs = []
    for w in weights:
        y, vjp = jax.vjp(lambda x, w=w: linear(x, w, compute_dtype=jnp.bfloat16), x)
        outputs.append((y, vjp(dy)[0]))
    return tuple(outputs)


def max_error(actual, expected) -> tuple[float, float, bool]:
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    scale = float(np.abs(expected).max())
    if not np.all(np.isfinite(actual)):
        return float("nan"), scale, False
    error = float(np.abs(actual - expected).max())
    return error, scale, error <= TOLERANCE * max(scale, 1e-30)


def build_weights(format_name, n, k, key):
    """(checkpoint-layout QuantizedWeight, its kernel-layout copy, dense bf16 [K, N])."""
    dense = 0.02 * jax.random.normal(key, (n, k), jnp.float32)
    quantized = get_format(format_name).quantize(dense, name=f"{format_name}[{n}x{k}]",
                                                 check_finite=False)
    prepared = kernel_dispatch.to_kernel_layout(quantized)
    if not isinstance(prepared, kernel_dispatch.KernelLayoutWeight):
        raise RuntimeError("the weight stayed in the checkpoint layout (see the warning)")
    bf16 = quantized.dequantize(jnp.bfloat16).T
    jax.block_until_ready((quantized, prepared, bf16))
    return quantized, prepared, bf16


def copies_of(value, count):
    return tuple(jax.tree_util.tree_map(jnp.copy, value) for _ in range(count))


def run_case(record, format_name, n, k, m_values, fwd_bwd_m, key, time_it, platform,
             small_m_backward_options, deadline):
    quantized, prepared, bf16 = build_weights(format_name, n, k, key)
    copies = 1 if not time_it else max(1, min(MAX_COPIES, math.ceil(
        L2_DEFEAT_BYTES / packed_bytes(prepared))))
    record["copies"] = copies
    variants = {"kernel": copies_of(prepared, copies), "xla": copies_of(quantized, copies),
                "bf16": copies_of(bf16, copies)}
    del quantized, prepared, bf16
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    for m in m_values:
        row = {"m": m, "path": select_matmul_path(format_name, m, platform)}
        record["forward"].append(row)
        try:
            if time.perf_counter() > deadline:
                row["skipped"] = "budget"
                continue
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            # the first copy's output of the timed (compiled) call is the checked one
            y_kernel = forward_copies(x, variants["kernel"])[0]
            y_xla = forward_copies(x, variants["xla"])[0]
            row["max_err"], row["max_ref"], row["ok"] = max_error(y_kernel, y_xla)
            del y_kernel, y_xla
            if time_it:
                for name, weights in variants.items():
                    row[f"{name}_us"] = time_us(forward_copies, x, weights, copies=copies)
        except Exception as error:  # noqa: BLE001 - reported, the other cases still run
            row["error"] = f"{type(error).__name__}: {error}"
            log(traceback.format_exc(limit=4))
        log(f"  {format_name} [{n}x{k}] M={m}: {summarize(row)}")
    for m, option in [(size, o) for size in fwd_bwd_m for o in small_m_backward_options(size)]:
        row = {"m": m, "small_m_backward": option}
        record["forward_backward"].append(row)
        try:
            if time.perf_counter() > deadline:
                row["skipped"] = "budget"
                continue
            kernel_dispatch.register_kernels(platform, interpret=platform != "gpu",
                                             small_m_backward=option)
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
            y_kernel, dx_kernel = forward_backward_copies(x, dy, variants["kernel"])[0]
            y_xla, dx_xla = forward_backward_copies(x, dy, variants["xla"])[0]
            row["max_err_dx"], row["max_ref_dx"], row["ok"] = max_error(dx_kernel, dx_xla)
            row["ok"] = row["ok"] and max_error(y_kernel, y_xla)[2]
            del y_kernel, dx_kernel, y_xla, dx_xla
            if time_it:
                for name, weights in variants.items():
                    if name == "bf16" and option != "dequantize":
                        continue
                    row[f"{name}_us"] = time_us(forward_backward_copies, x, dy, weights,
                                                copies=copies)
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {error}"
            log(traceback.format_exc(limit=4))
        finally:
            kernel_dispatch.register_kernels(platform, interpret=platform != "gpu")
        log(f"  {format_name} [{n}x{k}] fwd+bwd M={m} ({option} backward): {summarize(row)}")


def summarize(row) -> str:
    if "error" in row:
        return "ERROR " + row["error"][:200]
    if "skipped" in row:
        return "skipped (budget)"
    parts = [f"ok={row.get('ok')}"]
    for key in ("max_err", "max_err_dx"):
        if key in row:
            parts.append(f"{key}={row[key]:.3g}")
    for key in ("kernel_us", "xla_us", "bf16_us"):
        if key in row:
            parts.append(f"{key}={row[key]:.1f}")
    if "kernel_us" in row and "xla_us" in row:
        parts.append(f"kernel/xla speedup={row['xla_us'] / row['kernel_us']:.2f}x")
    if "path" in row:
        parts.append(f"path={row['path']}")
    return " ".join(parts)


def print_tables(records) -> None:
    log("\n| format | layer | N | K | M | path | ok | max err / max ref | kernel us | XLA us | "
        "bf16 us | kernel vs XLA | kernel vs bf16 |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rec in records:
        for row in rec["forward"]:
            log(table_row(rec, row, row.get("path", ""), "max_err", "max_ref"))
    log("\nforward + backward (y and dx = dy @ W):")
    log("| format | layer | N | K | M | small-M backward | ok | max err dx / max ref | kernel us "
        "| XLA us | bf16 us | kernel vs XLA | kernel vs bf16 |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rec in records:
        for row in rec["forward_backward"]:
            log(table_row(rec, row, row["small_m_backward"], "max_err_dx", "max_ref_dx"))


def table_row(rec, row, label, err_key, ref_key) -> str:
    def us(key):
        return f"{row[key]:.1f}" if key in row else "-"

    def ratio(numerator):
        if numerator in row and "kernel_us" in row:
            return f"{row[numerator] / row['kernel_us']:.2f}x"
        return "-"

    if "error" in row:
        check = "ERROR: " + row["error"][:80].replace("|", "/")
    elif "skipped" in row:
        check = "skipped (budget)"
    elif err_key in row:
        check = f"{row[err_key]:.3g} / {row[ref_key]:.3g}"
    else:
        check = "-"
    return (f"| {rec['format']} | {rec['layer']} | {rec['n']} | {rec['k']} | {row['m']} | "
            f"{label} | {row.get('ok', '-')} | {check} | {us('kernel_us')} | {us('xla_us')} | "
            f"{us('bf16_us')} | {ratio('xla_us')} | {ratio('bf16_us')} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, Pallas interpret mode, no timing (CPU dry run)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--budget-seconds", type=float, default=120.0,
                        help="no new case starts after this many seconds (rows of a started "
                             "case stop 30 s later)")
    parser.add_argument("--no-small-m-backward", action="store_true",
                        help="skip the M=64 comparison of the two small-M backward options")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    platform = jax.default_backend()
    if args.smoke:
        shapes, m_values, fwd_bwd_m, time_it = SMOKE_SHAPES, SMOKE_M, SMOKE_FWD_BWD_M, False
        kernel_dispatch.register_kernels(platform, interpret=True)
    else:
        if platform != "gpu":
            log(f"platform is {platform!r}: the compiled kernels need a GPU (use --smoke)")
            return 2
        shapes, m_values, fwd_bwd_m, time_it = SHAPES_7B, M_VALUES, FWD_BWD_M, True
        kernel_dispatch.register_kernels(platform)
    small_m = () if args.no_small_m_backward else (min(m_values[2], 64),)
    fwd_bwd_all = tuple(fwd_bwd_m) + small_m

    def backward_options(m):
        if m <= kernel_dispatch.FUSED_MAX_M["nvfp4"]:
            return ("dequantize", "transposed")
        return ("dequantize",)

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    devices = jax.devices()
    log(f"kernel dispatch check on {devices[0].device_kind} ({platform}), jax {jax.__version__}, "
        f"smoke={args.smoke}, budget {args.budget_seconds:.0f} s")
    records, skipped = [], []
    # No case starts after the budget; no row of a started case after budget + 30 s.
    hard_deadline = start + args.budget_seconds + 30.0
    key = jax.random.key(args.seed)
    # Priority: every format on the largest shape first, then the next shape.
    for layer, n, k in shapes:
        for format_name in formats:
            key, case_key = jax.random.split(key)
            if time.perf_counter() - start > args.budget_seconds:
                skipped.append(f"{format_name} {layer}")
                continue
            record = {"format": format_name, "layer": layer, "n": n, "k": k, "forward": [],
                      "forward_backward": []}
            records.append(record)
            log(f"{format_name} {layer} [N={n}, K={k}] ({time.perf_counter() - start:.0f} s)")
            try:
                run_case(record, format_name, n, k, m_values, fwd_bwd_all, case_key, time_it,
                         platform, backward_options, hard_deadline)
            except Exception as error:  # noqa: BLE001
                record["error"] = f"{type(error).__name__}: {error}"
                log(f"  ERROR {record['error']}")
                log(traceback.format_exc(limit=6))
            if not args.smoke:
                jax.clear_caches()  # frees the compiled programs of the finished shape
    print_tables(records)
    rows = [row for rec in records for row in rec["forward"] + rec["forward_backward"]]
    failures = [row for row in rows if row.get("ok") is not True and "skipped" not in row]
    failures += [rec for rec in records if "error" in rec]
    summary = {"cases": len(rows), "failed_or_error": len(failures), "skipped": skipped,
               "seconds": time.perf_counter() - start}
    log(f"\n{summary}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump({"device": devices[0].device_kind, "platform": platform,
                       "jax": jax.__version__, "smoke": args.smoke,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "tolerance": f"max|y - y_xla| <= {TOLERANCE} * max|y_xla|",
                       "fused_max_m": kernel_dispatch.FUSED_MAX_M,
                       "records": records, "summary": summary}, handle, indent=1)
        log(f"wrote {args.out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
