"""Rollout throughput: generated tokens/s of the jitted sampler per model size, format, batch.

For each model size (Qwen2.5-7B/14B/32B shapes, random weights) and weight format (bf16 / nvfp4
/ nf4 / mxfp4, LoRA rank 32 attached unmerged with nonzero B), one worker subprocess builds the
model tensor by tensor (the projections are drawn and quantized one at a time, so no dense bf16
copy of a 32B model exists) through qerl_jax.model_setup, with the kernels config.quant.kernels
describes, and then for each
batch in increasing order (so the process's peak memory only grows): compiles the sampler
ahead of time (timed on its own), and times one full generation of --new-tokens tokens after a
--prompt-token prompt, EOS disabled (every sequence runs to the limit), temperature 1.
Tokens/s = all generated tokens / wall time of that one call (prefill included).

The parent process never touches the GPU; it runs the workers one after the other under
--budget-s (a worker is not started, and a case is skipped, when the time it is expected to
take no longer fits; a worker still running at the deadline is killed and its unfinished case
recorded). OOM or any error in one case is recorded in the table without losing the others.

    python benchmarks/rollout.py --sizes 7b --out $OUT            # the full 7B table
    python benchmarks/rollout.py --sizes 32b --formats bf16,nvfp4,nf4 --batches 8 --out $OUT
    python benchmarks/rollout.py --smoke --out /tmp/rollout_smoke # CPU, tiny model, seconds
    python benchmarks/rollout.py --sizes 7b --formats nvfp4 --batches 8 \
        --config.quant.kernels.mosaic_schedule=split_k --config.rollout.kv_cache_dtype=int8 \
        --out $OUT

Every choice other than the shapes is a field of the trainer's config (qerl_jax/
experiment_config.py; `python -m qerl_jax.train --help` lists them), set with
--config.FIELD=VALUE and validated before any worker starts: the kernels
(config.quant.kernels.*), the KV cache and the decode loop (config.rollout.*), the seed, the
compilation cache (config.compilation_cache_dir) and XLA's autotuning file
(config.xla_autotune_results).

The GRPO-sized case with EOS on: 64 prompts x 8 generations, up to 1024 new tokens, each row
stopping after a completion length drawn from a real model's measured distribution
(benchmarks/completion_lengths.py):

    python benchmarks/rollout.py --sizes 7b --formats bf16,nvfp4 --batches 512 \
        --new-tokens 1024 --lengths benchmarks/results/completion_lengths_smollm2/lengths.json \
        --out $OUT
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib

import _harness as harness
import _models as models
import _roofline as roofline

DEFAULTS = dict(sizes="7b", formats="bf16,nvfp4,nf4,mxfp4", batches="2,8,64", new_tokens=2048,
                prompt=256, budget_s=540.0)
SMOKE = dict(sizes="tiny", formats="bf16,nvfp4", batches="2,4", new_tokens=8, prompt=16,
             budget_s=240.0)
# QeRL's rollout tok/s (arXiv 2510.11696; vLLM on one H100, input 256, completion 2048)
PAPER = {("7b", "bf16", 2): 115.4, ("7b", "nvfp4", 2): 151.6, ("14b", "bf16", 2): 65.4,
         ("14b", "nvfp4", 2): 95.3, ("14b", "nf4", 2): 45.1, ("32b", "bf16", 2): 34.0,
         ("32b", "nvfp4", 2): 58.0, ("32b", "nf4", 2): 25.2, ("7b", "bf16", 8): 1641,
         ("7b", "nvfp4", 8): 2092, ("14b", "bf16", 8): 737, ("14b", "nvfp4", 8): 1091,
         ("32b", "bf16", 8): 344, ("32b", "nvfp4", 8): 688}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help=f"comma list of 7b,14b,32b (or preset names); "
                        f"default {DEFAULTS['sizes']}")
    parser.add_argument("--formats", help=f"default {DEFAULTS['formats']} (run in this order)")
    parser.add_argument("--batches", help=f"default {DEFAULTS['batches']} (run ascending)")
    parser.add_argument("--new-tokens", type=int, help=f"default {DEFAULTS['new_tokens']}")
    parser.add_argument("--prompt", type=int, help=f"prompt tokens, default {DEFAULTS['prompt']}")
    parser.add_argument("--budget-s", type=float,
                        help=f"wall-clock budget of the whole command, default "
                             f"{DEFAULTS['budget_s']:.0f}")
    parser.add_argument("--rank", type=int, default=32,
                        help="LoRA rank: config.lora.rank, and config.lora.alpha = rank")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed generations per case after its one compile (same program, "
                             "keys folded with the repeat index); 'tok/s' is the first, 'tok/s "
                             "median' the median of all")
    parser.add_argument("--same-key", action="store_true",
                        help="every repeat uses the first run's key (its tokens_crc32 must then "
                             "equal the first run's: a check that the compiled program is "
                             "deterministic)")
    parser.add_argument("--tile-k", type=int, default=None,
                        help="K tile of every weight's kernel layout (default: "
                             "kernel_layout.default_tile_k per weight)")
    parser.add_argument("--peer", action="store_true",
                        help="also time transformers + torch.compile (static cache) generate at "
                             "the same shapes (benchmarks/transformers_peer.py), after the "
                             "size's own workers")
    parser.add_argument("--lengths", default="",
                        help="JSON of measured completion lengths (benchmarks/"
                             "completion_lengths.py's lengths.json, or a plain list): each row "
                             "of a case stops after a length drawn from it (seeded, clipped to "
                             "--new-tokens), as with "
                             "EOS on; tok/s counts the tokens generated, the roofline the KV "
                             "reads of the rows still generating (as the Pallas decode "
                             "attention reads them; XLA's attention reads every row)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny_qwen2, few tokens: a CPU check of the script in seconds")
    harness.add_worker_arguments(parser, "rollout")
    parser.epilog = harness.OVERRIDES_HELP
    args = harness.parse_arguments(parser, argv)
    for name, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    args.length_values = harness.parsed_lengths(parser, args.lengths)
    if not args.merge:
        args.configs, args.tag = case_configs(parser, args)
    return args


# the config fields the shape flags set (an override of one of them is refused)
FLAG_FIELDS = {"model.preset": "--sizes", "quant.format": "--formats", "lora.rank": "--rank",
               "rollout.max_new_tokens": "--new-tokens", "rollout.prompt_bucket": "--prompt"}


def case_configs(parser, args) -> tuple[dict, str]:
    """({(size, format): validated config} of the cases this process runs (a worker: its own),
    the output-name tag of the overrides)."""
    sizes = [args.size] if args.worker else harness.split_list(args.sizes)
    formats = [args.format] if args.worker else harness.split_list(args.formats)
    tokenizer = models.char_tokenizer_dir(os.path.join(os.path.abspath(args.out),
                                                       "rollout_raw", "tokenizer"))
    configs, tag = {}, ""
    for size in sizes:
        for format_name in formats:
            base = models.rollout_config(
                preset=models.preset_name(size), format_name=format_name,
                tokenizer_dir=tokenizer, rank=args.rank, prompt=args.prompt,
                new_tokens=args.new_tokens)
            config = models.configured(parser, base, args.overrides, FLAG_FIELDS)
            configs[size, format_name] = config
            tag = tag or models.config_tag(config, base)
    return configs, tag


# ============================================================================== worker
def _case_estimate(previous: dict | None, batch: int) -> float:
    """Seconds the next batch is expected to take, from the previous case of this worker:
    compile about the same, generation growing slowly with batch (weight reads dominate; the
    KV-cache reads grow with it). Only a guard, so on the generous side."""
    if previous is None:
        return 0.0
    growth = max(1.0, (batch / previous["batch"]) ** 0.25)
    return 1.1 * (previous["compile_s"] + previous["run_s"] * growth * previous.get("repeats", 1))


def worker_main(args) -> None:
    import gc
    import logging

    from qerl_jax.infra.xla_autotuning import persist_autotuning
    # before the first JAX computation of the process: XLA reads its flags when it starts
    config = args.configs[args.size, args.format]
    persist_autotuning(config.xla_autotune_results)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from qerl_jax import sampling
    from qerl_jax.infra.compilation_cache import cache_entries, enable_compilation_cache

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    size, format_name = args.size, args.format
    batches = sorted(int(b) for b in harness.split_list(args.batches))
    base = {"size": size, "preset": models.preset_name(size), "format": format_name,
            "prompt": args.prompt, "new_tokens": args.new_tokens, "lora_rank": config.lora.rank,
            **harness.device_info()}

    def emit(row):
        row = {**base, **row, "elapsed_s": time.time() - args.spawned_at}
        harness.append_jsonl(args.results, row)
        print({k: row.get(k) for k in ("size", "format", "batch", "status", "compile_s",
                                       "run_s", "tokens_per_s", "peak_GiB")}, flush=True)

    started = time.perf_counter()
    try:
        architecture, graphdef, states, info = models.build_sampling_model(
            config, interpret=args.kernels_interpret, tile_k=args.tile_k)
        base.update(info)
        base["init_s"] = time.perf_counter() - started
        base["peak_after_init_GiB"], base["peak_source"] = harness.peak_memory_gib()
        base["memory_limit_GiB"] = harness.memory_limit_gib()
    except Exception as error:  # recorded per case; the parent goes on with the next worker
        for batch in batches:
            emit({"batch": batch, "status": "init " + harness.describe_error(error)})
        raise

    previous, failed_at = None, None
    key = jax.random.key(config.seed + 3)
    rollout_cfg = config.rollout
    for batch in batches:
        if failed_at is not None:
            emit({"batch": batch, "status": f"skipped: OOM at batch {failed_at}"})
            continue
        estimate = _case_estimate(previous, batch)
        left = args.deadline - time.time()
        if estimate > left:
            emit({"batch": batch, "status": f"skipped: budget (needs ~{estimate:.0f} s, "
                                            f"{max(left, 0):.0f} s left)"})
            continue
        active = base.get("kernels_active", False)
        row = {"batch": batch, "path_decode": models.matmul_path(format_name, batch, active),
               "path_prefill": models.matmul_path(format_name, batch * args.prompt, active)}
        compiled = rollout = None
        try:
            sampler = sampling.SamplingConfig(
                max_new_tokens=args.new_tokens, temperature=rollout_cfg.temperature,
                top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k, eos_token_ids=(),
                num_generations=1, prompt_bucket=args.prompt,
                kv_cache_dtype=rollout_cfg.kv_cache_dtype,
                dequantize_once=rollout_cfg.dequantize_once,
                shrink_batch=rollout_cfg.shrink_batch,
                shrink_min_rows=rollout_cfg.shrink_min_rows)
            row["dequantize_once"] = rollout_cfg.dequantize_once
            sizes = sampling.shrink_schedule(batch, sampler)
            if rollout_cfg.shrink_batch:
                row["shrink_batch"] = "/".join(str(size) for size in sizes)
            tokens = jax.random.randint(jax.random.fold_in(key, batch), (batch, args.prompt), 0,
                                        architecture.vocab_size, jnp.int32)
            mask = jnp.ones((batch, args.prompt), jnp.bool_)
            run_key = jax.random.fold_in(key, 10_000 + batch)
            stop = budgets = None
            if args.length_values is not None:
                stop = harness.draw_lengths(args.length_values, batch, args.new_tokens,
                                            config.seed)
                budgets = jnp.asarray(stop)
                row["mean_length"] = float(stop.mean())
            begin = time.perf_counter()
            # The same program generate_from_states runs (prompt already at its bucket length),
            # compiled ahead of time so compilation is timed apart from generation.
            if config.compilation_cache_dir:
                entries = cache_entries(config.compilation_cache_dir)
                row["compilation_cache"] = f"warm ({entries} files)" if entries else "cold"
                enable_compilation_cache(config.compilation_cache_dir)
            compiled = sampling.compile_generate(graphdef, states, (batch, args.prompt),
                                                 run_key, sampler,
                                                 stop_lengths=budgets is not None)
            row["compile_s"] = time.perf_counter() - begin
            try:
                row["program_temp_GiB"] = compiled.memory_analysis().temp_size_in_bytes / 2**30
            except Exception:  # not every backend reports it
                pass
            runs, crcs = [], []
            for repeat in range(args.repeats):
                rollout = None  # the previous call's outputs are freed before the next starts
                repeat_key = (run_key if repeat == 0 or args.same_key
                              else jax.random.fold_in(run_key, repeat))
                begin = time.perf_counter()
                rollout = compiled(states, tokens, mask, repeat_key, budgets)
                generated = int(jax.device_get(rollout.lengths).sum())  # waits for the program
                runs.append((time.perf_counter() - begin, generated))
                # A fingerprint of each run's tokens (same seed, same program numbers: the same
                # value), so runs meant to give the same bits can be compared end to end.
                crcs.append(zlib.crc32(np.asarray(jax.device_get(rollout.tokens)).tobytes()))
            row["tokens_crc32"] = crcs[0]
            if args.repeats > 1:
                row["tokens_crc32_runs"] = " / ".join(str(crc) for crc in crcs)
            row["run_s"], generated = runs[0]
            row["generated_tokens"] = generated
            expected = batch * args.new_tokens if stop is None else int(stop.sum())
            row["expected_tokens"] = expected
            row["tokens_per_s"] = generated / row["run_s"]
            row["repeats"] = args.repeats
            if args.repeats > 1:
                rates = [count / seconds for seconds, count in runs]
                row["tokens_per_s_runs"] = " / ".join(f"{rate:.0f}" for rate in rates)
                row["tokens_per_s_median"] = statistics.median(rates)
                generated = min(count for _, count in runs)  # the status below covers all runs
            def weight_read_bytes(rows):
                path = models.matmul_path(format_name, rows, active)
                dequantized = rollout_cfg.dequantize_once and (path == "xla" or
                                                        path.endswith("_dequantize_xla"))
                return roofline.decode_read_bytes(states, architecture, rows, args.prompt,
                                                args.new_tokens, rollout_cfg.kv_cache_dtype,
                                                dequantized)[0]

            _, kv_bytes = roofline.decode_read_bytes(states, architecture, batch, args.prompt,
                                                   args.new_tokens, rollout_cfg.kv_cache_dtype)
            weight_bytes = weight_read_bytes(batch)
            steps = args.new_tokens
            if stop is not None:   # the loop runs to the longest row; finished rows read no KV
                steps, kv_total = roofline.kv_read_bytes_for_lengths(
                    architecture, args.prompt, stop, rollout_cfg.kv_cache_dtype)
                kv_bytes = kv_total / steps
                if len(sizes) > 1:   # each loop reads the weights its batch size multiplies by
                    phases = roofline.shrink_phase_steps(stop, sizes)
                    row["shrink_steps"] = "/".join(str(count) for _, count in phases)
                    weight_bytes = sum(count * weight_read_bytes(size)
                                       for size, count in phases) / steps
            row["decode_steps"] = steps
            row["tokens_per_step"] = expected / steps
            row["ms_per_token_step"] = 1e3 * row["run_s"] / steps
            row["kv_cache"] = rollout_cfg.kv_cache_dtype
            row["decode_read_GB"] = (weight_bytes + kv_bytes) / 1e9
            row["status"] = ("ok" if generated == expected
                             else f"ok, but {generated} != {expected} tokens")
            previous = row
        except Exception as error:
            row["status"] = harness.describe_error(error)
            if row["status"] == "OOM":
                failed_at = batch
        row["peak_GiB"], _ = harness.peak_memory_gib()
        emit(row)
        del compiled, rollout
        gc.collect()
    # The roofline's bandwidth, measured in this process after its cases (so their peak memory
    # does not hold the probe's array); the parent puts it into this worker's rows.
    try:
        harness.append_jsonl(args.results, {"read_GB_per_s": roofline.read_bandwidth(
            (64 if args.smoke else 4096) * 2**20) / 1e9})
    except Exception as error:  # the rows stand without a roofline
        print(f"read bandwidth not measured: {harness.describe_error(error)}", flush=True)


def _with_roofline(records: list[dict]) -> list[dict]:
    """A worker's case rows, with the roofline of its bandwidth record (if it wrote one): the
    read bandwidth over the bytes one decode step reads, times the batch, and the fraction of
    it the case reached."""
    rows = [record for record in records if "batch" in record]
    bandwidth = next((record["read_GB_per_s"] for record in records if "batch" not in record),
                     None)
    for row in rows:
        if bandwidth and row.get("decode_read_GB") and row.get("tokens_per_s"):
            row["read_GB_per_s"] = bandwidth
            row["roofline_tokens_per_s"] = (bandwidth / row["decode_read_GB"]
                                            * row.get("tokens_per_step", row["batch"]))
            row["roofline_fraction"] = _rate(row) / row["roofline_tokens_per_s"]
    return rows


# ============================================================================== parent
COLUMNS = [("size", "size"), ("format", "format"), ("batch", "batch"),
           ("mean_length", "mean completion (--lengths)"), ("status", "status"),
           ("compile_s", "compile s"), ("run_s", "run s"),
           ("generated_tokens", "generated tokens"), ("tokens_per_s", "tok/s"),
           ("tokens_per_s_median", "tok/s median"), ("tokens_per_s_runs", "tok/s runs"),
           ("vs_bf16", "x bf16"), ("vs_transformers", "x transformers"),
           ("paper_tokens_per_s", "paper tok/s"),
           ("decode_read_GB", "GB read per decode step"), ("read_GB_per_s", "read GB/s"),
           ("roofline_tokens_per_s", "roofline tok/s"), ("roofline_fraction", "of roofline"),
           ("kv_cache", "KV cache"), ("dequantize_once", "dequantize once"),
           ("shrink_batch", "batch sizes (shrink)"), ("shrink_steps", "steps per size"),
           ("peak_GiB", "peak GiB"), ("tokens_crc32", "tokens crc32"),
           ("tokens_crc32_runs", "tokens crc32 runs"), ("compilation_cache", "compilation cache"),
           ("weights_GiB", "weights GiB"),
           ("init_s", "init s"), ("path_decode", "decode path"),
           ("path_prefill", "prefill path"), ("kernel_hook", "kernel hook"),
           ("kernel_layout_weights", "weights in kernel layout"),
           ("mosaic_weights", "weights on the Mosaic GPU path"), ("peer", "peer")]


def _lookup(rows, size, format_name, batch):
    for row in rows:
        if (row["size"], row["format"], row["batch"]) == (size, format_name, batch) and \
                row.get("status", "").startswith("ok"):
            return row
    return None


def _rate(row: dict) -> float:
    """A case's tok/s for the targets: the median of its timed runs (one run: that run)."""
    return row.get("tokens_per_s_median") or row["tokens_per_s"]


