"""experiments/study_variants.py: a study format's '+' parts resolved in their registries (a
plug-in's names included), refused with one line, turned into config overrides with every
unnamed part at the schema's default, and read back from a recorded config."""

import os

import pytest

from experiments import ablation_analysis as analysis
from experiments import format_ablation
from experiments import study_variants as variants
from qerl_jax import registry
from qerl_jax.experiment_config import field_defaults

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")


def _defaults(*fields):
    defaults = field_defaults()
    return {field: defaults[field] for field in fields}


AXIS_FIELDS = ("loss.policy_objective", "loss.rollout_correction", "loss.advantage_estimator")


def test_format_overrides():
    """A format sets quant.format, aqn.enabled and every axis field; the parts it does not name
    at the schema's defaults."""
    assert variants.format_overrides("nvfp4+aqn") == {"quant.format": "nvfp4",
                                                      "aqn.enabled": True,
                                                      **_defaults(*AXIS_FIELDS)}
    assert variants.format_overrides("bf16") == {"quant.format": "bf16", "aqn.enabled": False,
                                                 **_defaults(*AXIS_FIELDS)}
    assert variants.format_overrides("nvfp4+aqn+gspo+sequence_mask+rloo") == {
        "quant.format": "nvfp4", "aqn.enabled": True, "loss.policy_objective": "gspo",
        "loss.rollout_correction": "sequence_mask", "loss.advantage_estimator": "rloo"}
    # tis: token_truncate with the cap at 2, whatever the schema's cap
    assert variants.format_overrides("nvfp4+aqn+tis") == {
        "quant.format": "nvfp4", "aqn.enabled": True, **_defaults(AXIS_FIELDS[0], AXIS_FIELDS[2]),
        "loss.rollout_correction": "token_truncate", "loss.rollout_correction_cap": 2.0}


@pytest.mark.parametrize("axis", variants.AXES, ids=lambda axis: axis.kind)
def test_each_registered_name_is_a_part(axis):
    """Every name (aliases too) of each axis's registry, a plug-in's included, is a '+' part
    setting that axis's field to the registered name, the other axes at their defaults."""
    names = getattr(registry, axis.registry)
    plugin = f"toy_{axis.kind}"
    names.register(plugin, object())
    try:
        for name in names.names(with_aliases=True):
            variant = variants.parse_variant(f"nvfp4+aqn+{name}")
            assert variant.parts == ((axis.kind, name),) and variant.aqn
            overrides = variants.format_overrides(f"nvfp4+aqn+{name}")
            assert overrides[axis.field] == names.canonical(name)
            others = [field for field in AXIS_FIELDS if field != axis.field]
            assert {field: overrides[field] for field in others} == _defaults(*others)
        assert plugin in names.names()
    finally:
        names.unregister(plugin)


