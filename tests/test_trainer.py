"""The trainer end to end on a tiny CPU config: exact resume, a crash mid-save, non-finite
updates skipped and counted, config validation, held-out evaluation during training."""

import dataclasses
import os
import shutil
import signal
import subprocess
import types

import jax
import numpy as np
import pytest

from qerl_jax.infra.checkpointing import TrainingCheckpoints
from qerl_jax.experiment_config import validate_config
from qerl_jax.infra.metrics import read_metrics
from qerl_jax.infra.errors import ConfigError, TrainingStopped
from qerl_jax.infra.run_record import REPLACED_PREFIX, read_starts
from qerl_jax.trainer import NonFiniteError, Trainer
from tests.conftest import small_trainer_config

TIMING_KEYS = ("time/rollout_s", "time/train_s", "time/sampler_compile_s", "rollout_tokens_per_s",
               "peak_memory_bytes", "time/eval_s")
EVAL_KEYS = ("eval/pass@1", "eval/mean_length", "eval/num_examples", "time/eval_s")


def _config(**train_overrides):
    config = small_trainer_config(total_steps=6)
    config.checkpoint.every_steps = 3
    config.model.remat = True        # and per-layer remat with trainable norm scales
    config.aqn.stages = 3
    for key, value in train_overrides.items():
        config.train[key] = value
    return config


@pytest.fixture(scope="module")
def warm_cache(tiny_warmup):
    """The test run's one warm-up (tests/conftest.py): _config's warm-up settings are its."""
    return tiny_warmup


def _workdir(tmp_path, name, warm_cache):
    workdir = str(tmp_path / name)
    shutil.copytree(warm_cache, os.path.join(workdir, "warmup"))
    return workdir


def _comparable(metrics):
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in metrics]


def test_resume_continues_exactly(tmp_path, warm_cache):
    straight_dir = _workdir(tmp_path, "straight", warm_cache)
    Trainer(_config(), straight_dir).train()
    straight = read_metrics(straight_dir)
    assert [row["step"] for row in straight] == list(range(6))

    resumed_dir = _workdir(tmp_path, "resumed", warm_cache)
    Trainer(_config(), resumed_dir).train(stop_after=3)
    # a later save killed midway leaves an unfinished temporary directory behind
    os.makedirs(os.path.join(resumed_dir, "checkpoints", "5.orbax-checkpoint-tmp-1234",
                             "arrays"))
    with open(os.path.join(resumed_dir, "metrics.jsonl"), "a") as handle:
        handle.write('{"step": 3, "reward": 999.0}\n')  # a step that ran but was not saved
    trainer = Trainer(_config(), resumed_dir, resume=True)
    assert trainer.checkpoints.latest_step() == 3
    trainer.train()
    resumed = read_metrics(resumed_dir)
    assert _comparable(resumed) == _comparable(straight)
    a = jax.tree_util.tree_leaves(TrainingCheckpoints(
        os.path.join(straight_dir, "checkpoints"), read_only=True).restore(
        trainer._state_arrays())[0])
    b = jax.tree_util.tree_leaves(trainer._state_arrays())
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert os.path.isfile(os.path.join(resumed_dir, "curves.png"))
    assert os.path.isfile(os.path.join(resumed_dir, "run.json"))


def test_non_finite_updates_are_skipped_counted_and_stop_the_run(tmp_path, warm_cache):
    config = _config(max_consecutive_nonfinite=2)
    trainer = Trainer(config, _workdir(tmp_path, "nan", warm_cache))
    before = [np.array(leaf) for leaf in jax.tree_util.tree_leaves(trainer.trainable)]
    grad_fn = trainer._grad_fn

    def poisoned(*args):
        (loss, aux), grads = grad_fn(*args)
        return (loss * np.nan, aux), jax.tree_util.tree_map(lambda g: g * np.nan, grads)

    trainer._grad_fn = poisoned
    with pytest.raises(NonFiniteError, match="2 consecutive non-finite steps"):
        trainer.train()
    after = jax.tree_util.tree_leaves(trainer.trainable)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    metrics = read_metrics(trainer.workdir)
    assert metrics[0]["skipped_updates"] == 1


def test_invalid_config_names_the_field():
    config = _config()
    config.train.micro_batch_size = 5
    with pytest.raises(ValueError, match="config.train.micro_batch_size"):
        validate_config(config)
    config = _config()
    config.quant.format = "bf16"
    with pytest.raises(ValueError, match="config.aqn.enabled"):
        validate_config(config)
    config = _config()
    config.data.task = "gsm8k"
    with pytest.raises(ValueError, match="config.data.path"):
        validate_config(config)