def _rate_note(row: dict) -> str:
    return (f" (median of {row['repeats']} runs)" if row.get("tokens_per_s_median") else "")


def targets(rows) -> list[str]:
    """The issue's targets, evaluated where the cases were measured."""
    lines = []

    def verdict(ok):
        return "MET" if ok else "not met"

    nv7, bf7 = _lookup(rows, "7b", "nvfp4", 8), _lookup(rows, "7b", "bf16", 8)
    if nv7:
        ratio = _rate(nv7) / _rate(bf7) if bf7 else None
        ok = _rate(nv7) >= 2100 and (ratio is None or ratio >= 1.5)
        lines.append(f"7B NVFP4 batch 8 >= 2100 tok/s and >= 1.5x our bf16: "
                     f"{_rate(nv7):.0f} tok/s{_rate_note(nv7)}, "
                     f"{f'x{ratio:.2f}' if ratio else 'bf16 not measured'} -> {verdict(ok)}")
    nv32 = _lookup(rows, "32b", "nvfp4", 8)
    if nv32:
        lines.append(f"32B NVFP4 batch 8 >= 700 tok/s: {_rate(nv32):.0f} tok/s"
                     f"{_rate_note(nv32)} -> {verdict(_rate(nv32) >= 700)}")
    for size in ("14b", "32b"):
        for batch in sorted({row["batch"] for row in rows}):
            nv, nf = _lookup(rows, size, "nvfp4", batch), _lookup(rows, size, "nf4", batch)
            if nv and nf:
                ratio = _rate(nv) / _rate(nf)
                lines.append(f"{size.upper()} batch {batch}: NVFP4 >= 2x NF4: x{ratio:.2f} -> "
                             f"{verdict(ratio >= 2)}")
    return lines or ["(no case of a target was measured)"]


