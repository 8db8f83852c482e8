"""The benchmark scripts' --smoke modes on CPU (tiny model, few tokens), as subprocesses, so a
change in the sampler, trainer, quantization, model set-up or config parsing that breaks them
fails CI.

Both scripts run at the same time (each one parent + one worker process) to keep the test
short; the rollout one goes through the Pallas kernel path in interpret mode.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


def _start(script, out_dir, *flags):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke",
               "--out", str(out_dir), *flags]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(process):
    output, _ = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, output[-4000:]
    return output


def _worker_logs(out_dir, raw):
    folder = os.path.join(out_dir, raw)
    return "\n".join(open(os.path.join(folder, name)).read()[-3000:]
                     for name in sorted(os.listdir(folder)) if name.endswith(".log"))


@pytest.mark.slow
def test_rollout_and_grpo_step_smoke(tmp_path):
    rollout_out, step_out = tmp_path / "rollout", tmp_path / "grpo_step"
    rollout = _start("rollout.py", rollout_out, "--formats", "nvfp4", "--batches", "2,3",
                     "--kernels-interpret", "--repeats", "2", "--same-key", "--peer",
                     f"--config.xla_autotune_results={tmp_path / 'autotune' / 'a.textproto'}")
    step = _start("grpo_step.py", step_out, "--formats", "nvfp4",
                  f"--config.compilation_cache_dir={tmp_path / 'xla_cache'}", "--trace-peaks",
                  "--config.rollout.offload_weights_for_compile=on",
                  "--config.train.logits_chunk_size=4")
    rollout_text, step_text = _finish(rollout), _finish(step)

    with open(rollout_out / "rollout_tiny.json") as handle:
        rows = json.load(handle)["rows"]
    peers = [row for row in rows if row["format"] == "bf16 transformers"]   # --peer
    rows = [row for row in rows if row["format"] == "nvfp4"]
    assert [row["batch"] for row in rows] == [2, 3], rollout_text[-3000:]
    assert [row["batch"] for row in peers] == [2, 3], rollout_text[-3000:]
    for peer, row in zip(peers, rows):
        assert peer["status"] == "ok", (peer, _worker_logs(rollout_out, "rollout_raw"))
        assert peer["generated_tokens"] == peer["batch"] * 8 and peer["tokens_per_s"] > 0
        assert "static cache" in peer["peer"]
        assert row["vs_transformers"] > 0
    for row in rows:
        assert row["status"] == "ok", (row, _worker_logs(rollout_out, "rollout_raw"))
        assert row["generated_tokens"] == row["batch"] * 8      # EOS off: every token made
        assert row["tokens_per_s"] > 0 and row["compile_s"] > 0
        runs = [float(rate) for rate in row["tokens_per_s_runs"].split(" / ")]  # --repeats 2
        assert row["repeats"] == 2 and len(runs) == 2 and round(runs[0]) == round(
            row["tokens_per_s"])
        assert abs(row["tokens_per_s_median"] - sum(runs) / 2) <= 0.5  # runs: rounded
        # --same-key: both runs of the compiled program sample the same tokens
        assert row["tokens_crc32_runs"] == f"{row['tokens_crc32']} / {row['tokens_crc32']}"
        assert row["kernel_layout_weights"] == "14 of 14"         # 2 layers x 7 projections
        assert row["path_decode"] == "nvfp4_fused"
        assert row["decode_read_GB"] > 0 and row["read_GB_per_s"] > 0
        assert row["roofline_fraction"] == pytest.approx(
            row["tokens_per_s_median"] / row["roofline_tokens_per_s"])
    assert (rollout_out / "rollout_tiny.md").read_text().count("| tiny | nvfp4 |") == 2

    with open(step_out / "grpo_step_tiny.json") as handle:
        (row,) = json.load(handle)["rows"]
    assert row["status"] == "ok", (row, _worker_logs(step_out, "grpo_step_raw"))
    assert row["steps_done"] == 2
    assert row["step_s"] > 0 and row["step0_rollout_s"] > 0 and row["step0_train_s"] > 0
    assert row["aqn"] is True
    assert "| tiny | nvfp4 |" in step_text
    assert row["peak_after_rollout0_GiB"] > 0
    assert row["compilation_cache"] == "cold"  # the overrides reached the trainer's config
    assert row["logits_chunk"] == 4
    assert row["attention"] == "xla"           # 'auto' on a CPU
    assert row["step0_sampler_compile_s"] > 0  # offload_weights_for_compile on: compiled ahead
    assert row["step_sampler_compile_s"] == 0  # once
    assert row["offload_for_compile"] == "auto"
    # --trace-peaks ran: the CPU allocator reports no peak (an empty trace); the live arrays
    # are accounted before step 0 and after the first call of each program in step 0 only
    assert row["peak_trace"] == []
    accounts = [(entry["step"], entry["after"]) for entry in row["memory_trace"]]
    assert accounts[0] == (0, "trainer set-up")
    assert (0, "_collect_rollouts") in accounts and (0, "_grad_fn") in accounts
    assert all(step == 0 for step, _ in accounts) and row["memory_trace_s"] > 0
    assert all(entry["state_arrays_GiB"] > 0 for entry in row["memory_trace"])

    # --merge: one table from several runs' JSON; an ok row replaces another run's failed one
    failed = {"rows": [{**rows[0], "status": "killed at the budget deadline"}]}
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "rollout_tiny.json").write_text(json.dumps(failed))
    merged_out = tmp_path / "merged"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rollout.py"), "--merge",
                    str(tmp_path / "failed" / "rollout_tiny.json"),
                    str(rollout_out / "rollout_tiny.json"), "--out", str(merged_out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=60)
    with open(merged_out / "rollout_merged.json") as handle:
        merged = json.load(handle)["rows"]
    assert [(row["format"], row["batch"], row["status"]) for row in merged] == [
        ("nvfp4", 2, "ok"), ("nvfp4", 3, "ok"), ("bf16 transformers", 2, "ok"),
        ("bf16 transformers", 3, "ok")]


def test_transformers_peer_counts_the_drawn_lengths(tmp_path):
    """benchmarks/transformers_peer.py --lengths: each row gets rollout.py's stop length (the
    same draw), generate runs to the longest, and only the drawn tokens count."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _harness as harness
    lengths, results = tmp_path / "lengths.json", tmp_path / "peer.jsonl"
    lengths.write_text(json.dumps({"lengths": [2, 5, 7, 40]}))
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "transformers_peer.py"),
                    "--size", "tiny", "--batches", "3", "--new-tokens", "8", "--prompt", "16",
                    "--lengths", str(lengths), "--results", str(results)],
                   cwd=ROOT, check=True, capture_output=True, timeout=TIMEOUT_S)
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    stop = harness.draw_lengths([2, 5, 7, 40], 3, 8, 0)   # 40 is clipped to the 8 new tokens
    assert row["status"] == "ok", row
    assert row["generated_tokens"] == int(stop.sum()) and row["steps"] == int(stop.max())
    assert row["mean_length"] == float(stop.mean()) and row["tokens_per_s"] > 0