def test_autotune_results_file_is_set_before_anything_else(tmp_path):
    """config.xla_autotune_results reaches qerl_jax.infra.xla_autotuning first thing: this test
    process has started JAX's backend, so the trainer refuses the file (XLA would ignore the
    flags) before it creates the workdir or builds anything."""
    jax.numpy.ones(1).block_until_ready()
    config = _config()
    config.xla_autotune_results = str(tmp_path / "autotune.textproto")
    with pytest.raises(ValueError, match="config.xla_autotune_results=.*already started"):
        Trainer(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def _assert_rollout_logprobs_equal_the_training_forward(trainer):
    """One rollout's per-token log-probs against the trainer's recomputed ones (1e-4)."""
    examples = trainer.iterator.next_batch()
    prompts, rollout, scores = trainer._sample_groups(examples, 0)
    batch, *_ = trainer._training_arrays(trainer._group_entries(prompts, rollout, scores))
    recomputed = np.asarray(trainer._logprobs_fn(trainer.trainable, trainer.frozen, batch))
    mask = np.asarray(rollout.mask)
    assert mask.sum() > 0
    np.testing.assert_allclose(recomputed * mask, np.asarray(rollout.logprobs) * mask, atol=1e-4)


@pytest.mark.parametrize("logits_chunk_size", [0, 5])
def test_rollout_logprobs_equal_the_training_forward(tmp_path, warm_cache, logits_chunk_size):
    """The sampler's per-token log-probs (temperature 1, no AQN) equal the trainer's recomputed
    ones on the same tokens: prompts, positions and completions line up in the training batch.
    Also with the log-probs computed 5 positions at a time (12 completion tokens: a ragged last
    chunk). float32 tiny model: 1e-4."""
    config = _config(logits_chunk_size=logits_chunk_size)
    config.aqn.enabled = False
    trainer = Trainer(config, _workdir(tmp_path, "logprobs", warm_cache))
    _assert_rollout_logprobs_equal_the_training_forward(trainer)


def test_warmup_cache_with_other_settings_is_refused(tmp_path, warm_cache):
    config = _config()
    config.warmup.steps = 41
    with pytest.raises(ValueError, match="steps: cached 40 vs now 41"):
        Trainer(config, _workdir(tmp_path, "other_warmup", warm_cache))


def test_dynamic_sampling_drops_zero_variance_groups_and_refills(tmp_path, warm_cache):
    config = _config(dynamic_sampling=True, dynamic_sampling_max_tries=3)
    trainer = Trainer(config, _workdir(tmp_path, "dapo", warm_cache))
    group, prompts_per_step = config.rollout.num_generations, config.train.prompts_per_step
    sample = trainer._sample_groups
    attempts = []

    def controlled(examples, attempt):
        """First attempt: groups 0 and 2 all-correct / all-wrong; later attempts all vary."""
        prompts, rollout, scores = sample(examples, attempt)
        total = np.tile(np.arange(group, dtype=np.float32), len(examples))
        if attempt == 0:
            total[0:group] = 2.2
            total[2 * group:3 * group] = 0.0
        attempts.append(total)
        return prompts, rollout, dict(scores, total=total)

    trainer._sample_groups = controlled
    (batch, rewards, _, _), _, _, dropped = trainer._collect_rollouts()
    assert len(attempts) == 2 and dropped == 2
    assert trainer.iterator.position == (0, 2 * prompts_per_step)
    totals = np.asarray(rewards["total"]).reshape(prompts_per_step, group)
    assert np.all(totals.std(axis=1) > 0)          # only groups with a learning signal
    np.testing.assert_array_equal(totals[:2], attempts[0].reshape(-1, group)[[1, 3]])
    assert np.all(np.abs(batch["advantages"]).reshape(prompts_per_step, group).max(1) > 0.1)


def test_kernels_are_enabled_only_where_they_can_run(monkeypatch):
    """build_model repacks for the Pallas kernels only for 4-bit weights, bf16 compute and
    quant.kernels.enabled (a float32-compute model would unpack the kernel layout on every
    call), donating the freshly built model's checkpoint-layout buffers, with the options of
    config.quant.kernels (gate/up pairs, Mosaic GPU choice, tunings) and the adapters' rank to
    come (lora.rank: a rank the Mosaic GPU kernel cannot take keeps the Triton kernels), then
    compacts the repacked weights where quant.kernels.compact_after_repack says."""
    from qerl_jax import model_setup
    from qerl_jax.model_quant import kernel_setup as kernels
    from qerl_jax.quant.kernel_options import KernelOptions
    calls = []

    def enable_kernels(model, options, **kwargs):
        calls.append((model, options, kwargs))

    monkeypatch.setattr(kernels, "enable_kernels", enable_kernels)
    monkeypatch.setattr(kernels, "enable_decode_attention", lambda **kwargs: None)
    compacted = []
    monkeypatch.setattr(model_setup, "compact_module",
                        lambda model: compacted.append(model) or 1)
    cases = [("nvfp4", "bfloat16", True, 1), ("nvfp4", "float32", True, 0),
             ("nvfp4", "bfloat16", False, 0), ("bf16", "bfloat16", True, 0)]
    for fmt, compute_dtype, enabled, expected in cases:
        config = _config()
        config.quant.format, config.quant.kernels.enabled = fmt, enabled
        config.model.compute_dtype = compute_dtype
        calls.clear()
        model_setup._maybe_enable_kernels("model", config)
        assert len(calls) == expected, (fmt, compute_dtype, enabled)
        assert all(options == KernelOptions() and kwargs == {"donate": True,
                                                             "lora_rank": config.lora.rank,
                                                             "mesh": None}   # one device
                   for _, options, kwargs in calls)
    # the repacked weights are compacted through host memory on a GPU ('auto'), or as asked
    assert compacted == []   # 'auto' on this CPU
    for compact, backend, expected in (("on", "cpu", ["model"]), ("off", "cpu", []),
                                       ("auto", "cpu", []), ("auto", "gpu", ["model"]),
                                       ("off", "gpu", [])):
        config = _config()
        config.quant.format, config.quant.kernels.compact_after_repack = "nvfp4", compact
        config.model.compute_dtype = "bfloat16"
        compacted.clear()
        with monkeypatch.context() as patch:
            patch.setattr(model_setup.jax, "default_backend", lambda: backend)
            model_setup._maybe_enable_kernels("model", config)
        assert compacted == expected, (compact, backend)
    config = _config()
    config.quant.format, config.quant.kernels.gate_up_pairs = "nvfp4", False
    config.quant.kernels.mosaic_nvfp4 = "off"
    config.quant.kernels.decode_matmul.block_n = 32
    config.model.compute_dtype = "bfloat16"
    calls.clear()
    model_setup._maybe_enable_kernels("model", config)
    [(_, options, _)] = calls
    assert (options.gate_up_pairs, options.mosaic_nvfp4, options.decode_matmul.block_n) == (
        False, "off", 32)
    # on a mesh: the matmul kernels per device where the weights are replicated; where fsdp
    # splits them, the decode attention only (per device)
    attention = []
    monkeypatch.setattr(kernels, "enable_decode_attention", lambda **kwargs:
                        attention.append(kwargs))
    config.quant.kernels.gate_up_pairs, config.quant.kernels.mosaic_nvfp4 = True, "auto"
    config.quant.kernels.decode_matmul.block_n = 64
    for shape, expected in (({"data": 4, "fsdp": 1, "tensor": 1}, 1),
                            ({"data": 2, "fsdp": 2, "tensor": 1}, 0)):
        mesh = types.SimpleNamespace(shape=shape, size=4)
        calls.clear()
        attention.clear()
        model_setup._maybe_enable_kernels("model", config, mesh)
        assert len(calls) == expected and all(kwargs["mesh"] is mesh for _, _, kwargs in calls)
        assert [kwargs["mesh"] for kwargs in attention] == ([] if expected else [mesh])


def test_reference_adapters_are_kept_only_for_the_kl_term(tmp_path, warm_cache):
    """beta != 0: a copy of the initial adapters (the reference policy); beta = 0: none (no
    second copy of every adapter on the device)."""
    with_kl = Trainer(_config(), _workdir(tmp_path, "kl", warm_cache))
    for ours, initial in zip(jax.tree_util.tree_leaves(with_kl.reference_trainable),
                             jax.tree_util.tree_leaves(with_kl.trainable)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(initial))
    config = _config()
    config.loss.beta = 0.0
    without_kl = Trainer(config, _workdir(tmp_path, "no_kl", warm_cache))
    assert without_kl.reference_trainable is None
    without_kl.train(stop_after=1)


def test_compilation_cache_is_written_then_read_with_the_same_numbers(tmp_path, warm_cache):
    """config.compilation_cache_dir: the first run writes its compiled programs there, a second
    run of the same config loads them (writes nothing new) and logs the same metrics; a path
    that cannot be a directory is refused naming the field."""
    from jax.experimental.compilation_cache import compilation_cache

    from qerl_jax.infra.compilation_cache import cache_entries, enable_compilation_cache
    cache = str(tmp_path / "xla_cache")
    config = _config(total_steps=2)
    config.compilation_cache_dir = cache
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # tiny programs too
    try:
        cold_dir = _workdir(tmp_path, "cold", warm_cache)
        Trainer(config, cold_dir).train()
        written = cache_entries(cache)
        assert written > 0
        warm_dir = _workdir(tmp_path, "warm", warm_cache)
        Trainer(config, warm_dir).train()
        assert cache_entries(cache) == written
        assert _comparable(read_metrics(warm_dir)) == _comparable(read_metrics(cold_dir))
        blocker = tmp_path / "a_file"
        blocker.write_text("")
        with pytest.raises(ValueError, match="config.compilation_cache_dir"):
            enable_compilation_cache(str(blocker / "cache"))
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()


def test_a_shrinking_rollout_batch_lines_up_with_the_training_forward(tmp_path, warm_cache):
    """rollout.shrink_batch reaches the sampler, and the log-probs of a rollout whose batch
    shrank as rows ended equal the trainer's recomputed ones (float32 tiny model: 1e-4)."""
    config = _config()
    config.aqn.enabled = False
    config.rollout.shrink_batch = True
    config.rollout.shrink_min_rows = 2
    trainer = Trainer(config, _workdir(tmp_path, "shrink", warm_cache))
    assert trainer.sampling.shrink_batch and trainer.sampling.shrink_min_rows == 2
    _assert_rollout_logprobs_equal_the_training_forward(trainer)


def test_attention_query_chunk_reaches_the_model(tmp_path, warm_cache):
    """config.model.attention_query_chunk is set on the built model (its config and every
    attention layer), also when the warm-up comes from the cache."""
    config = _config()
    config.model.attention_query_chunk = 8
    model = Trainer(config, _workdir(tmp_path, "chunk", warm_cache)).model()
    assert model.config.attention_query_chunk == 8
    assert all(layer.self_attn.query_chunk == 8 for layer in model.layers)


def test_attention_implementation_reaches_the_model(tmp_path, warm_cache):
    """config.model.attention_implementation goes through build_model's end point: the default
    'auto' resolves to 'xla' on this CPU, set on every attention layer; 'cudnn' here fails at
    build time with an error naming the setting and the backend (on an NVIDIA GPU both select
    cuDNN's fused attention)."""
    config = _config()
    assert config.model.attention_implementation == "auto"
    model = Trainer(config, _workdir(tmp_path, "auto", warm_cache)).model()
    assert model.config.attention_implementation == "xla"   # 'auto' on a CPU
    assert all(layer.self_attn.implementation == "xla" for layer in model.layers)
    config.model.attention_implementation = "cudnn"
    with pytest.raises(ValueError, match="attention_implementation='cudnn'.*backend is 'cpu'"):
        Trainer(config, _workdir(tmp_path, "cudnn", warm_cache)).model()


def test_sampler_compiled_with_weights_offloaded_gives_the_same_run(tmp_path, warm_cache):
    """rollout.offload_weights_for_compile='on' (the GPU's 'auto'; forced here on the CPU): each
    prompt bucket's sampler program is compiled ahead of time while the frozen weights wait in
    host memory, the jitted program is never compiled, the weights come back bit for bit, and
    the run logs the same metrics as one that compiles with the weights on the device, with no
    training program compiled twice."""
    from qerl_jax import sampling
    # JAX's compiled-program caches are process-wide LRUs (8192 jitted functions): after the
    # whole suite they evict entries, and the cache sizes below would count the suite's history
    jax.clear_caches()
    config = _config(total_steps=2)
    config.rollout.offload_weights_for_compile = "off"
    plain_dir = _workdir(tmp_path, "plain", warm_cache)
    plain = Trainer(config, plain_dir)
    assert not plain.offload_weights_for_compile
    plain.train()
    assert not Trainer(_config(), _workdir(tmp_path, "auto", warm_cache)
                       ).offload_weights_for_compile   # 'auto' on a CPU
    config.rollout.offload_weights_for_compile = "on"
    offload_dir = _workdir(tmp_path, "offload", warm_cache)
    trainer = Trainer(config, offload_dir)
    frozen_before = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(trainer.frozen)]
    jit_programs = sampling._generate_program._cache_size()
    trainer.train()
    assert sampling._generate_program._cache_size() == jit_programs
    # the weights came back as they were (committed or not): step 1 reuses step 0's programs
    assert trainer._grad_fn._cache_size() == plain._grad_fn._cache_size() == 1
    assert trainer._apply_update._cache_size() == plain._apply_update._cache_size() == 1
    assert len(trainer._sampler_programs) >= 1
    for before, after in zip(frozen_before, jax.tree_util.tree_leaves(trainer.frozen)):
        assert before.dtype == after.dtype
        np.testing.assert_array_equal(before, np.asarray(after))
    offloaded = read_metrics(offload_dir)
    assert offloaded[0]["time/sampler_compile_s"] > 0
    assert _comparable(offloaded) == _comparable(read_metrics(plain_dir))
    config.rollout.offload_weights_for_compile = "yes"
    with pytest.raises(ValueError, match="config.rollout.offload_weights_for_compile"):
        validate_config(config)
    config.rollout.offload_weights_for_compile = "on"
    config.rollout.offload_method = "disk"
    with pytest.raises(ValueError, match="config.rollout.offload_method"):
        validate_config(config)


