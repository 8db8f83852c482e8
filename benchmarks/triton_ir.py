"""What Triton made of the fused 4-bit matmul: its PTX and shared-memory size, per tuning.

JAX >= 0.10.3 compiles a Pallas (Triton) kernel itself, through the CUDA plugin's Triton
compilation handler (jax._src.lib.triton), not inside XLA, so XLA's dump flags never see it. A
worker process per decode tuning (pallas_kernels.blockwise_matmul.DecodeTuning fields, as in
kernel_profile.py) wraps jax._src.lib.triton.compile, compiles one call of the fused kernel on one layer shape
and keeps what the handler returns:

  <tuning>.ptx     the kernel's PTX (tile loop, shared-memory traffic, MMA instructions);
  summary.md       per tuning: the kernel's shared memory and counts of the PTX instructions
                   that tell where the time goes (async copies into shared memory, shared
                   loads/stores and ldmatrix for layout conversions, mma.sync vs wgmma,
                   barriers, global loads, the E2M1 decode's prmt).

GPU only (interpret mode compiles no Triton):
    python benchmarks/triton_ir.py --model 7b --shape gate/up --tunings "base;weight_as_lhs=true" \
        --out $OUT/ir
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import _common as common

# PTX instruction prefixes counted (each line's first token is matched against these).
COUNTED = ("cp.async.cg", "cp.async.ca", "cp.async.wait", "cp.async.bulk", "ld.global",
           "ld.shared", "st.shared", "ldmatrix", "stmatrix", "mma.sync", "wgmma.mma_async",
           "bar.sync", "prmt", "fma.rn.bf16x2", "mul.rn.bf16x2", "cvt")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="7b")
    parser.add_argument("--shape", default="gate/up", help="a shape name of kernel_profile.py")
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank in the epilogue")
    parser.add_argument("--tunings", default="base")
    parser.add_argument("--out", default="triton_ir")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def slug(tuning: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", tuning).strip("_") or "base"


def run_worker(args) -> None:
    """Compiles and runs one call of the kernel under the tuning in args.worker, writing every
    PTX that jax._src.lib.triton.compile returns to args.out/<slug>[.i].ptx and a JSON line per kernel."""
    import jax
    import jax.numpy as jnp
    from jax._src.lib import triton as triton_lib

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernel_profile
    import kernels as kernel_bench
    from pallas_kernels import blockwise_matmul as bw

    jax.devices()  # the CUDA plugin registers its Triton handler when the backend starts
    compile_triton = triton_lib.compile  # what pallas_call's lowering calls (JAX >= 0.10.3)
    compiled = []

    def keep_ptx(*args, **kwargs):
        result = compile_triton(*args, **kwargs)
        asm = result.asm.decode() if isinstance(result.asm, bytes) else result.asm
        compiled.append({"smem_bytes": int(result.smem_bytes), "ptx": asm,
                         **{k: v for k, v in kwargs.items() if isinstance(v, int)}})
        return result

    triton_lib.compile = keep_ptx
    [(_, n, k)] = [s for s in kernel_profile.SHAPES[args.model] if s[0] == args.shape]
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.fold_in(key, 1), (args.m, k), jnp.bfloat16)
    down = jax.random.normal(jax.random.fold_in(key, 2), (args.m, args.rank), jnp.bfloat16)
    lora_b = 0.01 * jax.random.normal(jax.random.fold_in(key, 3), (args.rank, n), jnp.bfloat16)
    ckpt = kernel_bench.random_checkpoint(args.format, n, k, jax.random.fold_in(key, 5))
    packed = kernel_bench.repack(args.format, ckpt, tile_k=256)
    if args.worker != "base":
        bw.set_decode_tuning(**bw.parse_tuning(args.worker))
    config = bw.default_matmul_config(args.m, packed)
    compiled.clear()  # only the matmul's kernels (repack may have compiled others)
    y = bw.blockwise_matmul(x, packed, spec=kernel_bench.SPECS[args.format], config=config,
                            lora_down=down, lora_b=lora_b, lora_scale=2.0)
    jax.block_until_ready(y)
    for i, kernel in enumerate(compiled):
        path = os.path.join(args.out, f"{slug(args.worker)}{'' if i == 0 else f'.{i}'}.ptx")
        with open(path, "w") as handle:
            handle.write(kernel.pop("ptx"))
        print("kernel " + json.dumps({"ptx_file": os.path.basename(path), **kernel}),
              flush=True)
    print(f"config {config}", flush=True)
    print(f"info {json.dumps(common.device_info())}", flush=True)


def instruction_counts(ptx: str) -> dict[str, int]:
    """How many PTX instructions start with each COUNTED prefix (predicates and labels
    skipped)."""
    counts = dict.fromkeys(COUNTED, 0)
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("@"):
            line = line.split(None, 1)[1] if " " in line else ""
        for prefix in COUNTED:
            if line.startswith(prefix):
                counts[prefix] += 1
                break
    return counts


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for tuning in [t.strip() for t in args.tunings.split(";") if t.strip()]:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tuning,
                               "--model", args.model, "--shape", args.shape, "--format",
                               args.format, "--m", str(args.m), "--rank", str(args.rank),
                               "--out", args.out],
                              env=common.worker_env(), capture_output=True, text=True,
                              timeout=600)
        lines = proc.stdout.splitlines()
        row = {"tuning": tuning, "rc": proc.returncode,
               "config": next((l[7:] for l in lines if l.startswith("config ")), "")}
        info = [l[5:] for l in lines if l.startswith("info ")]
        if info:
            row["info"] = json.loads(info[0])
        kernels = [json.loads(l[7:]) for l in lines if l.startswith("kernel ")]
        if proc.returncode or not kernels:
            row["error"] = proc.stderr[-2000:] if proc.returncode else "no Triton kernel compiled"
        else:
            first = kernels[0]
            with open(os.path.join(args.out, first["ptx_file"])) as handle:
                ptx = handle.read()
            row.update(smem_bytes=first["smem_bytes"], ptx_lines=len(ptx.splitlines()),
                       kernels=len(kernels), **instruction_counts(ptx))
        rows.append(row)
        print(row, flush=True)
    lines = [common.header_line(f"PTX of the fused {args.format} matmul, {args.model} "
                                f"{args.shape}, M={args.m} (static instruction counts)",
                                [r.get("info", {}) for r in rows]), "",
             "| tuning | config | smem bytes | PTX lines | " + " | ".join(COUNTED) + " |",
             "|---|---|---|---|" + "---|" * len(COUNTED)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tuning']} | failed: {r['error'][-300:]!r} |")
            continue
        lines.append(f"| {r['tuning']} | {r['config']} | {r['smem_bytes']} | {r['ptx_lines']} | "
                     + " | ".join(str(r[op]) for op in COUNTED) + " |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "summary.md"), "w") as handle:
        handle.write(text + "\n")


if __name__ == "__main__":
    main()
