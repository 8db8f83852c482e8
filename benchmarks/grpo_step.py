"""GRPO step time (rollout + train) and peak memory per model size and format.

For each model size (Qwen2.5-7B/14B/32B shapes, random weights) and format (bf16-LoRA / nf4 /
nvfp4), one worker subprocess (so the peak memory is the case's own) builds the qerl_jax Trainer
(char-level tokenizer, arithmetic prompts left-padded to --prompt tokens, --completion new
tokens, G = --group samples of each of --prompts prompts (default 1), LoRA rank --rank on all
projections + norm scales, remat on, micro-batch --micro-batch, AQN on for nvfp4/mxfp4 as in
QeRL) on the config.mesh device mesh (default one device) and runs --steps
train_step calls. Step 0 includes the compiles (reported separately as compile + run); the last
step is the measurement, and every step after step 0 is listed (later_steps_rollout_s /
later_steps_train_s in the jsonl) for the spread. A random model almost never samples EOS, so
completions run to the limit (the completion-length column shows it).

The model is the trainer's own: qerl_jax.model_setup.build_model draws and quantizes one projection
at a time (no dense bf16 copy of the model) and enables the Pallas kernels on GPU
(--config.quant.kernels.enabled=false keeps the XLA path). The benchmark wraps build_model only
to time it, to record which path the kernels took, and to pass --kernels-interpret on (Pallas
interpret mode on a CPU).

Every choice other than the shapes is a field of the trainer's config (qerl_jax/
experiment_config.py; `python -m qerl_jax.train --help` lists them), set with
--config.FIELD=VALUE and validated before any worker starts: the mesh (config.mesh.*), the
kernels (config.quant.kernels.*), the attention (config.model.attention_implementation), the
log-prob chunk (config.train.logits_chunk_size), the compilation cache
(config.compilation_cache_dir), the weights' offload while the sampler compiles
(config.rollout.offload_weights_for_compile, offload_method).

The parent never touches the GPU; workers run one after the other under --budget-s; a worker
that would not fit is skipped, one still running at the deadline is killed (finished steps are
kept). OOM or errors are recorded per case.

    python benchmarks/grpo_step.py --sizes 7b --out $OUT
    python benchmarks/grpo_step.py --sizes 32b --formats nvfp4 --steps 3 --out $OUT
    python benchmarks/grpo_step.py --sizes 7b --formats nvfp4 --trace-peaks \
        --config.compilation_cache_dir=DIR --out $OUT
    python benchmarks/grpo_step.py --smoke --out /tmp/grpo_step_smoke   # CPU, tiny model

On several devices (config.mesh; qerl_jax/parallel/mesh.py), e.g. data parallel on 2 GPUs with
one prompt per GPU, or FSDP x tensor:

    python benchmarks/grpo_step.py --sizes 7b --formats nvfp4 --config.mesh.data=2 \
        --prompts 2 --micro-batch 4 --out $OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/grpo_step.py --smoke \
        --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2 --prompts 2 \
        --micro-batch 8 --out /tmp/grpo_mesh_smoke

The rows record the mesh and the device count; "rollout tok/s per device" divides the rollout
throughput by it. On a mesh of several devices the Pallas kernels run per device on its rows
(qerl_jax/parallel/sharded_backend.py); where the mesh splits the weights (fsdp or tensor > 1) the
quantized matmuls take the XLA path and only the decode attention is a kernel
(qerl_jax/model_setup.py). Rows are split over data x fsdp only where the counts divide (P
prompts for the prefill, P*G rollouts, --micro-batch training rows); otherwise those arrays are
replicated.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import _harness as harness
import _models as models

DEFAULTS = dict(sizes="7b", formats="bf16,nvfp4,nf4", group=8, prompt=256, completion=1024,
                micro_batch=2, steps=2, budget_s=540.0)
SMOKE = dict(sizes="tiny", formats="bf16,nvfp4", group=4, prompt=32, completion=8,
             micro_batch=4, steps=2, budget_s=240.0)
AQN_FORMATS = ("nvfp4", "mxfp4")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help=f"comma list of 7b,14b,32b; default {DEFAULTS['sizes']}")
    parser.add_argument("--formats", help=f"default {DEFAULTS['formats']} (run in this order)")
    parser.add_argument("--group", type=int, help="G samples per prompt (--prompts prompts per step)")
    parser.add_argument("--prompt", type=int, help="prompt tokens (padded bucket)")
    parser.add_argument("--completion", type=int, help="new tokens per sample")
    parser.add_argument("--micro-batch", type=int, help="training micro-batch (sequences)")
    parser.add_argument("--steps", type=int, help="train steps per case (>= 2: the first "
                                                  "compiles)")
    parser.add_argument("--budget-s", type=float, help="wall-clock budget of the command")
    parser.add_argument("--rank", type=int, default=32,
                        help="LoRA rank: config.lora.rank, and config.lora.alpha = rank")
    parser.add_argument("--prompts", type=int, default=1,
                        help="prompts per step (P; P * G rollouts): scale it with the data "
                             "axis for the same work per device")
    parser.add_argument("--trace-peaks", action="store_true",
                        help="wait for each of the trainer's jitted calls (rollout, gradient, "
                             "accumulation, update) and record the ones that raised the "
                             "allocator's peak (the peak_trace column of the JSON): which "
                             "program sets the step's peak. Slows the step slightly.")
    parser.add_argument("--smoke", action="store_true")
    harness.add_worker_arguments(parser, "grpo_step")
    parser.epilog = harness.OVERRIDES_HELP
    args = harness.parse_arguments(parser, argv)
    for name, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if not args.merge:
        args.configs, args.tag = case_configs(parser, args)
        first = next(iter(args.configs.values()))
        args.mesh_shape = {axis: first.mesh[axis] for axis in MESH_AXES}
        args.mesh = ("" if math.prod(args.mesh_shape.values()) == 1 else
                     ",".join(f"{axis}={size}" for axis, size in args.mesh_shape.items()))
    return args


MESH_AXES = ("data", "fsdp", "tensor")
# the config fields the shape flags set (an override of one of them is refused)
FLAG_FIELDS = {"model.preset": "--sizes", "quant.format": "--formats", "lora.rank": "--rank",
               "rollout.num_generations": "--group", "train.prompts_per_step": "--prompts",
               "data.max_prompt_length": "--prompt", "rollout.prompt_bucket": "--prompt",
               "rollout.max_new_tokens": "--completion",
               "train.micro_batch_size": "--micro-batch", "train.total_steps": "--steps"}


def case_configs(parser, args) -> tuple[dict, str]:
    """({(size, format): validated trainer config} of the cases this process runs (a worker:
    its own), the output-name tag of the overrides)."""
    sizes = [args.size] if args.worker else harness.split_list(args.sizes)
    formats = [args.format] if args.worker else harness.split_list(args.formats)
    tokenizer = models.char_tokenizer_dir(os.path.join(os.path.abspath(args.out),
                                                       "grpo_step_raw", "tokenizer"))
    configs, tag = {}, ""
    for size in sizes:
        for format_name in formats:
            base = models.grpo_config(
                preset=models.preset_name(size), format_name=format_name,
                tokenizer_dir=tokenizer, rank=args.rank, group=args.group,
                prompts=args.prompts, prompt=args.prompt, completion=args.completion,
                micro_batch=args.micro_batch, steps=args.steps,
                aqn=format_name in AQN_FORMATS)
            config = models.configured(parser, base, args.overrides, FLAG_FIELDS)
            configs[size, format_name] = config
            tag = tag or models.config_tag(config, base)
    return configs, tag


# ============================================================================== worker
def worker_main(args) -> None:
    import logging
    import shutil
    import tempfile

    from qerl_jax import trainer as trainer_module
    from qerl_jax.infra.compilation_cache import cache_entries

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        force=True)   # JAX may have configured the root logger already
    size, format_name = args.size, args.format
    config = args.configs[size, format_name]
    row = {"size": size, "preset": models.preset_name(size), "format": format_name,
           "aqn": config.aqn.enabled, "group": args.group,
           "prompt": args.prompt, "completion": args.completion,
           "micro_batch": args.micro_batch, "lora_rank": config.lora.rank, "steps_done": 0,
           "prompts": args.prompts,
           "mesh": ",".join(f"{k}={v}" for k, v in args.mesh_shape.items()),
           "mesh_devices": math.prod(args.mesh_shape.values()), **harness.device_info()}

    def emit(status):
        row["status"] = status
        row["elapsed_s"] = time.time() - args.spawned_at
        harness.append_jsonl(args.results, row)
        print({k: row.get(k) for k in ("size", "format", "status", "steps_done", "step_s",
                                       "peak_GiB")}, flush=True)

    workdir = tempfile.mkdtemp(prefix="grpo_step_")
    original_build_model = trainer_module.build_model

    def build_model_for_benchmark(config, run_dir, *, mesh=None):
        begin = time.perf_counter()
        model, tokenizer = original_build_model(config, run_dir, mesh=mesh,
                                                interpret=args.kernels_interpret)
        row["build_model_s"] = time.perf_counter() - begin
        row["peak_after_build_GiB"], _ = harness.peak_memory_gib()
        row.update(models.kernel_report(model, config, interpret=args.kernels_interpret,
                                        mesh=mesh))
        row["params_B"] = model.config.num_parameters() / 1e9
        row["attention"] = model.config.attention_implementation
        return model, tokenizer

    trainer_module.build_model = build_model_for_benchmark
    trainer = None
    try:
        if config.compilation_cache_dir:
            entries = cache_entries(config.compilation_cache_dir)
            row["compilation_cache"] = f"warm ({entries} files)" if entries else "cold"
        row["logits_chunk"] = config.train.logits_chunk_size
        row["compact_after_repack"] = config.quant.kernels.compact_after_repack
        begin = time.perf_counter()
        trainer = trainer_module.Trainer(config, os.path.join(workdir, "run"))
        row["trainer_init_s"] = time.perf_counter() - begin
        row["offload_for_compile"] = (config.rollout.offload_method
                                      if trainer.offload_weights_for_compile else "off")
        if "build_model_s" not in row:
            raise RuntimeError("Trainer did not call qerl_jax.trainer.build_model: the "
                               "benchmark's model building (and its kernel record) did not run")
        row["weights_GiB"] = harness.state_gib(trainer.frozen)
        row["trainable_GiB"] = harness.state_gib(trainer.trainable)
        row["opt_state_GiB"] = harness.state_gib(trainer.opt_state)
        row["peak_after_init_GiB"], row["peak_source"] = harness.peak_memory_gib()
        row["memory_limit_GiB"] = harness.memory_limit_gib()
        active = row.get("kernels_active", False)
        row["path_decode"] = models.matmul_path(format_name, args.group, active)
        row["path_prefill"] = models.matmul_path(format_name, args.prompt, active)
        row["path_train"] = models.matmul_path(
            format_name, args.micro_batch * (args.prompt + args.completion), active)
    except Exception as error:
        row["peak_GiB"], _ = harness.peak_memory_gib()
        emit("init " + harness.describe_error(error))
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    # the allocator's peak cannot be reset: record it after step 0's rollout too, which splits
    # the step's peak into the rollout phase and the training phase
    collect_rollouts = trainer._collect_rollouts

    def collect_and_record_peak():
        result = collect_rollouts()
        if "peak_after_rollout0_GiB" not in row:
            row["peak_after_rollout0_GiB"], _ = harness.peak_memory_gib()
        return result

    trainer._collect_rollouts = collect_and_record_peak
    if args.trace_peaks:
        _trace_peaks(trainer, row)
    status = "ok"
    for step in range(args.steps):
        if step > 0:
            # step 0 = compile + run; a later step is expected to take well under that
            needed = 0.6 * (row["step0_rollout_s"] + row["step0_train_s"])
            left = args.deadline - time.time()
            if needed > left:
                status = (f"stopped after step {step - 1}: budget (step {step} needs "
                          f"~{needed:.0f} s, {max(left, 0):.0f} s left)")
                break
        try:
            metrics = trainer.train_step()   # advances trainer.step
        except Exception as error:
            status = f"step {step} " + harness.describe_error(error)
            traceback.print_exc()   # the worker's log keeps the whole of it
            break
        prefix = "step0" if step == 0 else "step"
        row[f"{prefix}_rollout_s"] = metrics["time/rollout_s"]
        row[f"{prefix}_train_s"] = metrics["time/train_s"]
        row[f"{prefix}_s"] = metrics["time/rollout_s"] + metrics["time/train_s"]
        row[f"{prefix}_tokens_per_s"] = metrics["rollout_tokens_per_s"]
        row[f"{prefix}_tokens_per_s_per_device"] = (metrics["rollout_tokens_per_s"]
                                                    / row["mesh_devices"])
        row[f"{prefix}_sampler_compile_s"] = metrics["time/sampler_compile_s"]
        if step > 0:  # every later step, so several steps give a spread, not one sample
            row.setdefault("later_steps_rollout_s", []).append(metrics["time/rollout_s"])
            row.setdefault("later_steps_train_s", []).append(metrics["time/train_s"])
        row["completion_length"] = metrics["completion_length"]
        row["loss"] = metrics["loss"]
        row["steps_done"] = step + 1
        row["peak_GiB"], _ = harness.peak_memory_gib()
        if step == 0 and args.steps > 1:
            harness.append_jsonl(args.results, {**row, "status": "partial: step 0 only",
                                               "elapsed_s": time.time() - args.spawned_at})
    row["peak_GiB"], _ = harness.peak_memory_gib()
    if status == "ok" and args.steps == 1:
        status = "ok (1 step: includes compile)"
    emit(status)
    trainer.checkpoints.close()
    shutil.rmtree(workdir, ignore_errors=True)


# ============================================================================== parent
def _trace_peaks(trainer, row) -> None:
    """Wraps the trainer's jitted calls: after each (waited for), when the allocator's peak rose,
    appends [step, call, peak GiB, in use GiB] to row["peak_trace"]; after the first call of each
    name in step 0 (and once before it), appends to row["memory_trace"] what is in use against
    what live arrays hold, and the largest arrays the trainer's state does not own (the time
    this takes, inside step 0, is row["memory_trace_s"])."""
    import jax
    trace = row.setdefault("peak_trace", [])
    accounts = row.setdefault("memory_trace", [])
    last = [harness.peak_memory_gib()[0]]
    seen = set()

    def account(step, name):
        stats = jax.devices()[0].memory_stats() or {}
        owned, unowned = _live_array_bytes(trainer)
        accounts.append({
            "step": step, "after": name,
            "in_use_GiB": round(stats.get("bytes_in_use", 0) / 2**30, 4),
            "peak_GiB": round(stats.get("peak_bytes_in_use", 0) / 2**30, 4),
            "state_arrays_GiB": round(owned / 2**30, 4),
            "other_arrays_GiB": round(sum(size for _, size in unowned.values()) / 2**30, 4),
            "other_arrays": sorted(([key, count, round(size / 2**30, 4)]
                                    for key, (count, size) in unowned.items()),
                                   key=lambda item: -item[2])[:10]})

    def wrap(name, fn):
        def traced(*args, **kwargs):
            result = jax.block_until_ready(fn(*args, **kwargs))
            stats = jax.devices()[0].memory_stats() or {}
            peak = stats.get("peak_bytes_in_use", 0) / 2**30
            if peak > last[0] + 1e-3:
                trace.append([trainer.step, name, round(peak, 3),
                              round(stats.get("bytes_in_use", 0) / 2**30, 3)])
                last[0] = peak
            if trainer.step == 0 and name not in seen:   # step 0 only: later steps' times
                seen.add(name)                             # stay free of the accounting
                begun = time.perf_counter()
                account(trainer.step, name)
                row["memory_trace_s"] = (row.get("memory_trace_s", 0.0)
                                         + time.perf_counter() - begun)
            return result
        return traced

    for name in ("_collect_rollouts", "_zero_grads", "_grad_fn", "_scale", "_apply_update",
                 "_logprobs_fn"):
        setattr(trainer, name, wrap(name, getattr(trainer, name)))
    account(0, "trainer set-up")


def _live_array_bytes(trainer) -> tuple[int, dict]:
    """(bytes on device 0 of the live arrays in the trainer's weights, adapters, optimizer state
    and reference adapters; {dtype[shape]: (count, bytes)} of every other live array), each
    device buffer counted once (several jax.Arrays may hold one buffer: committed copies, an
    array and its shards)."""
    import jax
    device = jax.devices()[0]
    owned_ids = {id(leaf) for tree in (trainer.frozen, trainer.trainable, trainer.opt_state,
                                       trainer.reference_trainable)
                 for leaf in jax.tree_util.tree_leaves(tree)}
    arrays = sorted(jax.live_arrays(), key=lambda array: id(array) not in owned_ids)
    seen, owned, others = set(), 0, {}
    for array in arrays:   # the state's arrays first: a buffer they share is theirs
        size = 0
        for shard in array.addressable_shards:
            if shard.device != device:
                continue
            try:
                pointer = shard.data.unsafe_buffer_pointer()
            except Exception:   # no raw buffer to name (e.g. typed PRNG keys): its own
                pointer = ("array", id(array))
            if pointer not in seen:
                seen.add(pointer)
                size += shard.data.nbytes
        if id(array) in owned_ids:
            owned += size
        elif size:
            key = f"{array.dtype}{list(array.shape)}"
            count, total = others.get(key, (0, 0))
            others[key] = (count + 1, total + size)
    return owned, others


COLUMNS = [("size", "size"), ("format", "format"), ("aqn", "AQN"), ("mesh", "mesh"),
           ("prompts", "prompts"), ("status", "status"),
           ("step0_rollout_s", "step 0 rollout s (compile+run)"),
           ("step0_train_s", "step 0 train s (compile+run)"),
           ("step_rollout_s", "rollout s"), ("step_train_s", "train s"), ("step_s", "step s"),
           ("later_steps_s", "step s, every step after step 0"),
           ("speedup_vs_bf16", "x bf16 (step)"), ("step_tokens_per_s", "rollout tok/s"),
           ("step_tokens_per_s_per_device", "rollout tok/s per device"),
           ("completion_length", "completion length"), ("peak_GiB", "peak GiB"),
           ("peak_vs_bf16", "peak / bf16 peak"),
           ("peak_after_rollout0_GiB", "peak after step-0 rollout GiB"),
           ("compilation_cache", "compilation cache"),
           ("logits_chunk", "log-prob chunk"), ("attention", "training attention"),
           ("weights_GiB", "weights GiB"),
           ("trainer_init_s", "init s"), ("compact_after_repack", "compact after repack"),
           ("path_decode", "decode path"),
           ("path_train", "train path"), ("kernel_hook", "kernel hook"),
           ("kernel_layout_weights", "weights in kernel layout"),
           ("mosaic_weights", "weights on the Mosaic GPU path")]


def _final(rows, size, format_name):
    for row in rows:
        if (row["size"], row["format"]) == (size, format_name) and row.get("step_s"):
            return row
    return None


def targets(rows) -> list[str]:
    lines = []

    def verdict(ok):
        return "MET" if ok else "not met"

    case = next((row for row in rows if (row["size"], row["format"]) == ("32b", "nvfp4")), None)
    if case is not None:
        fits = bool(case.get("step_s")) and not case["status"].startswith(("step", "init"))
        lines.append(f"32B NVFP4 GRPO step fits on one H100 80GB: status '{case['status']}', "
                     f"peak {harness.fmt_number(case.get('peak_GiB'))} GiB of "
                     f"{harness.fmt_number(case.get('memory_limit_GiB'))} GiB usable -> "
                     f"{verdict(fits)}")
    nv, bf = _final(rows, "7b", "nvfp4"), _final(rows, "7b", "bf16")
    if nv and bf:
        ratio = bf["step_s"] / nv["step_s"]
        lines.append(f"7B NVFP4 step >= 1.3x faster than bf16-LoRA: x{ratio:.2f} "
                     f"({nv['step_s']:.1f} s vs {bf['step_s']:.1f} s) -> {verdict(ratio >= 1.3)}"
                     f" (paper, 7B batch 8: x1.2)")
    for size in sorted({row["size"] for row in rows}):
        nv, bf = _final(rows, size, "nvfp4"), _final(rows, size, "bf16")
        if nv and bf and nv.get("peak_GiB") and bf.get("peak_GiB"):
            ratio = nv["peak_GiB"] / bf["peak_GiB"]
            lines.append(f"{size.upper()} NVFP4 peak <= 50% of bf16-LoRA's: "
                         f"{nv['peak_GiB']:.1f} / {bf['peak_GiB']:.1f} GiB = {ratio:.0%} -> "
                         f"{verdict(ratio <= 0.5)}")
    return lines or ["(no case of a target was measured)"]


def parent_main(args) -> None:
    budget = harness.Budget(args.budget_s)
    sizes = harness.split_list(args.sizes)
    formats = harness.split_list(args.formats)
    raw_dir = os.path.join(args.out, "grpo_step_raw")
    os.makedirs(raw_dir, exist_ok=True)
    rows: list[dict] = []
    for size in sizes:
        worker_costs: list[float] = []
        for format_name in formats:
            tag = f"{size}_{format_name}"
            results = os.path.join(raw_dir, f"{tag}.jsonl")
            if os.path.exists(results):
                os.remove(results)
            needed, left = max(worker_costs, default=0.0), budget.left()
            if needed > left or left < 5:
                rows.append({"size": size, "format": format_name,
                             "status": f"skipped: budget ({max(left, 0):.0f} s left"
                                       + (f"; a case took ~{needed:.0f} s)" if needed
                                          else ")")})
                continue
            command = [sys.executable, os.path.abspath(__file__), "--worker", "--size", size,
                       "--format", format_name, "--group", str(args.group),
                       "--prompt", str(args.prompt), "--completion", str(args.completion),
                       "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
                       "--rank", str(args.rank), "--prompts", str(args.prompts),
                       *(["--trace-peaks"] if args.trace_peaks else []),
                       *(["--kernels-interpret"] if args.kernels_interpret else []),
                       "--results", results, "--deadline", str(budget.deadline),
                       "--out", os.path.abspath(args.out), "--spawned-at", str(time.time()),
                       *args.overrides]
            print(f"[grpo_step] {tag}: starting worker ({left:.0f} s of budget left)", flush=True)
            log = os.path.join(raw_dir, f"{tag}.log")
            code, wall = harness.run_worker(command, log, left,
                                           devices=math.prod(args.mesh_shape.values()))
            got = harness.read_jsonl(results)
            row = got[-1] if got else {"size": size, "format": format_name}
            if code is None:
                row["status"] = (f"killed at the budget deadline after {wall:.0f} s"
                                 + (f" ({row['steps_done']} step(s) done)"
                                    if row.get("steps_done") else ""))
            elif not got:
                row["status"] = f"worker exited with code {code} before any result"
            if code is not None and row.get("step_s"):
                worker_costs.append(wall)
            if code != 0:
                outcome = "killed" if code is None else f"rc={code}"
                print(f"[grpo_step] {tag}: worker {outcome} after {wall:.0f} s; log tail:\n"
                      f"{harness.tail(log)}", flush=True)
            rows.append(row)
    report(rows, args, harness.output_name("grpo_step", sizes, args.tag))


def report(rows: list[dict], args, name: str) -> None:
    """Ratios to bf16, the table and the targets -> {out}/{name}.md/.json."""
    for row in rows:
        bf = _final(rows, row["size"], "bf16")
        if bf and row.get("step_s"):
            row["speedup_vs_bf16"] = bf["step_s"] / row["step_s"]
        if bf and row.get("peak_GiB"):
            row["peak_vs_bf16"] = row["peak_GiB"] / bf["peak_GiB"]
        rollouts, trains = row.get("later_steps_rollout_s"), row.get("later_steps_train_s")
        if rollouts and trains:
            row["later_steps_s"] = " / ".join(f"{a + b:.2f}" for a, b in zip(rollouts, trains))
    header = harness.header_line(
        f"GRPO step (rollout + train), random weights, {args.prompts} prompt(s) x "
        f"G={args.group}, mesh {args.mesh or 'one device'}, prompt "
        f"{args.prompt}, completion {args.completion}, LoRA r{args.rank} (+ norm scales), "
        f"micro-batch {args.micro_batch}, remat on; last of "
        f"{args.steps} steps reported, step 0 = compile + run", rows)
    notes = ["", ("Peak memory: the device allocator's peak over the whole worker process "
                  "(model build included), one process per size x format."),
             "", "Targets:"] + [f"- {line}" for line in targets(rows)]
    text = "\n".join([header, "", harness.markdown_table(rows, COLUMNS)] + notes)
    print(text, flush=True)
    harness.write_outputs(args.out, name, text, {"argv": sys.argv, "rows": rows,
                                                "targets": targets(rows)})


def merge_main(args) -> None:
    """One table (ratios, targets) from the rows of several runs' grpo_step_*.json files."""
    rows = harness.merged_rows(args.merge)
    first = rows[0]
    args.rank = first.get("lora_rank", args.rank)
    args.mesh = "per row"
    for name in ("group", "prompt", "completion", "micro_batch", "steps", "prompts"):
        if first.get(name) is not None:
            setattr(args, name, first[name])
    report(rows, args, "grpo_step_merged")


def main(argv=None):
    harness.run_script(parse_args(argv), worker_main, parent_main, merge_main)


if __name__ == "__main__":
    main()