def test_sampler_compiles_in_place_when_host_memory_runs_out(tmp_path, warm_cache, monkeypatch,
                                                            caplog):
    """rollout.offload_weights_for_compile='on' with too little host memory for the weights:
    the copy fails before any device buffer is freed, a warning says so, and the program is
    compiled with the weights on the device; the weights and the step are unaffected."""
    import qerl_jax.trainer as trainer_module

    def no_host_memory(tree, method="auto"):
        raise MemoryError("test: no host memory")

    monkeypatch.setattr(trainer_module, "offload_to_host", no_host_memory)
    config = _config(total_steps=1)
    config.rollout.offload_weights_for_compile = "on"
    trainer = Trainer(config, _workdir(tmp_path, "no_host_memory", warm_cache))
    frozen = jax.tree_util.tree_leaves(trainer.frozen)
    with caplog.at_level("WARNING", logger="qerl_jax.trainer"):
        metrics = trainer.train_step()
    assert "not enough host memory" in caplog.text
    assert len(trainer._sampler_programs) == 1 and np.isfinite(metrics["loss"])
    assert all(a is b for a, b in zip(frozen, jax.tree_util.tree_leaves(trainer.frozen)))


# ------------------------------------------------------------------ interrupts and resume
def _finished_run(tmp_path_factory, warm_cache, name: str, config):
    """An uninterrupted run of `config` in a new workdir with the warm-up cache: (workdir,
    trainer after its last step)."""
    workdir = str(tmp_path_factory.mktemp(name))
    shutil.copytree(warm_cache, os.path.join(workdir, "warmup"))
    trainer = Trainer(config, workdir)
    trainer.train()
    return workdir, trainer


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, warm_cache):
    """An uninterrupted run of _config(): its metrics and final trainable/optimizer state."""
    workdir, trainer = _finished_run(tmp_path_factory, warm_cache, "straight", _config())
    return (_comparable(read_metrics(workdir)),
            [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(trainer._state_arrays())])


