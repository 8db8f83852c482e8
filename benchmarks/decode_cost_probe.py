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

Session 16 call a: "floor" and "shift3" ran at asmq's time on every 7B and 32B shape, so the
decode's instructions do not limit the kernel. Call b then ran the same kernel on tile-major
copies of the codes and scales (each program's K tiles contiguous in memory): 7-9% faster on
the large shapes, and that storage became the kernel layout (blockwise_matmul.tile_major).

    python benchmarks/decode_cost_probe.py --model 32b --out $OUT
    python benchmarks/decode_cost_probe.py --smoke    # CPU: arguments only
"""

from __future__ import annotations

import argparse
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
            }
EXACT = ("asmq",)  # the variants that compute the real product


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
                             "config": kernel_profile._short(config), "copies": count,
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
    print("decode_cost_probe: GPU-only (inline PTX); arguments checked, nothing run")


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
