"""What the GRPO step's two big programs hold: XLA's memory analysis of the sampler program and
of the training micro-batch gradient, per model size and format, with the buffers live at each
program's peak (from XLA's buffer-assignment dump).

The grpo_step.py benchmark measures the allocator's peak over a whole step; this script says which
program and which buffers make it. For each (size, format) it builds the trainer exactly as
grpo_step.py does (random weights, LoRA r32 + norms, remat on, kernels on GPU), then lowers and
compiles, without running:
  * rollout: qerl_jax.sampling's generate program for 1 prompt x G samples (prompt + completion
    cache), on the AQN-noised states the trainer samples with;
  * train: the jitted value-and-grad of one micro-batch, added into the donated gradient sum
    (the trainer's own _grad_fn).
and reports compiled.memory_analysis() (arguments, outputs, aliased, temporaries) plus, with
--dump, the largest values of each program's buffer assignment; with --run, each program also runs once and the
device allocator's in-use, peak and largest allocation are recorded after every stage (the
allocator's peak cannot be reset: one process per command).

    python benchmarks/memory_breakdown.py --sizes 7b --formats nvfp4,bf16 --dump --out $OUT/mem
    python benchmarks/memory_breakdown.py --sizes 7b --run --out $OUT/mem_run   # + allocator
    python benchmarks/memory_breakdown.py --smoke --out /tmp/mem     # CPU, tiny model

Any other choice is a field of the trainer's config, set with --config.FIELD=VALUE (e.g.
--config.model.attention_implementation=xla, --config.quant.kernels.gate_up_pairs=false).
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import re
import shutil
import tempfile
import time

import _harness as harness
import _models as models

PROGRAM_PATTERNS = {"rollout": "_generate_program", "train": "accumulate_gradient"}  # Trainer._grad_fn


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="7b")
    parser.add_argument("--formats", default="nvfp4,bf16")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--dump", action="store_true",
                        help="dump XLA's buffer assignment and list its largest values")
    parser.add_argument("--top", type=int, default=25, help="largest values listed per program")
    parser.add_argument("--run", action="store_true",
                        help="also run each program once and record the device allocator's "
                             "in-use / peak / largest allocation after each stage")
    parser.add_argument("--kernels-interpret", action="store_true",
                        help="CPU: the Pallas kernels in interpret mode (the kernel layout, "
                             "the dispatch's paths), as grpo_step.py --kernels-interpret")
    parser.add_argument("--smoke", action="store_true", help="tiny model (CPU test)")
    parser.add_argument("--out", required=True)
    parser.epilog = harness.OVERRIDES_HELP
    args = harness.parse_arguments(parser, argv)
    if args.smoke:
        args.sizes, args.group, args.prompt, args.completion = "tiny", 4, 32, 8
    tokenizer = models.char_tokenizer_dir(os.path.join(os.path.abspath(args.out), "tokenizer"))
    args.configs = {}
    for size in harness.split_list(args.sizes):
        for format_name in harness.split_list(args.formats):
            base = models.grpo_config(
                preset=models.preset_name(size), format_name=format_name,
                tokenizer_dir=tokenizer, rank=args.rank, group=args.group, prompts=1,
                prompt=args.prompt, completion=args.completion, micro_batch=args.micro_batch,
                steps=1)
            args.configs[size, format_name] = models.configured(parser, base, args.overrides,
                                                                FLAG_FIELDS)
    return args


# the config fields the shape flags set (an override of one of them is refused)
FLAG_FIELDS = {"model.preset": "--sizes", "quant.format": "--formats", "lora.rank": "--rank",
               "rollout.num_generations": "--group", "data.max_prompt_length": "--prompt",
               "rollout.prompt_bucket": "--prompt", "rollout.max_new_tokens": "--completion",
               "train.micro_batch_size": "--micro-batch"}


def largest_values(assignment_path: str, top: int) -> list[tuple[int, str]]:
    """(bytes, description) of the largest logical values in a buffer-assignment dump."""
    pattern = re.compile(r"value: <\d+ (\S+) @\S*> \(size=(\d+),offset=\d+\): (.*)$")
    found = {}
    with open(assignment_path) as handle:
        for line in handle:
            match = pattern.search(line)
            if match:
                name, size, shape = match.group(1), int(match.group(2)), match.group(3)
                found[name] = (size, f"{name}: {shape.strip()[:120]}")
    return sorted(found.values(), reverse=True)[:top]


def dump_summary(dump_dir: str, pattern: str, top: int) -> dict:
    """{"largest_values": [...]} of the program whose module name contains `pattern`."""
    assignments = sorted(glob.glob(os.path.join(dump_dir,
                                                f"*{pattern}*buffer-assignment.txt")))
    if not assignments:
        return {"largest_values": []}
    return {"largest_values": [f"{size / 2**20:.1f} MiB {text}" for size, text in
                               largest_values(assignments[-1], top)]}


def analysis_row(compiled) -> dict:
    analysis = compiled.memory_analysis()
    row = {}
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "temp_size_in_bytes", "generated_code_size_in_bytes",
                  "peak_memory_in_bytes"):
        value = getattr(analysis, field, None)
        if value is not None:
            row[field.replace("_size_in_bytes", "").replace("_in_bytes", "") + "_GiB"] = (
                value / 2**30)
    return row


def allocator_stats() -> dict:
    """The device allocator's bytes in use, peak and largest single allocation (GiB)."""
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return {name: stats[key] / 2**30 for name, key in (
        ("in_use_GiB", "bytes_in_use"), ("peak_GiB", "peak_bytes_in_use"),
        ("largest_alloc_GiB", "largest_alloc_size")) if key in stats}