def _assert_same_run(workdir, trainer, straight_run):
    metrics, leaves = straight_run
    assert _comparable(read_metrics(workdir)) == metrics
    after = jax.tree_util.tree_leaves(trainer._state_arrays())
    for expected, got in zip(leaves, after, strict=True):
        np.testing.assert_array_equal(expected, np.asarray(got))


def _interrupt_at(trainer, point, step, action):
    """Runs `action` (send a signal, raise) at `point` of step index `step`."""
    if point == "before_rollout":
        original = trainer.iterator.next_batch

        def next_batch():
            if trainer.step == step:
                action()
            return original()
        trainer.iterator.next_batch = next_batch
    elif point == "after_rollout":
        original = trainer._collect_rollouts

        def collect():
            result = original()
            if trainer.step == step:
                action()
            return result
        trainer._collect_rollouts = collect
    elif point == "after_update":
        original = trainer._apply_update

        def apply_update(*args):
            result = original(*args)
            if trainer.step == step:
                action()
            return result
        trainer._apply_update = apply_update


def _signal(signum):
    return lambda: os.kill(os.getpid(), signum)


def _raise():
    raise RuntimeError("a bug in the middle of a step")


@pytest.mark.parametrize("point, action, saved_step, exit_code", [
    ("before_rollout", _signal(signal.SIGINT), 4, 130),
    ("after_rollout", _signal(signal.SIGTERM), 4, 143),
    ("after_update", _signal(signal.SIGINT), 5, 130),    # deferred: the step completes first
    ("after_rollout", _raise, 4, None),
])
def test_interrupt_inside_a_step_resumes_exactly(tmp_path, warm_cache, straight_run, point,
                                                 action, saved_step, exit_code):
    """SIGINT/SIGTERM/an exception inside step 4 (before the rollout, after it, after the update)
    checkpoints the last completed step with its data position, exits with one line, and
    --resume gives metrics and final params bitwise equal to the uninterrupted run."""
    workdir = _workdir(tmp_path, "interrupted", warm_cache)
    trainer = Trainer(_config(), workdir)
    _interrupt_at(trainer, point, 4, action)
    if exit_code is None:
        with pytest.raises(RuntimeError, match="a bug in the middle"):
            trainer.train()
    else:
        with pytest.raises(TrainingStopped, match=f"at step {saved_step} of 6") as stopped:
            trainer.train()
        assert stopped.value.exit_code == exit_code
        assert "\n" not in str(stopped.value)
    assert TrainingCheckpoints(os.path.join(workdir, "checkpoints"),
                               read_only=True).latest_step() == saved_step
    assert [row["step"] for row in read_metrics(workdir)] == list(range(saved_step))
    resumed = Trainer(_config(), workdir, resume=True)
    assert resumed.step == saved_step
    resumed.train()
    _assert_same_run(workdir, resumed, straight_run)


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, warm_cache,
                                                                   straight_run, caplog, capfd):
    """The newest checkpoint (step 6) loses its arrays: resume skips it with one warning naming
    its path (no orbax traceback), moves it aside (nothing deleted), resumes from step 3 and
    ends equal."""
    workdir = _workdir(tmp_path, "damaged", warm_cache)
    Trainer(_config(), workdir).train()
    newest = os.path.join(workdir, "checkpoints", "6")
    shutil.rmtree(os.path.join(newest, "arrays"))
    capfd.readouterr()
    with caplog.at_level("WARNING"):
        trainer = Trainer(_config(), workdir, resume=True)
    console = "".join(capfd.readouterr())
    assert "Traceback" not in console and "Event loop is closed" not in console, console
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and newest in skipped[0]
    assert trainer.step == 3
    assert os.listdir(os.path.join(workdir, "checkpoints_damaged"))
    trainer.train()
    _assert_same_run(workdir, trainer, straight_run)