def test_run_on_gpus_queue_budget_and_skip(tmp_path):
    """benchmarks/run_on_gpus.py: jobs in file order on the free 'GPUs', {out}, {flags} and
    {budget} substituted, CUDA_VISIBLE_DEVICES set per job, jobs that cannot start in time
    skipped (the third job can only start after ~2 s, leaving < 63 of the 80 - 15 s)."""
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("# a comment\n"
                    "echo first {out} {flags} {budget} $CUDA_VISIBLE_DEVICES; sleep 2\n"
                    "echo second {budget} $CUDA_VISIBLE_DEVICES; sleep 2\n"
                    "echo third {budget}\n")
    out = tmp_path / "out"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run_on_gpus.py"),
                    "--jobs", str(jobs), "--out", str(out), "--gpus", "2",
                    "--flags=--x", "--total-s", "80", "--min-start-s", "63"],
                   cwd=ROOT, check=True, capture_output=True, timeout=60)
    first = (out / "job0" / "log.txt").read_text().split()
    assert first[:3] == ["first", str(out / "job0"), "--x"] and 60 <= int(first[3]) <= 65
    assert first[4] in ("0", "1")
    second = (out / "job1" / "log.txt").read_text().split()
    assert second[0] == "second" and second[2] in ("0", "1") and second[2] != first[4]
    summary = (out / "jobs_summary.md").read_text()
    assert "| job2 |" in summary and "skipped" in summary.split("| job2 |")[1]


