"""Timings of the 4-bit weight-only matmul kernels (pallas_kernels/) on the GPU.

On the real layer shapes of Qwen2.5-7B and -32B (plus fused q|k|v and gate|up) and M tokens, times
the XLA bf16 dot, each format's Pallas kernel (NVFP4, MXFP4, NF4) and the naive XLA
"dequantize NVFP4 with jnp, then dot"; reports achieved weight bandwidth against a
device-to-device copy measured in the same run. Timing: each op is applied to R copies of the
weight (enough to overflow the L2 cache) unrolled inside one jit, median over repeats, divided by
R (so launch gaps are those of a compiled program, not of Python dispatch).

    python benchmarks/kernels.py --out $OUT                 # full table
    python benchmarks/kernels.py --quick --out $OUT         # subset
    python benchmarks/kernels.py --sweep --out $OUT         # tiling / decoder sweep
    python benchmarks/kernels.py --decode-sweep --models 7b --out $OUT   # tilings at rollout M
    python benchmarks/kernels.py --launch-sweep --models 7b --out $OUT   # warps/stages/tile_k
    python benchmarks/kernels.py --decode-sweep --interpret  # dry run on CPU (tiny shapes)

The compiled kernels' correctness checks are tests: python -m pytest -m gpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _kernel_cases import (FORMATS, SHAPES, SPECS, copies, error_verdict,  # noqa: E402
                           naive_nvfp4_matmul, packed_bytes, random_checkpoint, reference,
                           rel_errors, repack)
from pallas_kernels import blockwise_matmul as bw  # noqa: E402

M_VALUES = (1, 4, 16, 64, 256, 1024, 4096)
QUICK = {"7b": ["k/v", "o", "gate|up", "down"]}
QUICK_M = (1, 16, 64, 1024, 4096)
L2_DEFEAT_BYTES = 160 << 20


# ----------------------------------------------------------------------------------------------
# Timing


def median_time(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_rotating(op, x, weights, repeats=7):
    """Median seconds per application of op(x, w), over len(weights) copies in one jit."""
    fn = jax.jit(lambda x, ws: tuple(op(x, w) for w in ws))
    return median_time(fn, (x, weights), repeats) / len(weights)


def copy_bandwidth():
    """Device-to-device copy bandwidth (bytes read + written per second), 1 GiB buffer."""
    a = jax.random.bits(jax.random.key(0), (1 << 28,), jnp.uint32)
    fn = jax.jit(lambda a: a.copy())
    t = median_time(fn, (a,), 10)
    return 2 * a.nbytes / t


# ----------------------------------------------------------------------------------------------
# Launch sweep: warps x pipeline stages x layout K tile of the default decode tiling


def run_launch_sweep(args):
    """NVFP4 at each --decode-m on the --models' layer shapes: the default tiling (split-K as
    default_matmul_config picks it for the layout) with num_warps in {2, 4, 8} x num_stages in
    {2, 3, 4, 6}, for layout K tiles of 256 (the default) and 512. Each time is the median of
    R weight copies in one jit (comparable within the sweep only). The fastest setting of each
    shape is checked against the jnp reference. Writes launch_sweep.json/.md."""
    deadline = time.time() + args.sweep_seconds
    key = jax.random.key(11)
    shapes = [(model, *shape) for model in args.models.split(",") for shape in SHAPES[model]
              if "|" not in shape[0] and shape[0] != "qkv"]
    tile_ks, warps_list, stages_list = (256, 512), (2, 4, 8), (2, 3, 4, 6)
    if args.interpret:
        shapes, tile_ks, warps_list, stages_list = [("tiny", "w", 256, 1024)], (256,), (4,), (3,)
    results, lines = [], []
    for model, layer, n, k in shapes:
        ckpt = random_checkpoint("nvfp4", n, k, key)
        for m in [int(v) for v in args.decode_m.split(",")]:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            default_us, best = None, None
            for tile_k in tile_ks:
                if tile_k > k or time.time() > deadline:
                    continue
                packed = repack("nvfp4", ckpt, tile_k if not args.interpret else 128)
                count = 2 if args.interpret else max(
                    2, min(64, math.ceil(L2_DEFEAT_BYTES / packed_bytes(n, k, "nvfp4"))))
                ws = copies(packed, count)
                base = bw.default_matmul_config(m, packed)
                for warps in warps_list:
                    for stages in stages_list:
                        if time.time() > deadline:
                            break
                        cfg = dataclasses.replace(base, num_warps=warps, num_stages=stages)
                        try:
                            t = time_rotating(lambda x, w, cfg=cfg: bw.blockwise_matmul(
                                x, w, spec=SPECS["nvfp4"], config=cfg,
                                interpret=args.interpret), x, ws, repeats=5) * 1e6
                        except Exception as e:  # noqa: BLE001 - record and go on
                            print("FAIL", n, k, m, tile_k, cfg, repr(e)[:300], flush=True)
                            t = float("nan")
                        is_default = tile_k == 256 and cfg == base
                        results.append(dict(model=model, layer=layer, n=n, k=k, m=m,
                                            tile_k=packed.tile_k, us=t, default=is_default,
                                            config=dataclasses.asdict(cfg)))
                        if is_default:
                            default_us = t
                        if not math.isnan(t) and (best is None or t < best[0]):
                            best = (t, packed.tile_k, cfg, packed)
            if best is None:
                continue
            t, tile_k, cfg, packed = best
            errs = rel_errors(bw.blockwise_matmul(x, packed, spec=SPECS["nvfp4"], config=cfg,
                                                  interpret=args.interpret),
                              reference("nvfp4", x, ckpt))
            line = (f"| {model} {layer} | {n} | {k} | {m} | "
                    f"{'-' if default_us is None else f'{default_us:.1f}'} | {t:.1f} | "
                    f"tile_k={tile_k} split={cfg.split_k} warps={cfg.num_warps} "
                    f"stages={cfg.num_stages} | {error_verdict(errs)} |")
            lines.append(line)
            print(line, flush=True)
    _write_sweep(args, "launch_sweep",
                 "| shape | N | K | M | default us (tile_k 256, 4 warps, 3 stages) | best us | "
                 "best setting | best vs jnp reference (max err / max) |", lines, results)
    return results


def _write_sweep(args, name, header, lines, results):
    """Prints the sweep's markdown table and writes <name>.md/.json under --out."""
    columns = header.count("|") - 1
    text = header + "\n" + "|---" * columns + "|\n" + "\n".join(lines)
    if args.out:
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(text + "\n")
    print(text, flush=True)


