"""The config schema and validate_config: every field has a default and a description, every
name field reads its registry (plug-ins' names included), and each bad value, unknown field or
ignored input is refused with one line naming the full field path."""

import dataclasses
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from qerl_jax import experiment_config, registry
from qerl_jax.experiment_config import (FIELDS, base_config, field_descriptions,
                                        validate_config)
from qerl_jax.infra.errors import ConfigError
from qerl_jax.registry import PROMPT_STYLES, REWARDS, TASKS, Registry
from qerl_jax.released_configs import released_script_config
from tests.conftest import config_from_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_config_file = config_from_file


def _tiny():
    return _config_file("tiny")


def _with(config, **fields):
    """A copy of `config` with dotted fields ('a__b' for a.b) replaced, built from a plain dict
    so that a value of another type reaches validate_config (a ConfigDict refuses it)."""
    tree = config.to_dict()
    for name, value in fields.items():
        *sections, leaf = name.split("__")
        node = tree
        for section in sections:
            node = node[section]
        node[leaf] = value
    return ml_collections.ConfigDict(tree)


def _gsm8k(tmp_path, **fields):
    """The tiny config on a GSM8K-style file task (arithmetic fields at their defaults)."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    config = _tiny()
    config.data.task, config.data.path = "gsm8k", str(data)
    config.data.arithmetic_count = FIELDS["data.arithmetic_count"].default
    return _with(config, **fields)


# field -> the registry its names come from
REGISTRY_FIELDS = {
    "quant.format": registry.FORMATS,
    "loss.loss_type": registry.LOSS_NORMALIZERS,
    "loss.policy_objective": registry.POLICY_OBJECTIVES,
    "loss.advantage_estimator": registry.ADVANTAGE_ESTIMATORS,
    "loss.rollout_correction": registry.ROLLOUT_CORRECTIONS,
    "aqn.schedule": registry.AQN_SCHEDULES,
    "model.preset": registry.MODEL_PRESETS,
    "rollout.kv_cache_dtype": registry.KV_CACHE_DTYPES,
    "rollout.offload_method": registry.OFFLOAD_METHODS,
    "rollout.offload_weights_for_compile": registry.SWITCH,
    "quant.kernels.mosaic_nvfp4": registry.SWITCH,
    "quant.kernels.compact_after_repack": registry.SWITCH,
    "distributed.initialize": registry.SWITCH,
    "quant.kernels.mosaic_schedule": registry.MOSAIC_SCHEDULES,
    "quant.kernels.decode_matmul.weight_as_lhs": registry.WEIGHT_AS_LHS,
    "quant.kernels.decode_matmul.decoder": registry.KERNEL_DECODERS,
    "data.prompt_style": PROMPT_STYLES,
    "data.task": TASKS,
    "lora.target_modules": registry.LORA_PROJECTIONS,
    "rewards.names": REWARDS,
    "data.arithmetic_phrasing": registry.ARITHMETIC_PHRASINGS,
}


@pytest.mark.parametrize("path", sorted(REGISTRY_FIELDS))
def test_choices_are_read_from_the_registries(path):
    """Each name field accepts every registered name and alias, and a name registered after
    the schema was built; an unregistered name gets the registry's one-line refusal."""
    names, check = REGISTRY_FIELDS[path], FIELDS[path].check
    as_value = (lambda name: (name,)) if isinstance(FIELDS[path].default, tuple) else str
    for name in names.names(with_aliases=True):
        assert check(as_value(name)) is None, (path, name)
    assert check(as_value("probe_name")) == names.unknown_message("probe_name")
    names.register("probe_name", object())
    try:
        assert check(as_value("probe_name")) is None
    finally:
        names.unregister("probe_name")
    assert check(as_value("probe_name")) == names.unknown_message("probe_name")