def run_case(size: str, format_name: str, args, dump_dir: str | None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from qerl_jax import sampling, trainer as trainer_module
    from qerl_jax.aqn import aqn_noisy_state

    workdir = tempfile.mkdtemp(prefix="memory_breakdown_")
    config = args.configs[size, format_name]
    original_build_model = trainer_module.build_model
    if args.kernels_interpret:   # the trainer enables the kernels on a GPU only
        trainer_module.build_model = functools.partial(original_build_model, interpret=True)
    try:
        trainer = trainer_module.Trainer(config, os.path.join(workdir, "run"))
    finally:
        trainer_module.build_model = original_build_model
    base = {"size": size, "format": format_name,
            "attention": trainer.model().config.attention_implementation,
            "gate_up_pairs": config.quant.kernels.gate_up_pairs,
            "kernels": "interpret" if args.kernels_interpret else "on a GPU only",
            "weights_GiB": harness.state_gib(trainer.frozen),
            "trainable_GiB": harness.state_gib(trainer.trainable),
            "opt_state_GiB": harness.state_gib(trainer.opt_state), **harness.device_info()}
    rows = []
    stages = [("trainer built", allocator_stats())]

    tokens = jnp.ones((1, args.prompt), jnp.int32)
    mask = jnp.ones((1, args.prompt), jnp.bool_)
    begin = time.perf_counter()
    lowered = sampling._generate_program.lower(
        trainer.graphdef, tuple(trainer._rollout_states()), tokens, mask, jax.random.key(0),
        config=trainer.sampling, cache_length=args.prompt + args.completion)
    compiled = lowered.compile()
    rows.append({**base, "program": "rollout", "compile_s": time.perf_counter() - begin,
                 **analysis_row(compiled)})
    stages.append(("rollout compiled", allocator_stats()))
    if args.run:
        # the compiled program takes the non-static arguments only
        jax.block_until_ready(compiled(tuple(trainer._rollout_states()), tokens, mask,
                                       jax.random.key(0)))
        stages.append(("rollout run", allocator_stats()))

    length = args.prompt + args.completion
    micro = {"tokens": jnp.ones((args.micro_batch, length), jnp.int32),
             "attention_mask": jnp.ones((args.micro_batch, length), jnp.bool_),
             "completion_tokens": jnp.ones((args.micro_batch, args.completion), jnp.int32),
             "loss_mask": jnp.ones((args.micro_batch, args.completion), jnp.bool_),
             "advantages": jnp.asarray(np.linspace(-1, 1, args.micro_batch), jnp.float32),
             "rollout_logprobs": jnp.zeros((args.micro_batch, args.completion), jnp.float32)}
    frozen = trainer.frozen
    if trainer.aqn_schedule is not None and config.aqn.apply_in_training:
        frozen = aqn_noisy_state(frozen, trainer.aqn_key, 0, trainer.aqn_schedule)
    begin = time.perf_counter()
    totals = (jnp.asarray(float(args.micro_batch * args.completion)),
              jnp.asarray(float(args.micro_batch)))
    grad_sum = trainer._zero_grads(trainer.trainable)   # donated: the program adds into it
    compiled = trainer._grad_fn.lower(trainer.trainable, frozen, micro, *totals,
                                      grad_sum).compile()
    rows.append({**base, "program": "train micro-batch", "compile_s": time.perf_counter() - begin,
                 **analysis_row(compiled)})
    stages.append(("train compiled", allocator_stats()))
    if args.run:
        jax.block_until_ready(compiled(trainer.trainable, frozen, micro, *totals, grad_sum))
        stages.append(("train micro-batch run", allocator_stats()))
    for row in rows:
        row["allocator_stages"] = stages
    if dump_dir:
        for row, key in zip(rows, ("rollout", "train")):
            row.update(dump_summary(dump_dir, PROGRAM_PATTERNS[key], args.top))
    trainer.checkpoints.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return rows


COLUMNS = [("size", "size"), ("format", "format"), ("attention", "attention"),
           ("program", "program"), ("kernels", "Pallas kernels"),
           ("gate_up_pairs", "gate/up pairs"),
           ("weights_GiB", "weights GiB"), ("argument_GiB", "arguments GiB"),
           ("output_GiB", "outputs GiB"), ("alias_GiB", "aliased GiB"),
           ("temp_GiB", "temporaries GiB"), ("peak_memory_GiB", "XLA peak GiB"),
           ("compile_s", "compile s")]


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dump_dir = None
    if args.dump:
        dump_dir = os.path.join(args.out, "xla_dump")
        patterns = "|".join(f".*{p}.*" for p in PROGRAM_PATTERNS.values())
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [
            os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump_dir}",
            f"--xla_dump_hlo_module_re={patterns}", "--xla_dump_hlo_pass_re=^$"]))
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", harness.DEFAULT_MEMORY_FRACTION)
    rows = []
    for size in harness.split_list(args.sizes):
        for format_name in harness.split_list(args.formats):
            if dump_dir:
                shutil.rmtree(dump_dir, ignore_errors=True)
            rows.extend(run_case(size, format_name, args, dump_dir))
            print({k: rows[-1].get(k) for k in ("size", "format", "temp_GiB")}, flush=True)
    lines = [harness.header_line("Memory analysis of the GRPO step's programs (compiled, not run)",
                                rows), "",
             harness.markdown_table(rows, COLUMNS)]
    seen = set()
    for row in rows:
        case = (row["size"], row["format"])
        if row.get("allocator_stages") and case not in seen:
            seen.add(case)
            lines += ["", f"### {case[0]} {case[1]}: device allocator after each stage (GiB)", "",
                      "| stage | in use | peak so far | largest allocation |", "|---|---|---|---|"]
            lines += [f"| {stage} | {harness.fmt_number(stats.get('in_use_GiB'))} | "
                      f"{harness.fmt_number(stats.get('peak_GiB'))} | "
                      f"{harness.fmt_number(stats.get('largest_alloc_GiB'))} |"
                      for stage, stats in row["allocator_stages"]]
    for row in rows:
        if row.get("largest_values"):
            lines += ["", f"### {row['size']} {row['format']} {row['program']}: largest values "
                      "in XLA's buffer assignment", ""]
            lines += [f"- {entry}" for entry in row["largest_values"]]
    text = "\n".join(lines) + "\n"
    print(text)
    name = f"memory_breakdown_{'_'.join(harness.split_list(args.sizes))}"
    harness.write_outputs(args.out, name, text, {"rows": rows, "args": {
        key: value for key, value in vars(args).items() if key != "configs"}})
    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)   # the summaries above keep what matters


if __name__ == "__main__":
    main()