def test_fresh_run_into_a_used_workdir_is_refused_before_any_model_work(tmp_path, warm_cache):
    workdir = _workdir(tmp_path, "used", warm_cache)
    Trainer(_config(), workdir).train(stop_after=1)
    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        before = handle.read()
    with pytest.raises(ConfigError, match="holds an earlier run.*--resume.*--overwrite"):
        Trainer(_config(), workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        assert handle.read() == before
    trainer = Trainer(_config(), workdir, overwrite=True)
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    replaced, = [name for name in os.listdir(workdir) if name.startswith(REPLACED_PREFIX)]
    with open(os.path.join(workdir, replaced, "metrics.jsonl")) as handle:
        assert handle.read() == before   # moved aside, not deleted
    assert os.path.isdir(os.path.join(workdir, "warmup"))   # the cache stays
    trainer.train(stop_after=1)
    assert [row["step"] for row in read_metrics(workdir)] == [0]


def test_resume_with_a_changed_config_is_refused_per_field(tmp_path, warm_cache):
    """Fields that change what is trained are refused, one line each (name, old, new), before
    any model is built; harmless ones pass; --allow_config_change records the change; run.json
    keeps every start."""
    workdir = _workdir(tmp_path, "changed", warm_cache)
    Trainer(_config(), workdir).train(stop_after=3)
    changed = _config()
    changed.quant.format = "nf4"
    changed.lora.alpha = 8.0
    changed.train.learning_rate = 1e-4
    changed.checkpoint.every_steps = 2          # harmless
    with pytest.raises(ConfigError) as refused:
        Trainer(changed, workdir, resume=True)
    lines = str(refused.value).splitlines()
    assert "config.quant.format: was 'nvfp4' in the run being resumed, now 'nf4'" in lines
    assert "config.lora.alpha: was 16.0 in the run being resumed, now 8.0" in lines
    assert any(line.startswith("config.train.learning_rate: was 0.002") for line in lines)
    assert not any("every_steps" in line for line in lines)
    harmless = _config()
    harmless.checkpoint.every_steps = 2
    harmless.logging.tensorboard = not harmless.logging.tensorboard
    Trainer(harmless, workdir, resume=True).train(stop_after=1)
    allowed = _config()
    allowed.lora.alpha = 8.0
    Trainer(allowed, workdir, resume=True, allow_config_changes=True).train(stop_after=1)
    starts = read_starts(workdir)
    assert [start["start_step"] for start in starts] == [0, 3, 4]
    assert [c["field"] for c in starts[1]["config_changes"]] == ["checkpoint.every_steps",
                                                                   "logging.tensorboard"]
    assert {"field": "lora.alpha", "old": 16.0, "new": 8.0, "harmless": False} in \
        starts[2]["config_changes"]
    assert starts[2]["config"]["lora"]["alpha"] == 8.0


def _mount_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                            capture_output=True, text=True)
    return result.returncode == 0