def test_the_schema_keeps_no_copy_of_a_registry():
    for name in ("FORMATS", "SCHEDULES", "TASKS", "LOSS_TYPES", "LOSS_TYPE_ALIASES",
                 "REWARD_NAMES", "PRESET_NAMES", "KV_CACHE_DTYPES", "MOSAIC_SCHEDULES",
                 "KERNEL_DECODERS", "ON_OFF_AUTO", "WEIGHT_AS_LHS", "OFFLOAD_METHODS",
                 "ALL_PROJECTIONS", "PROMPT_STYLES"):
        value = getattr(experiment_config, name, None)
        assert value is None or isinstance(value, Registry), name
    assert FIELDS["lora.target_modules"].default == registry.LORA_PROJECTIONS.names()


def test_model_config_fields_equal_the_dataclass():
    """model.overrides keys are ModelConfig's fields (the dataclass imports JAX)."""
    from qerl_jax.models.config import ModelConfig

    assert experiment_config.MODEL_CONFIG_FIELDS == tuple(
        field.name for field in dataclasses.fields(ModelConfig))


def test_aqn_needs_a_quantized_format_by_the_registry_fact():
    for name in registry.FORMATS.names():
        config = _with(_tiny(), quant__format=name)
        if registry.FORMATS.fact(name, "is_quantized"):
            validate_config(config)
        else:
            with pytest.raises(ConfigError, match=r"^config.aqn.enabled: AQN is defined"):
                validate_config(config)


