"""What Triton made of the fused 4-bit matmul: its IR after every compiler pass, per tuning.

For each decode tuning (pallas_kernels.blockwise_matmul.DecodeTuning fields, as in
kernel_profile.py), a worker process compiles one call of the fused kernel on one layer shape
with XLA's Triton pass dump switched on (XLA_FLAGS --xla_dump_to plus the flag that selects the
Triton pass log; which flag this jaxlib knows is looked up in its libraries first, since XLA
aborts on an unknown flag). From each "*.triton-passes.log" the script keeps:

  <tuning>.ttgir   the module right before it is lowered to LLVM (layouts, shared-memory
                   buffers, async copies, MMA ops: what the kernel really does per tile);
  <tuning>.ttir    the module as Pallas handed it over;
  summary.md       per tuning: counts of the ops that tell where the time goes
                   (ttg.convert_layout, ttg.local_alloc / local_load / local_store,
                   async copies, tt.dot / ttng.warp_group_dot, tt.load, inline asm).

GPU only (interpret mode compiles no Triton):
    python benchmarks/triton_ir.py --model 7b --shape gate/up --tunings "base;scale_gather=true" \
        --out $OUT/ir
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

import _common as common

# Ops counted in the final TTGIR (substring match on the op name).
COUNTED_OPS = ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.local_store",
               "ttg.async_copy_global_to_local", "ttg.async_wait", "ttng.warp_group_dot",
               "tt.dot ", "tt.load", "tt.elementwise_inline_asm", "tt.reshape", "tt.broadcast",
               "tt.trans", "ttg.memdesc_trans", "scf.for")
# Candidate XLA flags that switch on the Triton pass log, newest first.
DUMP_FLAGS = (("xla_dump_emitter_re", "triton-fusion"),
              ("xla_dump_hlo_pass_re", "triton-fusion-emitter"))
MARKER = re.compile(r"^// -----// IR Dump (Before|After) (\S+)")


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


def known_dump_flags() -> list[str]:
    """The DUMP_FLAGS this jaxlib's libraries mention (an unknown XLA flag is fatal)."""
    import importlib.util
    roots = []
    for name in ("jaxlib", "jax_cuda13_plugin", "jax_cuda12_plugin"):
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations:
            roots += list(spec.submodule_search_locations)
    libraries = [path for root in roots for path in glob.glob(os.path.join(root, "**", "*.so*"),
                                                             recursive=True)]
    flags = []
    for flag, value in DUMP_FLAGS:
        needle = flag.encode()
        for path in libraries:
            with open(path, "rb") as handle:
                if needle in handle.read():
                    flags.append(f"--{flag}={value}")
                    break
    return flags


def slug(tuning: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", tuning).strip("_") or "base"


def run_worker(args) -> None:
    """Compiles and runs one call of the kernel under the tuning in args.worker."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernel_profile
    import kernels as kernel_bench
    from pallas_kernels import blockwise_matmul as bw

    [(name, n, k)] = [s for s in kernel_profile.SHAPES[args.model] if s[0] == args.shape]
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.fold_in(key, 1), (args.m, k), jnp.bfloat16)
    down = jax.random.normal(jax.random.fold_in(key, 2), (args.m, args.rank), jnp.bfloat16)
    lora_b = 0.01 * jax.random.normal(jax.random.fold_in(key, 3), (args.rank, n), jnp.bfloat16)
    ckpt = kernel_bench.random_checkpoint(args.format, n, k, jax.random.fold_in(key, 5))
    packed = kernel_bench.repack(args.format, ckpt, tile_k=256)
    if args.worker != "base":
        bw.set_decode_tuning(**bw.parse_tuning(args.worker))
    config = bw.default_matmul_config(args.m, packed)
    y = bw.blockwise_matmul(x, packed, spec=kernel_bench.SPECS[args.format], config=config,
                            lora_down=down, lora_b=lora_b, lora_scale=2.0)
    jax.block_until_ready(y)
    print(f"config {config}", flush=True)
    print(f"info {json.dumps(common.device_info())}", flush=True)


def split_passes(text: str) -> list[tuple[str, str, str]]:
    """A pass log -> [(Before|After, pass name, module text)] in order."""
    sections, current, body = [], None, []
    for line in text.splitlines():
        found = MARKER.match(line)
        if found:
            if current:
                sections.append((*current, "\n".join(body)))
            current, body = found.groups(), []
        elif current:
            body.append(line)
    if current:
        sections.append((*current, "\n".join(body)))
    return sections


def final_ttgir(sections) -> str:
    """The module just before the TritonGPU -> LLVM conversion (else the last TTGIR seen)."""
    last = ""
    for when, name, body in sections:
        if when == "Before" and "ToLLVM" in name and "ttg." in body:
            return body
        if "ttg." in body:
            last = body
    return last


def op_counts(ir: str) -> dict[str, int]:
    return {op: ir.count(op) for op in COUNTED_OPS}


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return
    os.makedirs(args.out, exist_ok=True)
    flags = known_dump_flags()
    print(f"dump flags known to this jaxlib: {flags}", flush=True)
    rows = []
    for tuning in [t.strip() for t in args.tunings.split(";") if t.strip()]:
        name = slug(tuning)
        dump_dir = os.path.join(args.out, "dump_" + name)
        env = common.worker_env()
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), f"--xla_dump_to={dump_dir}",
                                     *flags]).strip()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tuning,
                               "--model", args.model, "--shape", args.shape, "--format",
                               args.format, "--m", str(args.m), "--rank", str(args.rank)],
                              env=env, capture_output=True, text=True, timeout=600)
        config = next((line for line in proc.stdout.splitlines() if line.startswith("config")),
                      "")
        row = {"tuning": tuning, "rc": proc.returncode, "config": config[7:]}
        info = [line[5:] for line in proc.stdout.splitlines() if line.startswith("info ")]
        if info:
            row["info"] = json.loads(info[0])
        logs = [path for path in glob.glob(os.path.join(dump_dir, "*.triton-passes.log"))
                if f"{args.format}_matmul" in os.path.basename(path)]
        if proc.returncode or not logs:
            row["error"] = (proc.stderr[-2000:] if proc.returncode
                            else f"no {args.format}_matmul pass log in {dump_dir}: "
                                 f"{sorted(os.listdir(dump_dir))[:20] if os.path.isdir(dump_dir) else 'no dump'}")
            rows.append(row)
            print(row, flush=True)
            continue
        with open(logs[0]) as handle:
            sections = split_passes(handle.read())
        ttgir = final_ttgir(sections)
        with open(os.path.join(args.out, name + ".ttgir"), "w") as handle:
            handle.write(ttgir)
        if sections:
            with open(os.path.join(args.out, name + ".ttir"), "w") as handle:
                handle.write(sections[0][2])
        row.update(passes=len(sections), **op_counts(ttgir))
        rows.append(row)
        print(row, flush=True)
    lines = [common.header_line(f"Triton IR of the fused {args.format} matmul, {args.model} "
                                f"{args.shape}, M={args.m}",
                                [r.get("info", {}) for r in rows]), "",
             "| tuning | config | " + " | ".join(COUNTED_OPS) + " |",
             "|---|---|" + "---|" * len(COUNTED_OPS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tuning']} | failed: {r['error'][-300:]!r} |")
            continue
        lines.append(f"| {r['tuning']} | {r['config']} | "
                     + " | ".join(str(r[op]) for op in COUNTED_OPS) + " |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "summary.md"), "w") as handle:
        handle.write(text + "\n")


if __name__ == "__main__":
    main()
