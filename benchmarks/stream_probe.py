"""How fast can a Pallas-Triton kernel stream the fused kernel's bytes at all? (timing probe)

Session 18 fitted the fused NVFP4 kernel at 32B K as 6.2 us + 0.071 us per 64-row tile: a
marginal 2.6 TB/s, against 3.1 TB/s for XLA's (cuBLAS) bf16 lm_head. Session 16 showed the
E2M1 decode's instructions no longer limit it. This probe asks whether the Triton load path
itself stops there: kernels with the fused kernel's grid (one program per 64-row tile, a K loop
over the tile-major layout, Triton's software pipeline) that read the same bytes but do next
to no arithmetic:

  xor          codes tiles [64, 128] uint8 only, xor-ed into a carried tile (no dot)
  xor+s        + the two scale planes [64, 16]
  xor+s+x      + the activation tiles [16, 256] bf16 (rows >= M masked, as in the kernel)
  dot8         codes (as int8) @ a constant int8 [128, 16] tile per K tile: an int8 mma,
               the fused kernel's dot shape without the decode
  dot8+s+x     + scale and activation loads (summed into the result so they stay live)
  dot16        the fused kernel's two bf16 dots per K tile, its activation tiles [16, 128]
               (rows >= M masked, loaded per K tile as in the kernel) @ the low / high
               nibbles of the codes as bf16 (2 bit operations per weight: (c & 15) | 0x4300
               is the bf16 of 128 + c); no scales
  dot16+s+x    + the two scale planes' loads (xor-ed, not applied)
  tma          a Pallas Mosaic GPU kernel (the other backend: TMA copies): one program per
               row tile runs plgpu.emit_pipeline over its K tiles, the [64, 128] code tiles
               copied into shared memory with the setting's stages in flight, and an empty
               body: the TMA streaming ceiling itself
  tma+s        + the scale tiles [64, 16]
  xla          XLA row reduction (max) over the codes + a reduction over the scales: what
               XLA's own emitter reaches on the same bytes

Each variant runs on R distinct copies (> 200 MiB, so every call streams from HBM) and is
timed from a profiler trace (kernel_profile.traced_device_us). TB/s counts the codes + scales
bytes (NVFP4: K/2 + K/16 per row). The outputs are meaningless (timing only).

    python benchmarks/stream_probe.py --out $OUT                   # GPU
    python benchmarks/stream_probe.py --smoke --out /tmp/stream    # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback

import _common as common
import kernel_profile

VARIANTS = ("xor", "xor+s", "xor+s+x", "dot8", "dot8+s+x", "dot16", "dot16+s+x", "tma", "tma+s",
            "xla")
TILE_ROWS = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", default="660,864,1320",
                        help="comma list of 64-row tile counts (N = 64 x tiles)")
    parser.add_argument("--k", type=int, default=5120, help="K (32B hidden size)")
    parser.add_argument("--m", type=int, default=8, help="activation rows")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--settings", default="w4s3",
                        help="';'-separated kernel settings: w<warps>s<stages>[e] (e: "
                             "evict_first on the codes and scales loads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    parser.add_argument("--out", default=".")
    return parser.parse_args(argv)


def parse_setting(text: str) -> tuple[int, int, str | None]:
    """'w4s3e' -> (4 warps, 3 stages, 'evict_first')."""
    body = text.strip()
    eviction = None
    if body.endswith("e"):
        eviction, body = "evict_first", body[:-1]
    if not body.startswith("w") or "s" not in body:
        raise ValueError(f"setting {text!r}: expected w<warps>s<stages>[e], e.g. w4s3e")
    warps, stages = body[1:].split("s")
    return int(warps), int(stages), eviction


def _stream_kernel(codes_ref, scales_ref, x_ref, out_ref, *, variant: str, k_tiles: int,
                   m: int, eviction: str | None):
    """Program p streams row tile p's K tiles (tile-major rows p*64*k_tiles + kt*64)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    pid = pl.program_id(0)
    half = codes_ref.shape[1]
    ns = scales_ref.shape[1]
    tile_k = 2 * half
    base = pid * TILE_ROWS * k_tiles
    with_scales = "+s" in variant
    with_x = "+x" in variant
    dot = variant.startswith("dot8")
    dot16 = variant.startswith("dot16")

    def load(view, **kw):
        return plgpu.load(view, eviction_policy=eviction, **kw)

    def body(kt, carry):
        acc, acc_s, acc_x = carry
        row = pl.multiple_of(base + kt * TILE_ROWS, TILE_ROWS)
        c = load(codes_ref.at[pl.ds(row, TILE_ROWS), pl.ds(0, half)])
        if dot16:
            rows = lax.broadcasted_iota(jnp.int32, (16, 1), 0) < m
            c16 = c.astype(jnp.uint16)
            planes = (c16 & 15, c16 >> 4)
            for p in range(2):
                w = lax.bitcast_convert_type(planes[p] | 0x4300, jnp.bfloat16)
                xv = plgpu.load(x_ref.at[pl.ds(0, 16), pl.ds(kt * tile_k + p * half, half)],
                                mask=jnp.broadcast_to(rows, (16, half)), other=0.0)
                acc = acc + lax.dot_general(xv, w, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        elif dot:
            ones = jnp.ones((half, 16), jnp.int8)
            acc = acc + jnp.dot(lax.bitcast_convert_type(c, jnp.int8), ones,
                                preferred_element_type=jnp.int32)
        else:
            acc = acc ^ c
        if with_scales:
            acc_s = acc_s ^ load(scales_ref.at[pl.ds(row, TILE_ROWS), pl.ds(0, ns)])
        if with_x and not dot16:
            rows = lax.broadcasted_iota(jnp.int32, (16, 1), 0) < m
            for p in range(2):
                xv = plgpu.load(x_ref.at[pl.ds(0, 16), pl.ds(kt * tile_k + p * half, half)],
                                mask=jnp.broadcast_to(rows, (16, half)), other=0.0)
                acc_x = acc_x + xv.astype(jnp.float32)
        return acc, acc_s, acc_x

    acc0 = (jnp.zeros((TILE_ROWS, 16), jnp.int32) if dot
            else jnp.zeros((16, TILE_ROWS), jnp.float32) if dot16
            else jnp.zeros((TILE_ROWS, half), jnp.uint8))
    carry = (acc0, jnp.zeros((TILE_ROWS, ns), jnp.uint8), jnp.zeros((16, half), jnp.float32))
    acc, acc_s, acc_x = lax.fori_loop(0, k_tiles, body, carry)
    # Row sums in the [64, 16] result keep every load live.
    if dot:
        summary = acc
    elif dot16:
        summary = acc.T.astype(jnp.int32)
    else:
        summary = jnp.broadcast_to(acc.astype(jnp.int32).sum(axis=1, keepdims=True),
                                   (TILE_ROWS, 16))
    summary = summary + acc_s.astype(jnp.int32).sum(axis=1, keepdims=True)
    summary = summary + jnp.sum(acc_x).astype(jnp.int32)
    out_ref[pl.ds(pid * TILE_ROWS, TILE_ROWS), :] = summary


def _tma_call(codes, scales, *, variant: str, k_tiles: int, stages: int):
    """The Mosaic GPU streaming kernel: plgpu.kernel over a grid of row tiles, each running
    plgpu.emit_pipeline (TMA copies into shared memory, `stages` in flight) over its K tiles
    with an empty body; its output is never written (timing only). GPU only."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental.pallas import mosaic_gpu as plmgpu

    half, ns = codes.shape[1], scales.shape[1]
    tiles = codes.shape[0] // (TILE_ROWS * k_tiles)
    with_scales = variant == "tma+s"

    def body(*refs):
        inputs = refs[:-1]
        i = lax.axis_index("tiles")

        def step(indices, *smem_refs):
            del indices, smem_refs

        specs = [plmgpu.BlockSpec((TILE_ROWS, half), lambda k: (i * k_tiles + k, 0))]
        if with_scales:
            specs.append(plmgpu.BlockSpec((TILE_ROWS, ns), lambda k: (i * k_tiles + k, 0)))
        plmgpu.emit_pipeline(step, grid=(k_tiles,), in_specs=specs,
                             max_concurrent_steps=stages)(*inputs)

    kernel = plmgpu.kernel(body, out_type=jax.ShapeDtypeStruct((tiles, 16), jnp.float32),
                           grid=(tiles,), grid_names=("tiles",))
    return kernel(codes, scales) if with_scales else kernel(codes)


def stream_call(codes, scales, x, *, variant: str, k_tiles: int, m: int, warps: int,
                stages: int, eviction: str | None, interpret: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if variant == "xla":
        return jnp.max(codes, axis=1), jnp.max(scales, axis=1)
    if variant.startswith("tma"):
        return _tma_call(codes, scales, variant=variant, k_tiles=k_tiles, stages=stages)
    tiles = codes.shape[0] // (TILE_ROWS * k_tiles)
    kernel = functools.partial(_stream_kernel, variant=variant, k_tiles=k_tiles, m=m,
                               eviction=eviction)
    params = None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=stages)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((tiles * TILE_ROWS, 16), jnp.int32),
        grid=(tiles,), interpret=interpret, compiler_params=params,
        name=f"stream_{variant.replace('+', '_')}")(codes, scales, x)


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    interpret = args.smoke
    tile_counts = [2, 3] if args.smoke else [int(t) for t in common.split_list(args.tiles)]
    k = 512 if args.smoke else args.k
    tile_k = 256
    k_tiles = k // tile_k
    variants = common.split_list(args.variants)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    settings = [s for s in args.settings.split(";") if s.strip()]
    parsed = {s: parse_setting(s) for s in settings}
    key = jax.random.key(0)
    rows = []
    started = time.perf_counter()
    for tiles in tile_counts:
        n = tiles * TILE_ROWS
        nbytes = n * k // 2 + n * k // 16
        count = 1 if interpret else max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
        codes = [jax.random.bits(jax.random.fold_in(key, 2 * i), (n * k_tiles, tile_k // 2),
                                 jnp.uint8) for i in range(count)]
        scales = [jax.random.bits(jax.random.fold_in(key, 2 * i + 1),
                                  (n * k_tiles, tile_k // 16), jnp.uint8) for i in range(count)]
        x = jax.random.normal(jax.random.fold_in(key, 99), (args.m, k), jnp.bfloat16)
        for variant in variants:
            for setting in (["-"] if variant == "xla" else settings):
                warps, stages, eviction = parsed.get(setting, (4, 3, None))
                fn = jax.jit(lambda cs, ss, x, variant=variant, warps=warps, stages=stages,
                             eviction=eviction: [
                    stream_call(c, s, x, variant=variant, k_tiles=k_tiles, m=args.m,
                                warps=warps, stages=stages, eviction=eviction,
                                interpret=interpret) for c, s in zip(cs, ss)])
                row = {"tiles": tiles, "n": n, "k": k, "variant": variant, "setting": setting,
                       "copies": count, "MB": nbytes / 1e6}
                try:
                    if variant.startswith("tma") and interpret:
                        raise NotImplementedError("the Mosaic GPU variants need a GPU")
                    # XLA's reduction and the Mosaic GPU kernel (whose trace name may not
                    # carry the pallas_call name): every device event of the call.
                    whole_call = variant == "xla" or variant.startswith("tma")
                    marker = None if whole_call else "stream_"
                    kernel_us, call_us, found = kernel_profile.traced_device_us(
                        fn, (codes, scales, x), args.repeats, count, marker)
                    us = call_us if whole_call else kernel_us
                    row.update(kernel_us=us, call_us=call_us, TB_s=nbytes / us / 1e6,
                               kernel_events=found)
                except Exception as e:  # a variant that cannot compile: record, go on
                    traceback.print_exc()
                    row.update(error=common.describe_error(e))
                rows.append(row)
                print(row, flush=True)
        del codes, scales
    elapsed = time.perf_counter() - started
    columns = [("tiles", "row tiles"), ("MB", "MB"), ("variant", "variant"),
               ("setting", "setting"), ("kernel_us", "us"), ("TB_s", "TB/s"),
               ("error", "error")]
    meta = {**common.device_info(), "jax": jax.__version__}
    text = common.header_line(
        f"Streaming ceiling of a Pallas-Triton kernel, K={k}, M={args.m}, {elapsed:.0f} s",
        [meta]) + "\n\n" + common.markdown_table(rows, columns)
    print(text, flush=True)
    common.write_outputs(args.out, "stream_probe", text,
                         {"argv": sys.argv, "rows": rows, "jax": jax.__version__,
                          **common.device_info()})


if __name__ == "__main__":
    main()