def test_disk_full_stops_with_one_line_and_resumes_exactly(tmp_path, warm_cache, straight_run):
    """On a small tmpfs that fills up just before the step-6 checkpoint: one line naming the
    checkpoint path, checkpoint 3 intact; after space is freed, --resume ends equal to the
    uninterrupted run."""
    mount_point = str(tmp_path / "small_disk")
    if not _mount_tmpfs(mount_point, "64m"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        workdir = os.path.join(mount_point, "run")
        shutil.copytree(warm_cache, os.path.join(workdir, "warmup"))
        trainer = Trainer(_config(), workdir)
        filler = os.path.join(mount_point, "filler")
        save = trainer.save_checkpoint

        def save_on_a_full_disk():
            if trainer.step == 6 and not os.path.exists(filler):
                # Take every free byte, unbuffered: a buffered file keeps the tail of a partial
                # write and raises ENOSPC again when it is closed.
                descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
                try:
                    while True:
                        os.write(descriptor, b"\0" * (1 << 16))
                except OSError:
                    pass
                finally:
                    os.close(descriptor)
            save()
        trainer.save_checkpoint = save_on_a_full_disk
        with pytest.raises(TrainingStopped) as stopped:
            trainer.train()
        message = str(stopped.value)
        assert "\n" not in message
        assert f"could not write checkpoint {os.path.join(workdir, 'checkpoints', '6')}: " \
            "no space left on device" in message
        assert TrainingCheckpoints(os.path.join(workdir, "checkpoints"),
                                   read_only=True).all_steps() == [3]
        os.remove(filler)
        resumed = Trainer(_config(), workdir, resume=True)
        assert resumed.step == 3
        resumed.train()
        _assert_same_run(workdir, resumed, straight_run)
    finally:
        subprocess.run(["umount", "-l", mount_point], capture_output=True)


def test_a_step_without_a_valid_token_records_its_means_as_missing(tmp_path, warm_cache):
    """Every completion truncated and masked (no end token can end one): the step's loss and
    per-token means are null in metrics.jsonl (not 0), the gradient norm a real 0, the curves
    drawn without them."""
    config = _config()
    config.loss.mask_truncated_completions = True
    workdir = _workdir(tmp_path, "truncated", warm_cache)
    trainer = Trainer(config, workdir)
    trainer.sampling = dataclasses.replace(trainer.sampling, eos_token_ids=())
    history = trainer.train(stop_after=2)
    rows = read_metrics(workdir)
    for row, metrics in zip(rows, history, strict=True):
        assert row["truncated_fraction"] == 1.0
        for key in ("loss", "entropy", "kl", "clip_fraction", "rollout/kl",
                    "rollout/ratio_outside_2x", "rollout/corrected_token_fraction",
                    "rollout/corrected_sequence_fraction"):
            assert row[key] is None and metrics[key] is None, key
        assert row["grad_norm"] == 0.0 and np.isfinite(row["reward"])
    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        assert "NaN" not in handle.read()


def test_rollout_mismatch_is_logged_and_truncated_importance_sampling_runs(tmp_path,
                                                                           warm_cache):
    """rollout/kl and rollout/ratio_outside_2x compare the sampler's log-probs with the
    training forward's: ~0 where both are the same noise-free float32 policy (the two agree to
    1e-4 per token, so k3 < 1e-6), larger where AQN noise (sigma 0.05) perturbs the rollout
    policy; with loss.rollout_correction = token_truncate at cap 2 the steps train with finite
    losses."""
    config = _config()
    config.aqn.enabled = False
    Trainer(config, _workdir(tmp_path, "no_aqn", warm_cache)).train(stop_after=1)
    row = read_metrics(str(tmp_path / "no_aqn"))[0]
    assert abs(row["rollout/kl"]) < 1e-6 and row["rollout/ratio_outside_2x"] == 0.0
    config = _config()
    config.aqn.sigma_start, config.aqn.sigma_end = 0.05, 0.01
    config.loss.rollout_correction, config.loss.rollout_correction_cap = "token_truncate", 2.0
    Trainer(config, _workdir(tmp_path, "aqn", warm_cache)).train(stop_after=3)
    rows = read_metrics(str(tmp_path / "aqn"))
    assert rows[0]["aqn_sigma"] == 0.0 and rows[2]["aqn_sigma"] > 0.0
    assert rows[2]["rollout/kl"] > 100 * max(rows[0]["rollout/kl"], 1e-9)
    assert all(np.isfinite(row["loss"]) for row in rows)


# ------------------------------------------------------------------ held-out evaluation
def _eval_config():
    """_config() evaluating every 2 of its 6 steps on 8 held-out problems in batches of 3 (a
    ragged last batch), its sampler programs compiled with the weights offloaded (the GPU's
    path; the same numbers as without)."""
    config = _config()
    config.eval.every_steps = 2
    config.eval.num_examples = 8
    config.eval.batch_size = 3
    config.rollout.offload_weights_for_compile = "on"
    return config


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, warm_cache):
    """An uninterrupted run of _eval_config(): (workdir, trainer after its last step)."""
    return _finished_run(tmp_path_factory, warm_cache, "eval_run", _eval_config())