def parent_main(args) -> None:
    budget = harness.Budget(args.budget_s)
    sizes = harness.split_list(args.sizes)
    formats = harness.split_list(args.formats)
    batches = sorted(int(b) for b in harness.split_list(args.batches))
    raw_dir = os.path.join(args.out, "rollout_raw")
    os.makedirs(raw_dir, exist_ok=True)
    rows: list[dict] = []
    for size in sizes:
        worker_costs: list[float] = []   # seconds each worker of this size took to its 1st case
        for format_name in formats:
            tag = f"{size}_{format_name}"
            results = os.path.join(raw_dir, f"{tag}.jsonl")
            if os.path.exists(results):
                os.remove(results)
            needed = max(worker_costs, default=0.0)
            left = budget.left()
            if needed > left or left < 5:
                rows += [{"size": size, "format": format_name, "batch": batch,
                          "status": f"skipped: budget ({max(left, 0):.0f} s left"
                                    + (f"; a worker took ~{needed:.0f} s to its first case)"
                                       if needed else ")")}
                         for batch in batches]
                continue
            command = [sys.executable, os.path.abspath(__file__), "--worker", "--size", size,
                       "--format", format_name, "--batches", args.batches,
                       "--new-tokens", str(args.new_tokens), "--prompt", str(args.prompt),
                       "--rank", str(args.rank),
                       "--repeats", str(args.repeats), "--results", results,
                       "--deadline", str(budget.deadline), "--out", os.path.abspath(args.out),
                       *(["--same-key"] if args.same_key else []),
                       *(["--kernels-interpret"] if args.kernels_interpret else []),
                       *(["--lengths", os.path.abspath(args.lengths)] if args.lengths else []),
                       "--spawned-at", str(time.time()), *args.overrides]
            if args.tile_k:
                command += ["--tile-k", str(args.tile_k)]
            print(f"[rollout] {tag}: starting worker ({left:.0f} s of budget left)", flush=True)
            log = os.path.join(raw_dir, f"{tag}.log")
            code, wall = harness.run_worker(command, log, left)
            got = _with_roofline(harness.read_jsonl(results))
            got += _missing_rows(got, size, format_name, batches, code)
            first = next((row for row in got if row.get("status", "").startswith("ok")), None)
            if first is not None:
                worker_costs.append(first["elapsed_s"])
            if code != 0:
                print(f"[rollout] {tag}: worker {'killed' if code is None else 'rc=' + str(code)}"
                      f" after {wall:.0f} s; log tail:\n{harness.tail(log)}", flush=True)
            rows += sorted(got, key=lambda row: row["batch"])
        if args.peer:
            rows += _peer_rows(args, size, raw_dir, budget)
    report(rows, args, harness.output_name("rollout", sizes, args.tag))


