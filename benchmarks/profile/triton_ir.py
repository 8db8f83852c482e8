"""What Triton made of the fused 4-bit matmul: its final IR and PTX, per tuning.

Pallas hands XLA a Triton module (custom call __gpu$xla.gpu.triton) and XLA runs Triton's
pipeline on it. For each decode tuning (pallas_kernels.blockwise_matmul.DecodeTuning fields, as
in kernel_profile.py) a worker process compiles one call of the fused kernel on one layer shape
with XLA's dumps on for that module only (--xla_dump_to a temporary folder,
--xla_dump_hlo_module_re, and --xla_dump_emitter_re=.* so that whatever name this XLA gives the
Triton pass log is matched; the log is ~16 MB). From the dump the script keeps:

  <tuning>.ttgir   the module right before it is lowered to LLVM (layouts, shared-memory
                   buffers, async copies, MMA ops: what the kernel does per tile);
  <tuning>.ttir    the module as Pallas handed it over;
  <tuning>.ptx     the PTX, where the dump has it;
  summary.md       per tuning: counts of the TTGIR ops and PTX instructions that tell where the
                   time goes (layout conversions and shared-memory traffic, async copies,
                   mma.sync vs wgmma, barriers, the E2M1 decode's prmt).

GPU only (interpret mode compiles no Triton):
    python benchmarks/profile/triton_ir.py --model 7b --shape gate/up --tunings "base;weight_as_lhs=true" \
        --out $OUT/ir
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# run as a script from benchmarks/profile/: the shared helpers live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as harness  # noqa: E402

# Ops counted in the final TTGIR (substring match).
COUNTED_OPS = ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.local_store",
               "ttg.async_copy_global_to_local", "ttg.async_wait", "ttng.warp_group_dot",
               "tt.dot", "tt.load", "tt.elementwise_inline_asm", "tt.reshape", "tt.broadcast",
               "tt.trans", "ttg.memdesc_trans")
MARKER = re.compile(r"^// -----// IR Dump (Before|After) (\S+)")
DUMP_FLAGS = "--xla_dump_hlo_module_re=.*blockwise.* --xla_dump_emitter_re=.*"
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
    """Compiles and runs one call of the kernel under the tuning in args.worker."""
    import jax

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import kernel_profile
    import _kernel_cases as kernel_cases
    from pallas_kernels import blockwise_matmul as bw

    [(_, n, k)] = [s for s in kernel_profile.SHAPES[args.model] if s[0] == args.shape]
    key = jax.random.key(0)
    x, down, lora_b = kernel_profile.layer_inputs(key, args.m, n, k, args.rank)
    ckpt = kernel_cases.random_checkpoint(args.format, n, k, jax.random.fold_in(key, 5))
    packed = kernel_cases.repack(args.format, ckpt, tile_k=256)
    tuning = bw.DecodeTuning(**({} if args.worker == "base" else bw.parse_tuning(args.worker)))
    config = bw.default_matmul_config(args.m, packed, tuning)
    y = bw.blockwise_matmul(x, packed, spec=kernel_cases.SPECS[args.format], config=config,
                            lora_x_a=down, lora_b=lora_b, lora_scale=2.0 if args.rank else 0.0)
    jax.block_until_ready(y)
    print(f"config {config}", flush=True)
    print(f"info {json.dumps(harness.device_info())}", flush=True)


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
    """Occurrences of each op, in generic ("tt.dot"(...)) or custom (= tt.dot ...) form."""
    return {op: ir.count(f'"{op}"') + ir.count(f"= {op} ") for op in COUNTED_OPS}


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


def collect(dump_dir: str, out: str, name: str) -> dict:
    """Keeps the Triton pass log's final TTGIR and first TTIR, and the PTX, of the kernel in
    dump_dir; returns their op / instruction counts (and which files were found)."""
    files = sorted(glob.glob(os.path.join(dump_dir, "*")))
    # the pass log's name differs between XLA versions (.triton-passes.log, .triton-to-llvm.txt)
    logs = [f for f in files if "triton-passes" in f or "triton-to-llvm" in f]
    ptxs = [f for f in files if f.endswith(".ptx")]
    row = {"dump_files": len(files), "pass_logs": [os.path.basename(f) for f in logs],
           "ptx_files": [os.path.basename(f) for f in ptxs]}
    if logs:
        with open(logs[0]) as handle:
            sections = split_passes(handle.read())
        ttgir = final_ttgir(sections)
        for suffix, text in ((".ttgir", ttgir), (".ttir", sections[0][2] if sections else "")):
            with open(os.path.join(out, name + suffix), "w") as handle:
                handle.write(text)
        row.update(passes=len(sections), **op_counts(ttgir))
    if ptxs:
        ptx = "\n".join(open(f).read() for f in ptxs)
        with open(os.path.join(out, name + ".ptx"), "w") as handle:
            handle.write(ptx)
        row.update(ptx_lines=len(ptx.splitlines()), **instruction_counts(ptx))
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for tuning in [t.strip() for t in args.tunings.split(";") if t.strip()]:
        name = slug(tuning)
        dump_dir = tempfile.mkdtemp(prefix=f"triton_ir_{name}_")
        env = harness.worker_env()
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), f"--xla_dump_to={dump_dir}",
                                     DUMP_FLAGS]).strip()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tuning,
                               "--model", args.model, "--shape", args.shape, "--format",
                               args.format, "--m", str(args.m), "--rank", str(args.rank)],
                              env=env, capture_output=True, text=True, timeout=600)
        lines = proc.stdout.splitlines()
        row = {"tuning": tuning, "rc": proc.returncode,
               "config": next((l[7:] for l in lines if l.startswith("config ")), "")}
        info = [l[5:] for l in lines if l.startswith("info ")]
        if info:
            row["info"] = json.loads(info[0])
        if proc.returncode:
            row["error"] = proc.stderr[-2000:]
        else:
            row.update(collect(dump_dir, args.out, name))
            if not row["pass_logs"] and not row["ptx_files"]:
                row["error"] = (f"no Triton pass log or PTX among the {row['dump_files']} "
                                f"dumped files")
        shutil.rmtree(dump_dir, ignore_errors=True)
        rows.append(row)
        print(row, flush=True)
    counted = list(COUNTED_OPS) + list(COUNTED)
    lines = [harness.header_line(f"Triton IR and PTX of the fused {args.format} matmul, "
                                f"{args.model} {args.shape}, M={args.m} (static counts)",
                                [r.get("info", {}) for r in rows]), "",
             "| tuning | config | " + " | ".join(counted) + " |",
             "|---|---|" + "---|" * len(counted)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tuning']} | failed: {r['error'][-300:]!r} |")
            continue
        lines.append(f"| {r['tuning']} | {r['config']} | "
                     + " | ".join(str(r.get(op, "-")) for op in counted) + " |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "summary.md"), "w") as handle:
        handle.write(text + "\n")


if __name__ == "__main__":
    main()