def test_eval_rows_at_step_0_every_n_steps_and_after_the_last(eval_run):
    """Rows 0, 2, 4 carry eval/* beside their training metrics; the final policy (6 updates)
    gets a row of its own; the curves gain the held-out panel."""
    from qerl_jax.plots import training_curves_figure
    workdir, trainer = eval_run
    rows = read_metrics(workdir)
    assert [row["step"] for row in rows] == list(range(7))
    assert [row["step"] for row in rows if "eval/pass@1" in row] == [0, 2, 4, 6]
    assert set(rows[6]) == {"step", *EVAL_KEYS}
    assert all("reward" in row for row in rows[:6])
    for row in rows[0:7:2]:
        assert row["eval/num_examples"] == 8 and 0.0 <= row["eval/pass@1"] <= 1.0
        assert 0 < row["eval/mean_length"] <= trainer.config.rollout.max_new_tokens
    # held out: no question of the training set
    assert not {e.question for e in trainer.eval_examples} & {
        e.question for e in trainer.iterator.examples}
    assert os.path.isfile(os.path.join(workdir, "curves.png"))
    axes = {axis.get_ylabel() for axis in training_curves_figure(rows, title="run").axes}
    assert "held-out pass@1" in axes


def test_eval_changes_no_training_number(eval_run, straight_run):
    """Same seed, eval on or off: every training metric and the final params bitwise equal."""
    workdir, trainer = eval_run
    rows = [{k: v for k, v in row.items() if k not in EVAL_KEYS}
            for row in read_metrics(workdir)[:6]]
    _assert_same_run_rows(rows, trainer, straight_run)