def _missing_rows(got: list[dict], size: str, format_name: str, batches: list[int],
                  code: int | None) -> list[dict]:
    """Rows for the batches a worker (exit code `code`, None: killed) did not report."""
    done = {row["batch"] for row in got}
    why = ("killed at the budget deadline" if code is None
           else f"worker exited with code {code} before this case")
    return [{"size": size, "format": format_name, "batch": batch, "status": why}
            for batch in batches if batch not in done]


def _peer_rows(args, size: str, raw_dir: str, budget) -> list[dict]:
    """The transformers peer's rows for `size` (its worker under the budget's remainder)."""
    results = os.path.join(raw_dir, f"{size}_transformers.jsonl")
    if os.path.exists(results):
        os.remove(results)
    batches = sorted(int(b) for b in harness.split_list(args.batches))
    if budget.left() < 5:
        return [{"size": size, "format": "bf16 transformers", "batch": batch,
                 "status": "skipped: budget"} for batch in batches]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformers_peer.py")
    command = [sys.executable, script, "--size", size, "--batches", args.batches,
               "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats),
               "--seed", str(next(iter(args.configs.values())).seed), "--results", results,
               *(["--lengths", os.path.abspath(args.lengths)] if args.lengths else [])]
    print(f"[rollout] {size}_transformers: starting worker ({budget.left():.0f} s of budget "
          "left)", flush=True)
    log = os.path.join(raw_dir, f"{size}_transformers.log")
    code, _ = harness.run_worker(command, log, budget.left())
    got = harness.read_jsonl(results)
    got += _missing_rows(got, size, "bf16 transformers", batches, code)
    if code != 0:
        print(f"[rollout] {size}_transformers: rc={code}; log tail:\n{harness.tail(log)}",
              flush=True)
    return sorted(got, key=lambda row: row["batch"])


