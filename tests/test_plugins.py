"""Plug-ins and registries: a format, loss normalizer, reward and task registered by a module
outside the package (tests/plugin_toy.py) train the tiny model when the command line names them;
every registry refuses an unknown name in one line listing the known ones; every lazily listed
built-in resolves to what registers it."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import registry
from qerl_jax.data.prompts import build_prompt_text
from qerl_jax.registry import PROMPT_STYLES, TASKS, Registry
from qerl_jax.rewards.registry import get_reward_functions
from qerl_jax.tasks import get_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join("configs", "tiny.py")

ALL_REGISTRIES = [value for value in vars(registry).values() if isinstance(value, Registry)]


def _known_names_line(message: str, names: Registry) -> None:
    assert "\n" not in message, message
    assert message.endswith("known: " + ", ".join(names.names(with_aliases=True))), message


@pytest.mark.parametrize("names", ALL_REGISTRIES, ids=lambda names: names.kind)
def test_every_registry_refuses_an_unknown_name_in_one_line(names):
    with pytest.raises(KeyError) as error:
        names.get("no_such_name")
    message = error.value.args[0]
    assert message.startswith(f"unknown {names.kind} 'no_such_name'; ")
    _known_names_line(message, names)


def _lookups():
    """(registry, a call that looks up 'no_such_name' where users' names are resolved)."""
    from qerl_jax.aqn import AQNSchedule
    from qerl_jax.models.config import preset
    from qerl_jax.quant.formats import get_format
    from qerl_jax.rl.advantages import advantages
    from qerl_jax.rl.losses import LossConfig

    name = "no_such_name"
    return [
        (registry.FORMATS, lambda: get_format(name)),
        (registry.LOSS_NORMALIZERS, lambda: LossConfig(loss_type=name)),
        (registry.POLICY_OBJECTIVES, lambda: LossConfig(policy_objective=name)),
        (registry.ADVANTAGE_ESTIMATORS, lambda: advantages(jnp.zeros(4), 2, name)),
        (registry.AQN_SCHEDULES, lambda: AQNSchedule(total_steps=10, kind=name)),
        (registry.MODEL_PRESETS, lambda: preset(name)),
        (PROMPT_STYLES, lambda: build_prompt_text(None, "q", style=name,
                                                  use_chat_template=False)),
        (TASKS, lambda: get_task(name)),
    ]


def test_the_lookups_that_resolve_users_names_refuse_in_one_line():
    for names, lookup in _lookups():
        with pytest.raises(ValueError) as error:
            lookup()
        _known_names_line(str(error.value), names)
    with pytest.raises(ValueError, match="unknown reward function"):
        get_reward_functions(["no_such_name"])


def test_lazily_listed_builtins_resolve_and_keep_their_facts():
    for names in (registry.FORMATS, registry.LOSS_NORMALIZERS, registry.POLICY_OBJECTIVES,
                  registry.ADVANTAGE_ESTIMATORS, registry.AQN_SCHEDULES,
                  registry.MODEL_PRESETS, registry.REWARDS, registry.TASKS,
                  PROMPT_STYLES):
        for name, value in names.items():
            assert value is not None and not isinstance(value, str), (names.kind, name)
    for name, fmt in registry.FORMATS.items():
        assert fmt.name == name
        assert registry.FORMATS.fact(name, "is_quantized") == fmt.is_quantized
    assert not registry.FORMATS.get("bf16").is_quantized


_LIST_BEFORE_AND_AFTER_IMPORTS = """
import importlib, json
from qerl_jax import registry
kinds = {key: value for key, value in vars(registry).items()
         if isinstance(value, registry.Registry)}
before = {key: value.names(with_aliases=True) for key, value in kinds.items()}
for module in ("qerl_jax.quant", "qerl_jax.rl", "qerl_jax.aqn", "qerl_jax.models",
               "qerl_jax.rewards", "qerl_jax.tasks", "qerl_jax.data.prompts",
               "qerl_jax.sampling", "qerl_jax.lora", "qerl_jax.trainer"):
    importlib.import_module(module)
after = {key: value.names(with_aliases=True) for key, value in kinds.items()}
print(json.dumps([before, after]))
"""


def test_every_builtin_name_is_listed_before_its_module_loads():
    """The names the package registers are the ones qerl_jax.registry lists without importing
    it (so the schema and --help know every built-in without JAX)."""
    result = subprocess.run([sys.executable, "-c", _LIST_BEFORE_AND_AFTER_IMPORTS], cwd=REPO,
                            capture_output=True, text=True, timeout=300, check=True)
    before, after = json.loads(result.stdout.strip().splitlines()[-1])
    assert before == after


def test_a_lazy_entry_is_filled_by_its_module_and_refuses_others(tmp_path, monkeypatch):
    names = Registry("probe")
    names.register_lazy("listed", "probe_lazy_module", answer=42)
    names.register_lazy("by_attr", "probe_lazy_module:VALUE")
    assert names.names() == ("listed", "by_attr") and names.fact("listed", "answer") == 42
    with pytest.raises(ValueError, match="'listed' is already registered"):
        names.register("listed", object())   # not while its module is being imported
    (tmp_path / "probe_lazy_module.py").write_text(
        "import types\n"
        "from tests.test_plugins import PROBE\n"
        "VALUE = 'by attribute'\n"
        "PROBE.register('listed', types.SimpleNamespace(answer=42))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(globals(), "PROBE", names)
    assert names.get("listed").answer == 42
    assert names.get("by_attr") == "by attribute"
    sys.modules.pop("probe_lazy_module", None)


TOY_NAMES = ((registry.FORMATS, "toy_int8"), (registry.LOSS_NORMALIZERS, "toy_sequence_sum"),
             (registry.REWARDS, "toy_contains_gold"), (registry.TASKS, "toy_doubling"))


@pytest.fixture
def toy_plugin():
    """tests/plugin_toy.py imported in this process, its names removed afterwards (so that the
    other tests see the built-in registries)."""
    import tests.plugin_toy
    yield tests.plugin_toy
    for names, name in TOY_NAMES:
        names.unregister(name)
    sys.modules.pop("tests.plugin_toy", None)


def test_the_toy_format_takes_the_xla_path(toy_plugin):
    """The plug-in format's module is all it takes: quantize, dequantize, the linear op."""
    from qerl_jax.quant import linear
    from qerl_jax.quant.formats import get_format

    fmt = get_format("toy_int8")
    rng = np.random.default_rng()
    weight = rng.normal(size=(48, 64)).astype(np.float32)
    quantized = fmt.quantize(jnp.asarray(weight))
    dense = np.asarray(quantized.dequantize(jnp.float32), np.float64)
    # absmax int8: each element within half a code step of its block's scale
    steps = np.repeat(np.abs(weight).reshape(48, 4, 16).max(-1) / 127.0, 16, axis=1)
    assert np.all(np.abs(dense - weight) <= 0.5 * steps + 1e-6)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    out = np.asarray(linear(jnp.asarray(x), quantized, compute_dtype=jnp.float32), np.float64)
    np.testing.assert_allclose(out, x.astype(np.float64) @ dense.T, rtol=1e-4, atol=1e-4)
    assert jax.tree_util.tree_structure(quantized).num_leaves == 2   # codes, block scales


def test_plugins_named_on_the_command_line_train_the_tiny_model(tmp_path):
    workdir = tmp_path / "run"
    args = ["--config", TINY, "--workdir", str(workdir),
            "--config.imports=('tests.plugin_toy',)",
            "--config.quant.format=toy_int8", "--config.loss.loss_type=toy_sequence_sum",
            "--config.data.task=toy_doubling", "--config.data.arithmetic_count=1000",
            "--config.rewards.names=('toy_contains_gold', 'format')",
            "--config.warmup.steps=5", "--config.model.overrides.num_hidden_layers=2",
            "--config.train.total_steps=2", "--config.train.prompts_per_step=4",
            "--config.rollout.num_generations=4", "--config.rollout.max_new_tokens=8",
            "--config.train.micro_batch_size=16", "--config.logging.progress_bar=False",
            "--config.checkpoint.every_steps=1000"]
    result = subprocess.run([sys.executable, "-m", "qerl_jax.train", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "toy_int8: " in result.stderr and "mean relative error" in result.stderr
    with open(workdir / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    steps = [record for record in records if "loss" in record]
    assert len(steps) == 2, records
    assert all(np.isfinite(record["loss"]) for record in steps)
    assert any("toy_contains_gold" in key for key in steps[0]), sorted(steps[0])