def _assert_same_run_rows(rows, trainer, straight_run):
    metrics, leaves = straight_run
    assert _comparable(rows) == metrics
    for expected, got in zip(leaves, jax.tree_util.tree_leaves(trainer._state_arrays()),
                             strict=True):
        np.testing.assert_array_equal(expected, np.asarray(got))


def test_eval_pass_at_1_equals_evaluate_on_the_same_params(tmp_path, warm_cache, eval_run):
    """The row of the base model (step 0) and of the final policy (step 6) hold what
    qerl_jax.evaluation.evaluate_model computes on the same model: jitted program, not the
    offloaded compile, same examples, greedy."""
    from qerl_jax.evaluation import evaluate_model
    workdir, trained = eval_run
    rows = read_metrics(workdir)
    base = Trainer(_eval_config(), _workdir(tmp_path, "base", warm_cache))
    config = base.config
    for trainer, row in ((base, rows[0]), (trained, rows[6])):
        result = evaluate_model(trainer.model(), trainer.tokenizer, trainer.eval_examples,
                                task=config.data.task, sampling=trainer.eval_sampling,
                                max_prompt_length=config.data.max_prompt_length,
                                batch_size=config.eval.batch_size,
                                prompt_style=config.data.prompt_style,
                                use_chat_template=config.data.use_chat_template,
                                data=config.data)
        assert result["problems"] == row["eval/num_examples"] == 8
        assert (result["pass@1"], result["mean_length"]) == (row["eval/pass@1"],
                                                             row["eval/mean_length"])
    assert trainer.eval_sampling.greedy and trainer.eval_sampling.max_new_tokens == 12


def test_accuracy_is_the_tasks_correctness_reward_even_untrained_with(tmp_path, warm_cache):
    """`accuracy` is the task's correctness reward (arithmetic: 'arithmetic') > 0: a run
    rewarded by format alone still measures it, without summing it into the reward; its
    first rollout (drawn before any update) scores as a run trained with that reward."""
    rows = {}
    for names in (("arithmetic", "format"), ("format",)):
        config = _config(total_steps=1, dynamic_sampling=False)
        config.rewards.names = names
        workdir = _workdir(tmp_path, "_".join(names), warm_cache)
        Trainer(config, workdir).train()
        rows[names] = read_metrics(workdir)[0]
    trained_with, format_only = rows[("arithmetic", "format")], rows[("format",)]
    assert format_only["accuracy"] == trained_with["accuracy"]
    # the arithmetic reward is 0 or 1 per completion: its mean is the fraction correct
    assert trained_with["accuracy"] == trained_with["reward/arithmetic"]
    assert "reward/arithmetic" not in format_only
    assert format_only["reward"] == format_only["reward/format"] == trained_with["reward/format"]


def test_resume_with_eval_is_exact(tmp_path, warm_cache, eval_run):
    """Stopped after step 2 (an evaluating step comes next) and resumed: the same rows, eval
    rows included, and the same final params as the uninterrupted run."""
    reference_dir, reference = eval_run
    workdir = _workdir(tmp_path, "eval_resumed", warm_cache)
    Trainer(_eval_config(), workdir).train(stop_after=2)
    assert [row["step"] for row in read_metrics(workdir) if "eval/pass@1" in row] == [0]
    resumed = Trainer(_eval_config(), workdir, resume=True)
    assert resumed.step == 2
    resumed.train()
    assert _comparable(read_metrics(workdir)) == _comparable(read_metrics(reference_dir))
    for x, y in zip(jax.tree_util.tree_leaves(reference._state_arrays()),
                    jax.tree_util.tree_leaves(resumed._state_arrays()), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bad_eval_settings_are_refused_before_any_model_work(tmp_path):
    for field, value, message in (("every_steps", -1, "must be >= 0, got -1"),
                                  ("num_examples", 0, "must be > 0, got 0"),
                                  ("max_new_tokens", -4, "must be >= 0, got -4"),
                                  ("batch_size", 0, "must be > 0, got 0"),
                                  ("data_path", "test.jsonl", "'test.jsonl' is unused by task "
                                                              "'arithmetic'"),
                                  ("num_examples", 10_000, "10000 is more than the")):
        config = _eval_config()
        config.eval[field] = value
        with pytest.raises(ConfigError) as error:
            Trainer(config, str(tmp_path / "run"))
        assert str(error.value).startswith(f"config.eval.{field}: {message}"), error.value
        assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()