def test_memory_breakdown_smoke(tmp_path):
    """Both programs lowered, compiled and run on the tiny model; the table and the buffer
    listing of the dump are written."""
    output = _finish(_start("memory_breakdown.py", tmp_path, "--formats", "nvfp4", "--dump",
                            "--run"))
    payload = json.load(open(tmp_path / "memory_breakdown_tiny.json"))
    rows = payload["rows"]
    assert [row["program"] for row in rows] == ["rollout", "train micro-batch"], output[-2000:]
    for row in rows:
        assert row["temp_GiB"] >= 0 and row["argument_GiB"] > 0
        assert row["largest_values"], "no value parsed from the buffer-assignment dump"
        assert [stage for stage, _ in row["allocator_stages"]] == [
            "trainer built", "rollout compiled", "rollout run", "train compiled",
            "train micro-batch run"]
    assert "| tiny | nvfp4 | xla | rollout |" in open(tmp_path / "memory_breakdown_tiny.md").read()


def test_kernel_profile_smoke(tmp_path):
    """Two tiny shapes x two tunings in interpret mode: every row measured, each checked against
    the format's reference (the error column), the table written."""
    output = _finish(_start("profile/kernel_profile.py", tmp_path, "--formats", "nvfp4",
                            "--tunings", "base;block_n=32,num_warps=8"))
    payload = json.load(open(tmp_path / "kernel_profile_smoke_m8.json"))
    rows = [row for row in payload["rows"] if row["format"] == "nvfp4"]
    assert len(rows) == 4 and all("error" not in row for row in rows), output[-2000:]
    assert all(row["max_rel_err"] < 1e-2 and row["call_us"] > 0 for row in rows)
    # the same config in both tunings (block_n 32 vs 64 changes only the tiling): equal output
    assert all(row["max_abs_diff_vs_first"] == 0.0 for row in rows)
    assert {row["config"].split()[1] for row in rows} == {"bn64", "bn32"}
    assert "| a | 256 x 256 | nvfp4 |" in open(tmp_path / "kernel_profile_smoke_m8.md").read()


def test_attention_profile_smoke(tmp_path):
    """attention_profile.py (two settings, interpret mode) on tiny shapes: every row measured
    and within its stated error of the reference."""
    _finish(_start("profile/attention_profile.py", tmp_path / "att", "--settings",
                   "base;balanced=0"))
    rows = json.load(open(tmp_path / "att" / "attention_profile_b2.json"))["rows"]
    assert [row["setting"] for row in rows] == ["base", "balanced=0"]
    assert all("error" not in row and row["max_rel_err"] < 1e-2 and row["mean_us"] > 0
               for row in rows)


