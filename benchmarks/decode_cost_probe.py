"""How much of the fused NVFP4 kernel's decode-M time is the E2M1 decode? (timing probe)

The "asmq" decoder spends 5 instructions per pair of weights in its inline asm (prmt, and,
mul, and, then one packed bf16 fma with the scales; e2m1_decode.py). This probe swaps that asm
for cheaper ones that keep the kernel's loads, dots, scale operands and epilogue unchanged, and
times the kernel with kernel_profile.py's trace method (R weight copies > 200 MiB, so every
call streams its weights from HBM):

  asmq    the decoder in use (the reference row; its outputs are checked against the numpy
          reference like kernel_profile's).
  floor   one `and` + the fma per pair of weights: a lower bound for any bit-level decode.
          Its outputs are NOT the weights' values (timing only).
  shift3  per 4 output registers: x&M, (x>>3)&M, (x>>6)&M and a 3-instruction one, + fmas:
          what a code layout designed for shift-and-mask decoding would cost. NOT the
          weights' values (timing only).

  tilemajor[_st4|_bn128|_split2]  the "asmq" kernel reading a tile-major copy of the codes
          and scales (tile_major below: each program's [bn, tile_k/2] code tiles contiguous,
          one after the other) instead of the row-major kernel layout, where a tile is bn
          128-byte pieces K/2 bytes apart. Exact (checked like asmq); with 4 stages, 128-row
          tiles or twice the split-K.

Session 16 call a: "floor" and "shift3" ran at asmq's time on every 7B and 32B shape, so the
decode's instructions do not limit the kernel. The tile-major rows test whether the access
pattern does.

    python benchmarks/decode_cost_probe.py --model 32b --out $OUT
    python benchmarks/decode_cost_probe.py --smoke    # CPU: the tile-major launcher vs blockwise_matmul
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import _common as common
import kernel_profile

# {variant: (low-plane asm, high-plane asm)}; operands as in e2m1_decode._ASM_PAIRED_*:
# $0, $1 results (2 bf16 each), $2 the 4 code bytes, $3..$6 the 4 weights' scale pairs.
_FLOOR_LO = """{
.reg .b32 y, nz;
mov.b32 nz, 0x80008000;
and.b32 y, $2, 0x81C081C0;
fma.rn.bf16x2 $0, y, $3, nz;
and.b32 y, $2, 0x01C081C0;
fma.rn.bf16x2 $1, y, $5, nz;
}"""
_FLOOR_HI = _FLOOR_LO.replace("0x81C081C0;", "0x81C001C0;").replace("0x01C081C0;", "0x81C08040;")
_SHIFT3_LO = """{
.reg .b32 y, nz;
mov.b32 nz, 0x80008000;
and.b32 y, $2, 0x81C081C0;
fma.rn.bf16x2 $0, y, $3, nz;
shr.u32 y, $2, 3;
and.b32 y, y, 0x81C081C0;
fma.rn.bf16x2 $1, y, $5, nz;
}"""
_SHIFT3_HI = """{
.reg .b32 y, t, m, nz;
mov.b32 nz, 0x80008000;
shr.u32 y, $2, 6;
and.b32 y, y, 0x81C081C0;
fma.rn.bf16x2 $0, y, $3, nz;
mov.b32 m, 0x80008000;
shl.b32 t, $2, 1;
and.b32 y, $2, 0x01C001C0;
lop3.b32 y, y, t, m, 0xF8;
fma.rn.bf16x2 $1, y, $5, nz;
}"""
VARIANTS = {"asmq": None, "floor": (_FLOOR_LO, _FLOOR_HI), "shift3": (_SHIFT3_LO, _SHIFT3_HI),
            "tilemajor": None, "tilemajor_st4": None, "tilemajor_bn128": None,
            "tilemajor_split2": None}
EXACT = ("asmq", "tilemajor", "tilemajor_st4", "tilemajor_bn128", "tilemajor_split2")  # variants that compute the real product


def tile_major(packed, bn: int):
    """(codes, scales) of a kernel-layout weight rearranged so that each [bn, tile_k / 2] code
    tile and its [bn, 2 g] scales are contiguous, the K tiles of one row tile in order
    (blockwise_matmul._matmul_program's tile_major)."""
    n_pad, half = packed.codes.shape[0], packed.tile_k // 2
    k_tiles = packed.codes.shape[1] // half
    codes = packed.codes.reshape(n_pad // bn, bn, k_tiles, half).transpose(0, 2, 1, 3)
    scales = packed.scales.reshape(n_pad // bn, bn, k_tiles, -1).transpose(0, 2, 1, 3)
    return (codes.reshape(-1, half), scales.reshape(-1, scales.shape[-1]))


def tile_major_matmul(x, codes, scales, packed, *, spec, config, down, lora_b, lora_scale,
                      interpret=False):
    """y [M, N] bf16 = x @ W^T (+ LoRA) with tile-major codes and scales (tile_major's), the
    fused kernel launched as blockwise_matmul launches it (no pair views, no groups)."""
    import functools
    import jax
    import jax.numpy as jnp
    from pallas_kernels import blockwise_matmul as bw

    m, k = x.shape
    half = packed.tile_k // 2
    k_tiles = packed.codes.shape[1] // half
    split, bn = config.split_k, config.block_n
    has_lora = down is not None
    if has_lora:
        down, lora_b = bw._lora_epilogue_inputs(down, lora_b, (m,), packed.n)
    decoder = bw._resolve_decoder(spec, config.decoder, interpret)
    kernel = functools.partial(
        bw._matmul_kernel, spec=spec, decoder=decoder, m=m, n=packed.n, k=k,
        bm=config.block_m, bn=bn, tile_k=packed.tile_k,
        tiles_per_split=bw._cdiv(k_tiles, split), k_tiles=k_tiles, split=split,
        weight_as_lhs=config.weight_as_lhs, poisoned=False,
        lora_scale=float(lora_scale) if has_lora else None, tile_major=True)
    out_shape = (jax.ShapeDtypeStruct((m, packed.n), jnp.bfloat16) if split == 1 else
                 jax.ShapeDtypeStruct((split, m, packed.n), jnp.float32))
    y = bw._launch(kernel, out_shape, (bw._cdiv(m, config.block_m), bw._cdiv(packed.n, bn), split),
                   (x, codes, scales, packed.tensor_scale,
                    *((down, lora_b) if has_lora else ()),
                    *(jnp.asarray(a) for a in spec.aux_arrays())),
                   interpret=interpret, poison_output=False,
                   compiler_params=bw._compiler_params(interpret, config.num_warps,
                                                       config.num_stages),
                   name=f"{spec.name}_matmul_tile_major")
    return y if split == 1 else y.sum(axis=0).astype(jnp.bfloat16)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="32b", choices=sorted(kernel_profile.SHAPES))
    parser.add_argument("--shapes", default="", help="comma list of shape names (default all)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--ranks", default="32", help="comma list of LoRA ranks (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="check arguments and exit (CPU)")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    unknown = set(common.split_list(args.variants)) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        smoke()
        return
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    from pallas_kernels import blockwise_matmul as bw
    from pallas_kernels import e2m1_decode

    if jax.default_backend() != "gpu":
        raise SystemExit("decode_cost_probe.py times inline PTX: it needs a GPU backend")
    original = (e2m1_decode._ASM_PAIRED_LO, e2m1_decode._ASM_PAIRED_HI)
    wanted = set(common.split_list(args.shapes))
    shapes = [s for s in kernel_profile.SHAPES[args.model] if not wanted or s[0] in wanted]
    spec = kernel_bench.SPECS["nvfp4"]
    key = jax.random.key(0)
    rows = []
    started = time.perf_counter()
    for name, n, k in shapes:
        ckpt = kernel_bench.random_checkpoint("nvfp4", n, k, jax.random.fold_in(key, 5))
        packed = kernel_bench.repack("nvfp4", ckpt, tile_k=256)
        nbytes = kernel_profile.weight_bytes("nvfp4", n, k)
        count = max(2, math.ceil(kernel_profile.L2_DEFEAT_BYTES / nbytes))
        ws = kernel_bench.copies(packed, count)
        config = bw.default_matmul_config(args.m, packed)
        for rank in (int(r) for r in common.split_list(args.ranks)):
            x, down, lora_b = kernel_profile.layer_inputs(key, args.m, n, k, rank)
            reference = kernel_bench.reference("nvfp4", x, ckpt).astype(jnp.float32)
            if rank:
                reference = reference + 2.0 * jnp.dot(down, lora_b,
                                                      preferred_element_type=jnp.float32)
            for variant in common.split_list(args.variants):
                asms = VARIANTS[variant] or original
                e2m1_decode._ASM_PAIRED_LO, e2m1_decode._ASM_PAIRED_HI = asms
                try:
                    if variant.startswith("tilemajor"):
                        cfg = {"tilemajor_st4": dict(num_stages=4),
                               "tilemajor_bn128": dict(block_n=128),
                               "tilemajor_split2": dict(split_k=2 * config.split_k)
                               }.get(variant, {})
                        cfg = dataclasses.replace(config, **cfg)
                        arrays = [tile_major(w, cfg.block_n) for w in ws]
                        fn = jax.jit(lambda x, arrays, down, lora_b, cfg=cfg: [
                            tile_major_matmul(x, c, s, packed, spec=spec, config=cfg,
                                              down=down, lora_b=lora_b, lora_scale=2.0)
                            for c, s in arrays])
                        call_args = (x, arrays, down, lora_b)
                    else:
                        cfg = config
                        fn = jax.jit(lambda x, ws, down, lora_b: [
                            bw.blockwise_matmul(x, w, spec=spec, config=config, lora_down=down,
                                                lora_b=lora_b, lora_scale=2.0) for w in ws])
                        call_args = (x, ws, down, lora_b)
                    y = fn(*call_args)[0].astype(jnp.float32)
                    error = float(jnp.max(jnp.abs(y - reference)) / jnp.max(jnp.abs(reference)))
                    kernel_us, call_us, _ = kernel_profile.traced_device_us(
                        fn, call_args, args.repeats, count, "nvfp4_matmul")
                finally:
                    e2m1_decode._ASM_PAIRED_LO, e2m1_decode._ASM_PAIRED_HI = original
                rows.append({"shape": name, "n": n, "k": k, "rank": rank, "variant": variant,
                             "config": kernel_profile._short(cfg), "copies": count,
                             "kernel_us": kernel_us, "call_us": call_us,
                             "TB_s": nbytes / call_us / 1e6,
                             "max_rel_err": error if variant in EXACT else None})
                print(rows[-1], flush=True)
        del ws, packed
    text = report(rows, args, time.perf_counter() - started)
    print(text, flush=True)
    common.write_outputs(args.out, f"decode_cost_probe_{args.model}_m{args.m}", text,
                         {"argv": sys.argv, "rows": rows, "jax": jax.__version__,
                          **common.device_info()})


def smoke():
    """CPU check of the tile-major launcher (interpret mode) against blockwise_matmul."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernels as kernel_bench
    from pallas_kernels import blockwise_matmul as bw

    key = jax.random.key(0)
    spec = kernel_bench.SPECS["nvfp4"]
    for n, k, split in ((256, 1024, 1), (128, 2048, 3)):
        ckpt = kernel_bench.random_checkpoint("nvfp4", n, k, jax.random.fold_in(key, n))
        packed = kernel_bench.repack("nvfp4", ckpt, tile_k=256)
        x, down, lora_b = kernel_profile.layer_inputs(key, 8, n, k, 32)
        config = dataclasses.replace(bw.default_matmul_config(8, packed), split_k=split)
        want = bw.blockwise_matmul(x, packed, spec=spec, config=config, interpret=True,
                                   lora_down=down, lora_b=lora_b, lora_scale=2.0)
        codes, scales = tile_major(packed, config.block_n)
        got = tile_major_matmul(x, codes, scales, packed, spec=spec, config=config, down=down,
                                lora_b=lora_b, lora_scale=2.0, interpret=True)
        diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        print(f"tile-major N={n} K={k} split {split}: max abs diff {diff}")
        if diff:
            raise SystemExit("tile-major launch differs from blockwise_matmul")


def report(rows, args, elapsed) -> str:
    header = common.header_line(
        f"NVFP4 fused kernel with cheaper decode asm at M={args.m} ({args.model} shapes; "
        f"trace device time; {elapsed:.0f} s)", [common.device_info()])
    lines = [header, "", "| shape | N x K | LoRA r | variant | config | kernel us | call us | "
             "TB/s | vs asmq | asmq max rel err |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["shape"], r["rank"]): r["call_us"] for r in rows if r["variant"] == "asmq"}
    for r in rows:
        ratio = base.get((r["shape"], r["rank"]), float("nan")) / r["call_us"]
        err = "" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}"
        lines.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['rank']} | {r['variant']} | "
                     f"{r['config']} | {r['kernel_us']:.2f} | {r['call_us']:.2f} | "
                     f"{r['TB_s']:.2f} | {ratio:.2f}x | {err} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