# ----------------------------------------------------------------------------------------------
# Decode-shape sweep: the fused kernel's tiling at the M of rollout batches


def decode_candidates(m, packed):
    """Fused-kernel tilings tried at M rows: block_n x split-K (uneven splits included) x dot
    orientation, default first."""
    n_pad, half_k = packed.codes.shape
    k_tiles = 2 * half_k // packed.tile_k
    bm = max(16, bw.next_pow2(m))
    out = [bw.default_matmul_config(m, packed)]
    for bn in (32, 64, 128):
        for split in (1, 2, 3, 4, 6, 8):
            tps = -(-k_tiles // split)
            if (split - 1) * tps >= k_tiles or (n_pad // bn) * split > 4096:
                continue
            for lhs in ((False, True) if bm <= 16 else (True,)):
                cfg = bw.MatmulConfig(block_m=bm, block_n=bn, split_k=split, weight_as_lhs=lhs)
                if cfg not in out:
                    out.append(cfg)
    return out


def run_decode_sweep(args):
    """Times every decode candidate on the --models' layer shapes at each --decode-m (NVFP4;
    NF4/MXFP4 on the default and the 3 best NVFP4 tilings of each shape), and checks the best
    against the jnp reference. Writes decode_sweep.json/.md."""
    deadline = time.time() + args.sweep_seconds
    key = jax.random.key(7)
    results, lines = [], []
    shapes = [(model, *shape) for model in args.models.split(",") for shape in SHAPES[model]
              if "|" not in shape[0] and shape[0] != "qkv"]
    if args.interpret:
        shapes = [("tiny", "w", 256, 640)]
    ms = [int(v) for v in args.decode_m.split(",")]
    for model, layer, n, k in shapes:
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            timed = {}
            for fmt in ("nvfp4", "nf4", "mxfp4"):
                if time.time() > deadline:
                    break
                ckpt = random_checkpoint(fmt, n, k, key)
                packed = repack(fmt, ckpt, 256 if not args.interpret else 128)
                count = 2 if args.interpret else max(
                    2, min(64, math.ceil(L2_DEFEAT_BYTES / packed_bytes(n, k, fmt))))
                ws = copies(packed, count)
                cands = decode_candidates(m, packed)
                if fmt != "nvfp4":
                    ranked = sorted(timed.items(), key=lambda kv: kv[1])
                    cands = [cands[0]] + [c for c, _ in ranked[:3] if c != cands[0]]
                    cands = [dataclasses.replace(c, weight_as_lhs=True) if fmt == "nf4" else c
                             for c in cands]
                best = None
                for cfg in cands:
                    if time.time() > deadline:
                        break
                    try:
                        t = time_rotating(lambda x, w, cfg=cfg: bw.blockwise_matmul(
                            x, w, spec=SPECS[fmt], config=cfg, interpret=args.interpret),
                            x, ws, repeats=5) * 1e6
                    except Exception as e:  # noqa: BLE001 - record and go on
                        print("FAIL", fmt, n, k, m, cfg, repr(e)[:300], flush=True)
                        t = float("nan")
                    if fmt == "nvfp4":
                        timed[cfg] = t
                    row = dict(model=model, layer=layer, n=n, k=k, m=m, fmt=fmt, us=t,
                               default=cfg == cands[0], config=dataclasses.asdict(cfg))
                    results.append(row)
                    if not math.isnan(t) and (best is None or t < best[0]):
                        best = (t, cfg)
                if best is None:
                    continue
                errs = rel_errors(bw.blockwise_matmul(x, packed, spec=SPECS[fmt], config=best[1],
                                                      interpret=args.interpret),
                                  reference(fmt, x, ckpt))
                default_us = next(r["us"] for r in results if r["default"] and r["fmt"] == fmt
                                  and (r["n"], r["k"], r["m"]) == (n, k, m))
                c = best[1]
                line = (f"| {model} {layer} | {n} | {k} | {m} | {fmt} | {default_us:.1f} | "
                        f"{best[0]:.1f} | bn={c.block_n} split={c.split_k} "
                        f"lhs={c.weight_as_lhs} | {error_verdict(errs)} |")
                lines.append(line)
                print(line, flush=True)
    _write_sweep(args, "decode_sweep",
                 "| shape | N | K | M | format | default us | best us | best tiling | best vs jnp "
                 "reference (max err / max) |", lines, results)
    return results


# ----------------------------------------------------------------------------------------------
# Sweep of tilings / decoders (on a few shapes), to pick the defaults


def run_sweep(args):
    """Measures candidate configs in priority order until --sweep-seconds run out."""
    deadline = time.time() + args.sweep_seconds
    results = []
    key = jax.random.key(1)
    cache = {}

    def weights(fmt, n, k, tile_k):
        if (fmt, n, k, tile_k) not in cache:
            cache.clear()
            packed = repack(fmt, random_checkpoint(fmt, n, k, key), tile_k)
            count = max(2, min(64, math.ceil(L2_DEFEAT_BYTES / packed_bytes(n, k, fmt))))
            cache[(fmt, n, k, tile_k)] = copies(packed, count)
        return cache[(fmt, n, k, tile_k)]

    def measure(label, fmt, n, k, m, cfg, tile_k=256, transposed=False):
        if time.time() > deadline:
            return float("nan")
        ws = weights(fmt, n, k, tile_k)
        try:
            if transposed:
                x = jax.random.normal(key, (m, n), jnp.bfloat16)
                op = lambda x, w: bw.blockwise_matmul_transposed(
                    x, w, spec=SPECS[fmt], config=cfg, interpret=args.interpret)
            else:
                x = jax.random.normal(key, (m, k), jnp.bfloat16)
                op = lambda x, w: bw.blockwise_matmul(x, w, spec=SPECS[fmt], config=cfg,
                                                      interpret=args.interpret)
            t = time_rotating(op, x, ws, repeats=5)
        except Exception as e:  # noqa: BLE001
            t = float("nan")
            print("FAIL", label, cfg, repr(e)[:600])
        results.append(dict(label=label, fmt=fmt, n=n, k=k, m=m, tile_k=tile_k,
                            transposed=transposed, config=dataclasses.asdict(cfg), us=t * 1e6))
        print(f"{label:10s} {fmt} N={n} K={k} M={m} tile_k={tile_k} {t*1e6:9.1f} us  {cfg}",
              flush=True)
        return t

    def best(entries):
        ok = [e for e in entries if not math.isnan(e[0])]
        return min(ok, key=lambda e: e[0])[1] if ok else None

    big, small_n, k, large_m = 37888, 4608, 3584, 4096
    if args.interpret:  # CPU dry run of the script's logic
        big, small_n, k, large_m = 256, 128, 512, 128
    for n in (big, small_n):
        for m in (16, large_m):
            w = jax.random.normal(key, (n, k), jnp.bfloat16)
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            count = max(2, min(64, math.ceil(L2_DEFEAT_BYTES / w.nbytes)))
            t = time_rotating(lambda x, w: jax.lax.dot_general(
                x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            ).astype(jnp.bfloat16), x, copies(w, count))
            print(f"bf16 dot N={n} K={k} M={m}: {t*1e6:.1f} us", flush=True)
            results.append(dict(label="bf16", n=n, k=k, m=m, us=t * 1e6))
            del w
    R = dataclasses.replace
    gdecs = {"nvfp4": ("ptx_scaled", "fp8"), "mxfp4": ("ptx_scaled",), "nf4": ("lut16", "select")}
    edec = {"nvfp4": "ptx_scaled", "mxfp4": "ptx_scaled", "nf4": "lut16"}
    best_small = {}
    # 1. M=16: group-scaled dots vs the per-weight-scale kernel (best of the first sweep).
    for fmt in FORMATS:
        for n in (big, small_n):
            entries = []
            base = bw.MatmulConfig(block_m=16, block_n=64, split_k=1 if n == big else 2,
                                   num_stages=4, decoder=edec[fmt])
            for lhs in (False, True):
                entries.append((measure("e", fmt, n, k, 16, R(base, weight_as_lhs=lhs)),
                                R(base, weight_as_lhs=lhs)))
            for dec in gdecs[fmt]:
                for lhs in (True, False):
                    for bn in (64, 128):
                        for split in (1, 2):
                            if fmt != "nvfp4" and (dec != gdecs[fmt][0] or bn == 128):
                                continue
                            cfg = R(base, group_dots=True, decoder=dec, weight_as_lhs=lhs,
                                    block_n=bn, split_k=split, num_stages=3)
                            entries.append((measure("g", fmt, n, k, 16, cfg), cfg))
            cfg = best(entries)
            best_small[(fmt, n)] = cfg
            if cfg is None:
                continue
            for stages, warps in ((2, 4), (4, 4), (3, 8)):
                c2 = R(cfg, num_stages=stages, num_warps=warps)
                entries.append((measure("g-tune", fmt, n, k, 16, c2), c2))
            entries.append((measure("g-tile128", fmt, n, k, 16, cfg, tile_k=128), None))
            cfg = best(entries) or cfg
            best_small[(fmt, n)] = cfg
            print("BEST-16", fmt, n, cfg, flush=True)
    # 2. other M with the M=16 winner (and the other orientation at M >= 64).
    for fmt in FORMATS:
        for n in (big, small_n):
            cfg = best_small.get((fmt, n))
            if cfg is None:
                continue
            for m in (1, 4, 64, 256):
                bm = max(16, min(128, bw.next_pow2(m)))
                for lhs in ((cfg.weight_as_lhs,) if m < 64 else (True, False)):
                    measure(f"M{m}", fmt, n, k, m, R(cfg, block_m=bm, weight_as_lhs=lhs,
                                                     num_warps=cfg.num_warps if bm <= 64 else 8))
            measure("M256-DQ", fmt, n, k, 256, bw.MatmulConfig(path="dequantize"))
    # 3. large M: dequantize + XLA dot (the kernel alone too), fused transposed vs dequantize.
    for fmt in FORMATS:
        measure("large-DQ", fmt, big, k, large_m, bw.MatmulConfig(path="dequantize"))
        measure("T-DQ", fmt, big, k, large_m, bw.TransposedConfig(path="dequantize"),
                transposed=True)
        measure("T", fmt, big, k, large_m, bw.TransposedConfig(
            block_m=64, block_n=64, num_warps=4, num_stages=3, decoder=edec[fmt]),
            transposed=True)
    for fmt in FORMATS:
        for bn, tpp, warps in ((64, 1, 4), (32, 2, 4), (128, 1, 8), (64, 2, 4)):
            ws = weights(fmt, big, k, 256)
            cfg = bw.DequantizeConfig(block_n=bn, tiles_per_program=tpp, num_warps=warps)
            try:
                t = time_rotating(lambda x, w: bw.blockwise_dequantize(
                    w, spec=SPECS[fmt], config=cfg, interpret=args.interpret), None, ws)
            except Exception as e:  # noqa: BLE001
                t = float("nan")
                print("FAIL dequantize", cfg, repr(e)[:400])
            print(f"dequantize {fmt} N={big} K={k} {t*1e6:9.1f} us  {cfg}", flush=True)
            results.append(dict(label="dequantize", fmt=fmt, n=big, k=k,
                                config=dataclasses.asdict(cfg), us=t * 1e6))
    if args.out:
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


# ----------------------------------------------------------------------------------------------
# The benchmark table


def run_bench(args):
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    models = args.models.split(",")
    if args.interpret:  # CPU dry run of the script's logic
        SHAPES["tiny"], models = [("tiny", 80, 448)], ["tiny"]
    meta = dict(date=datetime.datetime.now().isoformat(), device=str(jax.devices()[0]),
                jax=jax.__version__, copy_bandwidth=bandwidth)
    rows, trows = [], []
    key = jax.random.key(2)
    dot = lambda x, w: jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    dot_t = lambda dy, w: jnp.dot(dy, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def timed(label, op, x, ws):
        try:
            return time_rotating(op, x, ws) * 1e6
        except Exception as e:  # noqa: BLE001
            print("FAIL", label, repr(e)[:800], flush=True)
            return float("nan")

    def kernel_op(fmt, cfg):
        return lambda x, w: bw.blockwise_matmul(x, w, spec=SPECS[fmt], config=cfg,
                                                interpret=args.interpret)

    def save():
        if not args.out:
            return
        text = _table(rows, bandwidth) + "\n\n" + _ttable(trows)
        with open(os.path.join(args.out, "kernels.md"), "w") as f:
            f.write(f"{meta}\n\n{text}\n")
        with open(os.path.join(args.out, "kernels.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows, transposed=trows), f, indent=1)

    def bench_model(model, transposed_only=False):
        nonlocal key
        shapes = SHAPES[model]
        if args.quick:
            shapes = [s for s in shapes if s[0] in QUICK.get(model, [])] or shapes[:3]
        for name, n, k in shapes:
            if transposed_only and name not in ("qkv", "gate|up", "down", "tiny"):
                continue
            key, kw, kx = jax.random.split(key, 3)
            count = max(2, min(64, math.ceil(L2_DEFEAT_BYTES / packed_bytes(n, k, "nvfp4"))))
            packed, ckpt0 = {}, None
            for fmt in FORMATS:
                ckpt = random_checkpoint(fmt, n, k, kw)
                ckpt0 = ckpt if fmt == "nvfp4" else ckpt0
                packed[fmt] = copies(repack(fmt, ckpt), count)
            w16 = jax.random.normal(kw, (n, k), jnp.bfloat16)
            w16s = copies(w16, max(2, min(64, math.ceil(L2_DEFEAT_BYTES / w16.nbytes))))
            naive_ws = copies(ckpt0, min(count, 8))
            if transposed_only:
                for m in (4096,) if not args.interpret else (300,):
                    dy = jax.random.normal(kx, (m, n), jnp.bfloat16)
                    row = dict(model=model, layer=name, n=n, k=k, m=m,
                               bf16=timed("bf16 dx", dot_t, dy, w16s))
                    for fmt in FORMATS:
                        for path in ("dequantize", "fused"):
                            cfg = (bw.TransposedConfig(path="dequantize") if path == "dequantize"
                                   else bw.TransposedConfig(block_m=64, block_n=64, num_warps=4,
                                                            num_stages=3))
                            op = (lambda fmt, cfg: lambda x, w: bw.blockwise_matmul_transposed(
                                x, w, spec=SPECS[fmt], config=cfg,
                                interpret=args.interpret))(fmt, cfg)
                            row[f"{fmt}_{path}"] = timed(f"{fmt} dx {path}", op, dy, packed[fmt])
                    trows.append(row)
                    print(_trow_md(row), flush=True)
                    save()
                continue
            for m in (QUICK_M if args.quick else M_VALUES) if not args.interpret else (1, 300):
                x = jax.random.normal(kx, (m, k), jnp.bfloat16)
                row = dict(model=model, layer=name, n=n, k=k, m=m,
                           bf16=timed("bf16", dot, x, w16s))
                for fmt in FORMATS:
                    cfg = bw.default_matmul_config(m, packed[fmt][0])
                    row[f"{fmt}_config"] = str(cfg)
                    row[fmt] = timed(f"{fmt} {name} {m}", kernel_op(fmt, cfg), x, packed[fmt])
                    row[f"{fmt}_bw"] = packed_bytes(n, k, fmt) / (row[fmt] * 1e-6)
                    if fmt == "nvfp4" and m % 16 and m < 16:  # masked rows instead of clamped
                        alt = dataclasses.replace(cfg, clamp_rows=False)
                        row["nvfp4_masked_rows"] = timed("masked", kernel_op(fmt, alt), x,
                                                         packed[fmt])
                row["naive"] = timed("naive", lambda x, c: naive_nvfp4_matmul(x, *c), x, naive_ws)
                rows.append(row)
                print(_row_md(row, bandwidth), flush=True)
                save()
            del packed, w16s, naive_ws

    for i, model in enumerate(models):
        bench_model(model)
        if i == 0:
            bench_model(model, transposed_only=True)
    text = _table(rows, bandwidth) + "\n\n" + _ttable(trows)
    print("\n" + text)
    save()
    return rows


HEADER = ("| model | layer | N | K | M | bf16 dot us | NVFP4 us (x bf16, % copy bw) | "
          "MXFP4 us (x, %) | NF4 us (x, %) | naive NVFP4 us (x) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _row_md(r, bandwidth):
    def cell(fmt):
        text = (f"{r[fmt]:.1f} ({r['bf16'] / r[fmt]:.2f}x, "
                f"{100 * r[f'{fmt}_bw'] / bandwidth:.0f}%)")
        if "dequantize" in r.get(f"{fmt}_config", ""):
            text += " dq"
        if fmt == "nvfp4" and "nvfp4_masked_rows" in r:
            text += f" [masked rows: {r['nvfp4_masked_rows']:.1f}]"
        return text
    return (f"| {r['model']} | {r['layer']} | {r['n']} | {r['k']} | {r['m']} | {r['bf16']:.1f} | "
            f"{cell('nvfp4')} | {cell('mxfp4')} | {cell('nf4')} | "
            f"{r['naive']:.1f} ({r['bf16'] / r['naive']:.2f}x) |")


def _table(rows, bandwidth):
    return "\n".join([HEADER] + [_row_md(r, bandwidth) for r in rows])


THEADER = ("| model | layer | N | K | M | bf16 dy@W us | NVFP4 dequant+XLA / fused us | "
           "MXFP4 dequant+XLA / fused us | NF4 dequant+XLA / fused us |\n"
           "|---|---|---|---|---|---|---|---|---|")


def _trow_md(r):
    cells = " | ".join(f"{r[f+'_dequantize']:.0f} ({r['bf16'] / r[f+'_dequantize']:.2f}x) / "
                       f"{r[f+'_fused']:.0f} ({r['bf16'] / r[f+'_fused']:.2f}x)" for f in FORMATS)
    return f"| {r['model']} | {r['layer']} | {r['n']} | {r['k']} | {r['m']} | {r['bf16']:.0f} | {cells} |"


def _ttable(trows):
    return "\n".join([THEADER] + [_trow_md(r) for r in trows])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="fused-kernel tilings at rollout M (see --decode-m)")
    parser.add_argument("--launch-sweep", action="store_true",
                        help="num_warps x num_stages x layout K tile of the default tiling at "
                             "--decode-m (NVFP4)")
    parser.add_argument("--decode-m", default="8,64")
    parser.add_argument("--bench", action="store_true", help="with --sweep: also bench")
    parser.add_argument("--sweep-seconds", type=float, default=200)
    parser.add_argument("--models", default="7b,32b")
    parser.add_argument("--interpret", action="store_true",
                        help="CPU dry run (interpret mode, tiny shapes)")
    args = parser.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    start = time.time()
    if args.sweep:
        run_sweep(args)
        print(f"[sweep done at {time.time() - start:.0f}s]", flush=True)
    if args.decode_sweep:
        run_decode_sweep(args)
        print(f"[decode sweep done at {time.time() - start:.0f}s]", flush=True)
    if args.launch_sweep:
        run_launch_sweep(args)
        print(f"[launch sweep done at {time.time() - start:.0f}s]", flush=True)
    if args.bench or not (args.sweep or args.decode_sweep or args.launch_sweep):
        run_bench(args)
        print(f"[bench done at {time.time() - start:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