def test_triton_ir_parsing():
    """triton_ir.py is GPU-only (interpret mode compiles no Triton); its parsing of XLA's Triton
    pass log and of PTX is checked here on a synthetic log."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "profile"))
    try:
        import triton_ir
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks", "profile"))
    log = "\n".join([
        "// -----// IR Dump Before TritonGPUCoalesce (tritongpu-coalesce) ('builtin.module' "
        "operation: @k) //----- //",
        '  %0 = "tt.load"(%a) : (tensor<64x!tt.ptr<i8>>) -> tensor<64xi8>',
        "// -----// IR Dump Before ConvertTritonGPUToLLVM (convert-triton-gpu-to-llvm) "
        "('builtin.module' operation: @k) //----- //",
        '  %1 = "ttg.local_load"(%m) : (!ttg.memdesc<64xi8>) -> tensor<64xi8>',
        '  %2 = "tt.dot"(%x, %w, %c) : (...) -> tensor<16x64xf32>',
        "  %3 = ttg.convert_layout %2 : tensor<16x64xf32>",
        "// -----// IR Dump After ConvertTritonGPUToLLVM (convert-triton-gpu-to-llvm) "
        "('builtin.module' operation: @k) //----- //",
        "  llvm.return"])
    sections = triton_ir.split_passes(log)
    assert [(when, name) for when, name, _ in sections] == [
        ("Before", "TritonGPUCoalesce"), ("Before", "ConvertTritonGPUToLLVM"),
        ("After", "ConvertTritonGPUToLLVM")]
    ttgir = triton_ir.final_ttgir(sections)
    counts = triton_ir.op_counts(ttgir)
    assert counts["ttg.local_load"] == 1 and counts["tt.dot"] == 1
    assert counts["ttg.convert_layout"] == 1 and counts["tt.load"] == 0
    ptx = "\n".join(["\tcp.async.cg.shared.global [%r1], [%rd1], 16;",
                     "\t@%p1 bra $L__BB0_1;", "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16",
                     "\tprmt.b32 x, %r2, z, 0x4140;", "\tprmt.b32 y, %r3, z, 0x4342;"])
    ptx_counts = triton_ir.instruction_counts(ptx)
    assert ptx_counts["cp.async.cg"] == 1 and ptx_counts["mma.sync"] == 1
    assert ptx_counts["prmt"] == 2 and ptx_counts["ld.shared"] == 0


def test_attention_memory_smoke(tmp_path):
    """attention_memory.py compiles the gradient program per chunk and reports XLA's
    temporaries (CPU, a 64-token sequence)."""
    script = os.path.join(ROOT, "benchmarks", "profile", "attention_memory.py")
    subprocess.run([sys.executable, script, "--size", "tiny", "--layers", "1", "--length", "64",
                    "--chunks", "0,16", "--out", str(tmp_path)], check=True, timeout=300)
    with open(tmp_path / "attention_memory_tiny.json") as handle:
        rows = json.load(handle)["rows"]
    assert [row["chunk"] for row in rows] == [0, 16]
    assert all(row["temp_MiB"] > 0 for row in rows)
    assert rows[1]["one_scores_MiB"] == rows[0]["one_scores_MiB"] / 4  # [16, 64] vs [64, 64]


def test_decode_read_bytes_counts_each_weight_once_and_the_mean_kv_cache():
    """The rollout roofline's bytes per decode step against the architecture's parameter count:
    bf16 weights (2 bytes each) without the untied embedding table, plus K and V of every layer
    at the mean context length; a tied table is the lm_head and counts."""
    import dataclasses

    from flax import nnx

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _roofline as roofline
    from qerl_jax.models.config import preset
    from qerl_jax.models.transformer import init_model

    for tied in (False, True):
        architecture = dataclasses.replace(
            preset("tiny_qwen2", param_dtype="bfloat16", compute_dtype="bfloat16"),
            tie_word_embeddings=tied)
        model = init_model(architecture, seed=0)
        _, state = nnx.split(model)
        weights, kv = roofline.decode_read_bytes(state, architecture, batch=3, prompt=16,
                                               new_tokens=8)
        params = architecture.num_parameters()
        table = architecture.vocab_size * architecture.hidden_size
        assert weights == 2 * (params - (0 if tied else table))
        head_dim = architecture.resolved_head_dim
        assert kv == int(2 * architecture.num_hidden_layers * architecture.num_key_value_heads
                         * head_dim * 2 * 3 * (16 + 4))


def test_kv_reads_of_rows_that_stop_at_their_lengths():
    """The --lengths roofline: the loop runs to the longest row, and a row reads prompt + t + 1
    cached tokens at its step t only while it generates (a loop over the steps as the
    reference)."""
    from qerl_jax.models.config import preset

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _roofline as roofline

    architecture = preset("tiny_qwen2", param_dtype="bfloat16", compute_dtype="bfloat16")
    lengths = [1, 7, 3, 12]
    steps, total = roofline.kv_read_bytes_for_lengths(architecture, 16, lengths)
    per_token = roofline.kv_bytes_per_token(architecture)
    reference = sum(per_token * (16 + t + 1) for length in lengths for t in range(length))
    assert steps == 12 and total == int(reference)
    weights, kv = roofline.decode_read_bytes({}, architecture, batch=4, prompt=16, new_tokens=12)
    assert kv == int(per_token * 4 * (16 + 6))   # every row to the end: the mean context
    # a shrinking batch (sampling.shrink_schedule 4/2/1): 4 rows generate at step 0, 3 at
    # steps 1-2 (then 2: the 2-row loop from step 3), 1 from step 7 (the 1-row loop)
    assert roofline.shrink_phase_steps(lengths, (4, 2, 1)) == [(4, 3), (2, 4), (1, 5)]
    assert roofline.shrink_phase_steps(lengths, (4,)) == [(4, 12)]


def test_rollout_replays_measured_lengths(tmp_path):
    """rollout.py --lengths: every row stops after its drawn length, so the case generates
    exactly their sum (EOS off otherwise) and reports their mean; a bad file is one line."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"lengths": [2, 5, 8, 30]}))
    out, shrunk = tmp_path / "rollout", tmp_path / "shrunk"
    # both runs at the same time; the second has the same rows in loops of 4, 2 and 1 rows
    full_run = _start("rollout.py", out, "--formats", "bf16", "--batches", "4",
                      "--lengths", str(lengths))
    shrunk_run = _start("rollout.py", shrunk, "--formats", "bf16", "--batches", "4",
                        "--lengths", str(lengths), "--config.rollout.shrink_batch=true",
                        "--config.rollout.shrink_min_rows=1")
    text, shrunk_text = _finish(full_run), _finish(shrunk_run)
    with open(out / "rollout_tiny.json") as handle:
        (row,) = json.load(handle)["rows"]
    assert row["status"] == "ok", (row, text[-3000:])
    assert row["generated_tokens"] == row["expected_tokens"] < 4 * 8
    assert row["decode_steps"] <= 8 and 2 <= row["mean_length"] <= 8
    with open(shrunk / "rollout_tiny.json") as handle:
        (shrunk_row,) = json.load(handle)["rows"]
    assert shrunk_row["status"] == "ok", (shrunk_row, shrunk_text[-3000:])
    assert shrunk_row["shrink_batch"] == "4/2/1"
    assert shrunk_row["generated_tokens"] == shrunk_row["expected_tokens"] == row["expected_tokens"]
    assert sum(int(count) for count in shrunk_row["shrink_steps"].split("/")) == \
        shrunk_row["decode_steps"]
    lengths.write_text("[0, 3]")
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rollout.py"),
                          "--smoke", "--lengths", str(lengths), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith(f"rollout.py: error: --lengths {lengths}:")