def test_imports_are_imported_before_validation(tmp_path, monkeypatch):
    (tmp_path / "schema_probe_plugin.py").write_text(
        "from qerl_jax.registry import LOSS_NORMALIZERS\n"
        "LOSS_NORMALIZERS.register('schema_probe_sum', object())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _with(_tiny(), loss__loss_type="schema_probe_sum")
    with pytest.raises(ConfigError, match=r"^config.loss.loss_type: unknown loss type "
                                          r"'schema_probe_sum'; known: "):
        validate_config(config)
    try:
        validate_config(_with(config, imports=("schema_probe_plugin",)))
    finally:
        registry.LOSS_NORMALIZERS.unregister("schema_probe_sum")
    with pytest.raises(ConfigError) as error:
        validate_config(_with(_tiny(), imports=("no_such_plugin_module",)))
    assert str(error.value) == ("config.imports: cannot import 'no_such_plugin_module': "
                                "ModuleNotFoundError: No module named 'no_such_plugin_module'")
    with pytest.raises(ConfigError, match=r"^config.imports: must be a tuple of names"):
        validate_config(_with(_tiny(), imports="schema_probe_plugin"))


def test_config_module_imports_without_jax():
    code = ("import sys, qerl_jax.experiment_config, qerl_jax.train; "
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'transformers') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_every_field_has_a_default_and_a_one_line_description():
    assert set(experiment_config.config_leaves(base_config())) == set(FIELDS)
    descriptions = field_descriptions()
    assert list(descriptions) == [f"config.{path}" for path in FIELDS]
    for path, description in descriptions.items():
        assert description.strip() and "\n" not in description, path
        assert description.endswith("."), path
    validate_config(_with(base_config(), model__preset="tiny_qwen2", warmup__steps=1,
                          data__task="arithmetic"))


def test_new_fields_and_defaults():
    config = base_config()
    assert config.rewards.time_limit_seconds == 5.0
    assert config.logging.tensorboard is True
    validate_config(_with(_tiny(), rewards__time_limit_seconds=0.0))
    with pytest.raises(ConfigError, match=r"^config.rewards.time_limit_seconds: must be >= 0, "
                                          r"got -1.0$"):
        validate_config(_with(_tiny(), rewards__time_limit_seconds=-1.0))


def test_shipped_configs_validate(tmp_path):
    validate_config(_tiny())
    checkpoint = tmp_path / "Qwen2.5-7B-Instruct"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    for variant in ("qerl", "lora", "qlora", "mxfp4"):
        for spec in ("7b,gsm8k", "3b,bigmath"):
            config = _config_file(variant, spec)
            with pytest.raises(ConfigError, match="config.model.hf_path: 'Qwen/.*' is not a "
                                                  "local HF checkpoint directory"):
                validate_config(config)
            config.model.hf_path = str(checkpoint)
            validate_config(config)
    with pytest.raises(ConfigError, match="config spec '9b,gsm8k'"):
        released_script_config("qerl", "9b,gsm8k")


BAD_VALUES = [
    # (field, value, message after 'config.FIELD: ')
    ("rollout.temperature", 0.0, "must be > 0, got 0.0"),
    ("rollout.temperature", -1.0, "must be > 0, got -1.0"),
    ("rollout.top_p", 0.0, "must be in (0, 1], got 0.0"),
    ("rollout.top_p", 1.5, "must be in (0, 1], got 1.5"),
    ("rollout.top_k", -1, "must be >= 0, got -1"),
    ("rollout.num_generations", 1, "must be >= 2, got 1"),
    ("rollout.max_new_tokens", 0, "must be > 0, got 0"),
    ("rollout.prompt_bucket", 0, "must be > 0, got 0"),
    ("rollout.offload_weights_for_compile", "yes", "unknown switch 'yes'; known: auto, on, off"),
    ("rollout.offload_method", "disk", "unknown offload method 'disk'; known: auto, numpy, "
                                       "pinned_host"),
    ("aqn.sigma_start", -0.01, "must be > 0, got -0.01"),
    ("aqn.sigma_end", -1e-4, "must be > 0, got -0.0001"),
    ("aqn.stages", 2, "must be >= 3, got 2"),
    ("aqn.schedule", "linear", "unknown AQN schedule 'linear'; known: released_code, paper"),
    ("lora.alpha", 0.0, "must be > 0, got 0.0"),
    ("lora.rank", 0, "must be > 0, got 0"),
    ("lora.target_modules", ("qkv_proj",), "unknown LoRA projection 'qkv_proj'; known: "
                                           "q_proj, k_proj"),
    ("loss.epsilon_low", -0.1, "must be in [0, 1), got -0.1"),
    ("loss.epsilon_low", 1.0, "must be in [0, 1), got 1.0"),
    ("loss.epsilon_high", -0.1, "must be >= 0, got -0.1"),
    ("loss.beta", -0.04, "must be >= 0, got -0.04"),
    ("loss.top_entropy_quantile", 0.0, "must be in (0, 1], got 0.0"),
    ("loss.top_entropy_quantile", 1.2, "must be in (0, 1], got 1.2"),
    ("loss.loss_type", "ppo", "unknown loss type 'ppo'; known: sequence_mean, "
                              "micro_batch_token_mean, constant_length_sum, batch_token_mean, "
                              "grpo, bnpo, dr_grpo, dapo"),
    ("loss.policy_objective", "ppo", "unknown policy objective 'ppo'; known: "
                                     "clipped_surrogate, gspo, gspo_token, cispo"),
    ("loss.advantage_estimator", "gae", "unknown advantage estimator 'gae'; known: "
                                        "group_normalized, mean_centered, rloo, grpo, drgrpo"),
    ("loss.gspo_epsilon_low", 1.0, "must be in [0, 1), got 1.0"),
    ("loss.gspo_epsilon_high", -1e-4, "must be >= 0, got -0.0001"),
    ("loss.cispo_epsilon_max", 0.0, "must be > 0, got 0.0"),
    ("loss.rollout_correction", "tis", "unknown rollout correction 'tis'; known: none, "
                                       "token_truncate, token_mask, sequence_truncate, "
                                       "sequence_mask"),
    ("loss.rollout_correction_cap", 0.0, "must be > 0, got 0.0"),
    ("data.limit", -1, "must be >= 0, got -1"),
    ("data.max_prompt_length", 0, "must be > 0, got 0"),
    ("data.prompt_style", "chat", "unknown prompt style 'chat'; known: paper, system, plain"),
    ("data.task", "gsm9k", "unknown task 'gsm9k'; known: gsm8k, math, arithmetic"),
    ("eval.every_steps", -1, "must be >= 0, got -1"),
    ("eval.num_examples", 0, "must be > 0, got 0"),
    ("eval.max_new_tokens", -1, "must be >= 0, got -1"),
    ("eval.batch_size", 0, "must be > 0, got 0"),
    ("eval.data_path", None, "must be a string, got None (None)"),
    ("checkpoint.max_to_keep", 0, "must be >= 1, got 0"),
    ("checkpoint.every_steps", 0, "must be > 0, got 0"),
    ("train.total_steps", 0, "must be > 0, got 0"),
    ("train.learning_rate", 0.0, "must be > 0, got 0.0"),
    ("train.learning_rate", float("nan"), "must be finite, got nan"),
    ("train.warmup_ratio", 1.0, "must be in [0, 1), got 1.0"),
    ("train.weight_decay", -0.1, "must be >= 0, got -0.1"),
    ("train.adam_b2", 1.0, "must be in [0, 1), got 1.0"),
    ("train.max_grad_norm", 0.0, "must be > 0, got 0.0"),
    ("train.num_iterations", 0, "must be >= 1, got 0"),
    ("train.max_consecutive_nonfinite", 0, "must be >= 1, got 0"),
    ("train.dynamic_sampling_max_tries", 0, "must be >= 1, got 0"),
    ("train.logits_chunk_size", -1, "must be >= 0, got -1"),
    ("warmup.steps", -1, "must be >= 0, got -1"),
    ("warmup.learning_rate", 0.0, "must be > 0, got 0.0"),
    ("model.param_dtype", "float16", "'float16' not in ('bfloat16', 'float32')"),
    ("model.compute_dtype", "int8", "'int8' not in ('bfloat16', 'float32', 'float16')"),
    ("model.attention_query_chunk", -8, "must be >= 0, got -8"),
    ("model.attention_implementation", "flash", "'flash' not in ('auto', 'xla', 'cudnn')"),
    ("model.preset", "qwen3_8b", "unknown model preset 'qwen3_8b'; known: qwen2p5_0p5b, "),
    ("quant.format", "fp8", "unknown weight format 'fp8'; known: bf16, nvfp4, mxfp4, nf4"),
    ("rewards.names", (), "must name at least one reward; known: "),
    ("rewards.names", ("format", "accuracy"), "unknown reward 'accuracy'; known: "),
    ("rewards.names", ("format", "format"), "names a function twice"),
    ("seed", -1, "must be >= 0, got -1"),
    # types
    ("train.total_steps", 1.5, "must be an integer, got 1.5 (float)"),
    ("train.prompts_per_step", True, "must be an integer, got True (bool)"),
    ("rollout.temperature", "1", "must be a number, got '1' (str)"),
    ("quant.kernels.enabled", 1, "must be True or False, got 1 (int)"),
    ("quant.kernels.mosaic_nvfp4", "yes", "unknown switch 'yes'; known: auto, on, off"),
    ("quant.kernels.compact_after_repack", "always", "unknown switch 'always'; known: auto, "
                                                     "on, off"),
    ("quant.kernels.decode_matmul.decoder", "bits", "unknown 4-bit decoder 'bits'; known: "),
    ("imports", ("ok", 3), "must be a tuple of names, got ('ok', 3) (tuple)"),
    ("quant.kernels.mosaic_prefetch_tiles", 4, "must be in [0, 3], got 4"),
    ("quant.kernels.decode_matmul.block_n", 48, "48 not in (16, 32, 64)"),
    ("data.path", None, "must be a string, got None (None)"),
    ("rewards.names", "format", "must be a tuple of names, got 'format' (str)"),
    ("model.overrides", 3, "must be a mapping, got 3 (int)"),
    ("xla_autotune_results", 3, "must be a string, got 3 (int)"),
]


@pytest.mark.parametrize("field,value,message", BAD_VALUES,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_bad_values_name_the_field(field, value, message):
    config = _with(_tiny(), **{field.replace(".", "__"): value})
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    text = str(error.value)
    assert text.startswith(f"config.{field}: {message}"), text
    assert "\n" not in text
    assert isinstance(error.value, ValueError)


def test_aqn_sigma_start_below_sigma_end_is_refused():
    with pytest.raises(ConfigError, match=r"^config.aqn.sigma_end: 0.01 must be <= "
                                          r"aqn.sigma_start=0.0001 \(the noise decays\)$"):
        validate_config(_with(_tiny(), aqn__sigma_start=1e-4, aqn__sigma_end=1e-2))
    validate_config(_with(_tiny(), aqn__sigma_start=1e-3, aqn__sigma_end=1e-3))  # constant


def test_unknown_fields_are_refused_with_a_suggestion():
    config = _tiny()
    config.train.lerning_rate = 1.0
    with pytest.raises(ConfigError, match=r"^config.train.lerning_rate: unknown field; did you "
                                          r"mean config.train.learning_rate\?$"):
        validate_config(config)
    config = _tiny()
    config.trian = ml_collections.ConfigDict({"learning_rate": 1.0})
    with pytest.raises(ConfigError, match=r"^config.trian.learning_rate: unknown field; did "
                                          r"you mean config.train.learning_rate\?$"):
        validate_config(config)
    config = _tiny()
    config.zzz_notes = "x"
    with pytest.raises(ConfigError, match=r"^config.zzz_notes: unknown field$"):
        validate_config(config)
    config = _with(_tiny(), model__overrides={"hiden_size": 8})
    with pytest.raises(ConfigError, match=r"^config.model.overrides.hiden_size: not a "
                                          r"ModelConfig field; did you mean "
                                          r"config.model.overrides.hidden_size\?$"):
        validate_config(config)


def test_missing_fields_are_refused():
    tree = _tiny().to_dict()
    del tree["rewards"]["time_limit_seconds"]
    with pytest.raises(ConfigError, match=r"^config.rewards.time_limit_seconds: missing"):
        validate_config(ml_collections.ConfigDict(tree))
    tree = _tiny().to_dict()
    tree["train"] = 3
    with pytest.raises(ConfigError, match=r"^config.train: must be a section of fields"):
        validate_config(ml_collections.ConfigDict(tree))


def test_model_combinations(tmp_path):
    with pytest.raises(ConfigError, match=r"^config.model.preset: set model.preset"):
        validate_config(_with(_tiny(), model__preset=""))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^config.model.hf_path: set model.preset .* not "
                                          r"both$"):
        validate_config(_with(_tiny(), model__hf_path=str(checkpoint)))
    hf = _with(_tiny(), model__preset="", model__hf_path=str(checkpoint), model__overrides={})
    with pytest.raises(ConfigError, match=r"^config.warmup.steps: 250: the supervised warm-up "
                                          r"trains a preset model from scratch"):
        validate_config(hf)
    hf = _with(hf, warmup__steps=0, data__arithmetic_max_operand=20)
    validate_config(hf)
    with pytest.raises(ConfigError, match=r"^config.model.overrides.hidden_size: shapes a "
                                          r"preset model only"):
        validate_config(_with(hf, model__overrides={"hidden_size": 64}))
    validate_config(_with(hf, model__overrides={"attention_query_chunk": 64}))
    with pytest.raises(ConfigError, match=r"^config.model.hf_path: '.*missing' is not a local "
                                          r"HF checkpoint directory"):
        validate_config(_with(hf, model__hf_path=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"^config.model.overrides.param_dtype: set "
                                          r"config.model.param_dtype instead$"):
        validate_config(_with(_tiny(), model__overrides={"param_dtype": "float32"}))
    with pytest.raises(ConfigError, match=r"^config.model.tokenizer_path: unused: the "
                                          r"warm-up"):
        validate_config(_with(_tiny(), model__tokenizer_path=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"^config.model.tokenizer_path: required for a "
                                          r"preset model without warm-up"):
        validate_config(_with(_tiny(), warmup__steps=0))
    with pytest.raises(ConfigError, match=r"^config.model.tokenizer_path: '.*nowhere' is not "
                                          r"a directory$"):
        validate_config(_with(_tiny(), warmup__steps=0,
                              model__tokenizer_path=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match=r"^config.model.attention_query_chunk: 8 applies to "
                                          r"the 'xla' attention only"):
        validate_config(_with(_tiny(), model__attention_query_chunk=8,
                              model__attention_implementation="cudnn"))


def test_data_inputs_that_would_be_ignored_are_refused(tmp_path):
    for field, value in (("path", "/data/train.jsonl"), ("subset", "main"), ("split", "test")):
        with pytest.raises(ConfigError, match=rf"^config.data.{field}: '{value}' is unused by "
                                              "task 'arithmetic'"):
            validate_config(_with(_tiny(), **{f"data__{field}": value}))
    validate_config(_gsm8k(tmp_path))
    with pytest.raises(ConfigError, match=r"^config.data.path: task 'gsm8k' needs a "
                                          r"\.jsonl/\.parquet file or a hub dataset name$"):
        validate_config(_gsm8k(tmp_path, data__path=""))
    with pytest.raises(ConfigError, match=r"^config.data.arithmetic_count: 64 is unused by "
                                          r"task 'gsm8k'"):
        validate_config(_gsm8k(tmp_path, data__arithmetic_count=64))
    with pytest.raises(ConfigError, match=r"^config.data.arithmetic_phrasing: 'question' is "
                                          r"unused by task 'gsm8k'"):
        validate_config(_gsm8k(tmp_path, data__arithmetic_phrasing="question"))
    validate_config(_with(_tiny(), data__arithmetic_phrasing="question"))
    with pytest.raises(ConfigError, match=r"^config.data.arithmetic_phrasing"):
        validate_config(_with(_tiny(), data__arithmetic_phrasing="words"))
    # the warm-up draws its problems up to data.arithmetic_max_operand: used with a file task
    validate_config(_gsm8k(tmp_path, data__arithmetic_max_operand=9))
    with pytest.raises(ConfigError, match=r"^config.data.arithmetic_max_operand: 9 is unused "
                                          r"by task 'gsm8k' without warm-up"):
        validate_config(_gsm8k(tmp_path, data__arithmetic_max_operand=9, warmup__steps=0,
                               model__tokenizer_path=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"^config.data.limit: 8 examples are fewer than one "
                                          r"step's train.prompts_per_step=16$"):
        validate_config(_with(_tiny(), data__limit=8))
    with pytest.raises(ConfigError, match=r"^config.data.arithmetic_count: 8 problems are "
                                          r"fewer than one step's train.prompts_per_step=16$"):
        validate_config(_with(_tiny(), data__arithmetic_count=8))


def test_training_combinations():
    with pytest.raises(ConfigError, match=r"^config.train.micro_batch_size: 48 must divide "
                                          r"prompts_per_step \* num_generations = 128$"):
        validate_config(_with(_tiny(), train__micro_batch_size=48))
    with pytest.raises(ConfigError, match=r"^config.aqn.enabled: AQN is defined for quantized "
                                          r"bases only"):
        validate_config(_with(_tiny(), quant__format="bf16"))
    with pytest.raises(ConfigError, match=r"^config.lora.target_modules: \(\) with "
                                          r"lora.train_norms=False leaves nothing to train$"):
        validate_config(_with(_tiny(), lora__target_modules=(), lora__train_norms=False))
    validate_config(_with(_tiny(), lora__target_modules=()))   # norms only


def test_knobs_of_a_switched_off_feature_are_accepted():
    """A config that sets a feature's knobs and switches it off runs as documented (the
    released configs set AQN's sigmas for every variant)."""
    validate_config(_with(_tiny(), aqn__enabled=False, aqn__sigma_start=0.5, aqn__stages=4,
                          aqn__apply_in_training=True))
    validate_config(_with(_tiny(), train__dynamic_sampling=False,
                          train__dynamic_sampling_max_tries=9))
    validate_config(_with(_tiny(), quant__kernels__enabled=False,
                            quant__kernels__gate_up_pairs=False))