def _temperature(args) -> str:
    """The cases' sampling temperature (config.rollout.temperature; 1 in merged tables)."""
    configs = getattr(args, "configs", None)
    return f"{next(iter(configs.values())).rollout.temperature:g}" if configs else "1"


def report(rows: list[dict], args, name: str) -> None:
    """Ratios to bf16, the paper's figures, the table and the targets -> {out}/{name}.md/.json."""
    for row in rows:
        bf16 = _lookup(rows, row["size"], "bf16", row["batch"])
        if row.get("tokens_per_s") and bf16 and bf16.get("tokens_per_s"):
            row["vs_bf16"] = _rate(row) / _rate(bf16)  # medians, as the targets
        row["paper_tokens_per_s"] = PAPER.get((row["size"], row["format"], row["batch"]))
        peer = _lookup(rows, row["size"], "bf16 transformers", row["batch"])
        if row.get("tokens_per_s") and peer and peer.get("tokens_per_s"):
            row["vs_transformers"] = _rate(row) / _rate(peer)
    header = harness.header_line(
        f"Rollout throughput ({args.prompt}-token prompt, {args.new_tokens} new tokens, "
        + (f"EOS off, each row stopping at a length drawn from {args.lengths}" if args.lengths
           else "EOS off (every row to the limit)")
        + f", LoRA r{args.rank} unmerged, temperature {_temperature(args)}, random weights; "
        f"tok/s = all "
        f"generated tokens / one timed call incl. prefill; compile timed apart, AOT)", rows)
    notes = ["", ("Peak memory: the device allocator's peak since the worker process started "
                  "(one process per size x format, batches ascending, so each batch's peak "
                  "includes the smaller ones'). 'paper tok/s': QeRL's vLLM numbers (arXiv "
                  "2510.11696). Roofline: the measured read bandwidth (the sum of a 4 GiB "
                  "float32 array, best of 5, in the same process) over the bytes one decode "
                  "step reads (every weight once except an untied embedding table, plus K and "
                  "V at the mean context length), times the batch; prefill and sampling are "
                  "not counted, so it is an upper bound."),
             "", "Targets:"] + [f"- {line}" for line in targets(rows)]
    text = "\n".join([header, "", harness.markdown_table(rows, COLUMNS)] + notes)
    print(text, flush=True)
    harness.write_outputs(args.out, name, text, {"argv": sys.argv, "rows": rows,
                                                "targets": targets(rows)})


def merge_main(args) -> None:
    """One table (ratios, targets) from the rows of several runs' rollout_*.json files."""
    rows = harness.merged_rows(args.merge)
    first = rows[0]
    args.prompt, args.new_tokens, args.rank = (first["prompt"], first["new_tokens"],
                                               first["lora_rank"])
    report(rows, args, "rollout_merged")


def main(argv=None):
    harness.run_script(parse_args(argv), worker_main, parent_main, merge_main)


if __name__ == "__main__":
    main()