def test_config_overrides_are_checked_before_any_worker(tmp_path):
    """--config.FIELD=VALUE goes through the trainer's own parsing and validation in the parent:
    an unknown field, a bad value, a bad combination, and a field a shape flag sets are each
    the parser's one-line error (exit 2), before any worker starts."""
    cases = [("--config.quant.kernels.mosaic_schedul=split_k",
              "config.quant.kernels.mosaic_schedul: unknown field", "mosaic_schedule"),
             ("--config.quant.kernels.mosaic_schedule=fast",
              "config.quant.kernels.mosaic_schedule: ", "'fast'"),
             ("--config.rollout.max_new_tokens=4", "config.rollout.max_new_tokens: ",
              "set by --new-tokens"),
             ("--config.aqn.enabled=true", "config.aqn.enabled: ", "quantized")]
    processes = [subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "rollout.py"),
                                   "--smoke", "--formats", "bf16", override, "--out",
                                   str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for override, _, _ in cases]   # all at once
    for (override, prefix, named), process in zip(cases, processes):
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (override, stderr[-2000:])
        last = stderr.strip().splitlines()[-1]
        assert last.startswith(f"rollout.py: error: {prefix}") and named in last, (override,
                                                                                    last)
    assert not (tmp_path / "rollout_raw" / "tiny_bf16.log").exists()


def test_overrides_leave_the_base_config_and_name_the_outputs(tmp_path):
    """configured() applies the overrides to a copy (the base stays the benchmark's defaults),
    and the output name says which kernel choices differ from them."""
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _models as models
    base = models.rollout_config(preset="tiny_qwen2", format_name="nvfp4",
                                 tokenizer_dir=str(tmp_path))
    config = models.configured(argparse.ArgumentParser(prog="t"), base,
                               ["--config.quant.kernels.enabled=false",
                                "--config.quant.kernels.mosaic_schedule=split_k"], {})
    assert (config.quant.kernels.enabled, config.quant.kernels.mosaic_schedule) == (
        False, "split_k")
    assert (base.quant.kernels.enabled, base.quant.kernels.mosaic_schedule) == (True, "auto")
    assert models.config_tag(config, base) == "_no-kernels_split_k"
    assert models.config_tag(base, base) == ""


def test_completion_lengths_smoke(tmp_path):
    """benchmarks/completion_lengths.py on the packaged SmolLM2-135M-Instruct: one GSM8K
    question x G = 2 at 4 tokens gives 2 lengths in [1, 4] with their no-EOS flags, and the
    summary counts them."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                          "completion_lengths.py"),
                             "--prompts", "1", "--group", "2", "--new-tokens", "4", "--batch", "1",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "lengths.json") as handle:
        data = json.load(handle)
    assert len(data["lengths"]) == len(data["truncated"]) == 2
    assert all(1 <= length <= 4 for length in data["lengths"])
    assert data["summary"]["count"] == 2
    assert data["summary"]["share_at_limit"] == sum(data["truncated"]) / 2


def test_workers_on_several_devices_leave_room_for_collective_memory(monkeypatch):
    """One device: 95% preallocated; several: 90% (XLA's collectives allocate outside the
    pool); a caller's setting wins; the header reports what the worker ran with."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _harness as harness
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert harness.worker_env()["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    assert harness.worker_env(2)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert harness.worker_env(4)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert "MEM_FRACTION=0.90." in harness.header_line("t", [{"device": "d",
                                                             "memory_fraction": "0.90"}])
    assert "unset (JAX's default 0.75)" in harness.header_line(
        "t", [{"device": "d", "memory_fraction": None}])