def test_bad_parts_are_refused(tmp_path, capsys):
    """Unknown, misplaced or repeated parts: one line naming the part and the known names."""
    with pytest.raises(ValueError, match="unknown weight format 'fp8'; known: bf16"):
        variants.parse_variant("fp8+aqn")
    with pytest.raises(ValueError, match=r"unknown part 'nosuch'; known: aqn, tis; policy "
                                         r"objective: clipped_surrogate, .*rollout correction: "
                                         r"none, .*advantage estimator: group_normalized"):
        variants.parse_variant("nvfp4+aqn+nosuch")
    with pytest.raises(ValueError, match="'aqn' repeats a kind or is out of order"):
        variants.parse_variant("nvfp4+gspo+aqn")
    with pytest.raises(ValueError, match="'cispo' repeats a kind"):
        variants.parse_variant("nvfp4+gspo+cispo")
    with pytest.raises(ValueError, match="'tis' repeats a kind"):
        variants.parse_variant("nvfp4+token_mask+tis")
    assert format_ablation.main(["--formats", "nvfp4,nvfp4+aqn+nosuch", "--out",
                                 str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("--formats: format 'nvfp4+aqn+nosuch': unknown part 'nosuch'")
    assert "\n" not in error and not os.listdir(tmp_path)


def test_plugin_names_are_parts():
    """A weight format registered by a module of config.imports is a study format."""
    # an earlier test in this pytest run may have imported it
    if "toy_int8" not in registry.FORMATS:
        with pytest.raises(ValueError, match="unknown weight format 'toy_int8'"):
            format_ablation.check_formats(CONFIG, ["toy_int8+aqn"])
    format_ablation.check_formats(CONFIG, ["toy_int8+aqn"], ["imports=('tests.plugin_toy',)"])
    assert variants.format_overrides("toy_int8+aqn")["quant.format"] == "toy_int8"


def test_read_back_from_run_json():
    """The format of a recorded config: the parts at a value other than the schema's default,
    in grammar order; token_truncate at cap 2 (and a run.json's older rollout_is_cap > 0) is
    tis; a field the run did not record is at its default."""
    def config(aqn=True, **loss):
        return {"quant": {"format": "nvfp4"}, "aqn": {"enabled": aqn}, "loss": loss}

    defaults = {"policy_objective": "clipped_surrogate", "rollout_correction": "none",
                "rollout_correction_cap": 3.0, "advantage_estimator": "group_normalized"}
    assert variants.format_of_config(config(**defaults)) == "nvfp4+aqn"
    assert variants.format_of_config(config(aqn=False)) == "nvfp4"
    assert variants.format_of_config(config(**{**defaults, "policy_objective": "cispo"})) \
        == "nvfp4+aqn+cispo"
    assert variants.format_of_config(config(
        advantage_estimator="rloo", rollout_correction="sequence_mask",
        policy_objective="gspo_token")) == "nvfp4+aqn+gspo_token+sequence_mask+rloo"
    assert variants.format_of_config(config(rollout_correction="token_truncate",
                                            rollout_correction_cap=2.0)) == "nvfp4+aqn+tis"
    assert variants.format_of_config(config(rollout_correction="token_truncate",
                                            rollout_correction_cap=3.0)) \
        == "nvfp4+aqn+token_truncate"
    assert variants.format_of_config(config(rollout_is_cap=2.0)) == "nvfp4+aqn+tis"
    assert variants.format_of_config(config(rollout_is_cap=0.0)) == "nvfp4+aqn"
    variant = variants.variant_of_config(config(policy_objective="gspo"))
    assert variant == variants.Variant("nvfp4", True, (("objective", "gspo"),))


def test_plan_forces_unnamed_parts_to_defaults(tmp_path):
    """The config's own objective / correction / estimator reach only the columns that name
    them; each column's directory is its format as read back from its config."""
    out = str(tmp_path)
    formats = ["nvfp4+aqn", "nvfp4+aqn+gspo", "nvfp4+aqn+tis", "nvfp4+aqn+sequence_mask+rloo"]
    specs = format_ablation.plan_runs(
        os.path.abspath(CONFIG), formats, [0],
        ["train.total_steps=3", "loss.policy_objective=cispo", "loss.advantage_estimator=rloo",
         "loss.rollout_correction=token_mask", "loss.rollout_correction_cap=3.5"], out)
    losses = [spec.config_json["loss"] for spec in specs]
    assert [loss["policy_objective"] for loss in losses] == [
        "clipped_surrogate", "gspo", "clipped_surrogate", "clipped_surrogate"]
    assert [loss["rollout_correction"] for loss in losses] == [
        "none", "none", "token_truncate", "sequence_mask"]
    assert [loss["rollout_correction_cap"] for loss in losses] == [3.5, 3.5, 2.0, 3.5]
    assert [loss["advantage_estimator"] for loss in losses] == [
        "group_normalized", "group_normalized", "group_normalized", "rloo"]
    assert [spec.format for spec in specs] == formats
    assert [variants.format_of_config(spec.config_json) for spec in specs] == formats
    assert [os.path.relpath(spec.directory, out) for spec in specs] == [
        os.path.join(name, "seed0") for name in ("nvfp4_aqn", "nvfp4_aqn_gspo", "nvfp4_aqn_tis",
                                                 "nvfp4_aqn_sequence_mask_rloo")]
    assert len({spec.warmup_directory for spec in specs}) == 1   # the loss is not warm-up
    # a named default is the same column
    with pytest.raises(ValueError, match="'nvfp4' and 'nvfp4\\+clipped_surrogate' select the same"):
        format_ablation.plan_runs(os.path.abspath(CONFIG), ["nvfp4", "nvfp4+clipped_surrogate"],
                                  [0], ["train.total_steps=3"], out)
    assert "nvfp4+aqn+tis" not in analysis.FORMATS   # the script's default set: the five
    assert format_ablation._parse_args([]).formats == ",".join(analysis.FORMATS)
    assert "nvfp4+aqn+tis" in analysis.FORMAT_COLORS
