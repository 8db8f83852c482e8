"""run.json's config comparison on resume (which changes are refused, which are harmless) and
the run directory's guards: nothing of an earlier run is deleted or silently restarted."""

import os
import shutil

import pytest

from qerl_jax.experiment_config import field_defaults
from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.run_record import (REPLACED_PREFIX, check_workdir, check_workdir_path,
                                       config_changes, move_aside)


def test_changes_are_listed_per_field_and_classified():
    old = {"quant": {"format": "nvfp4"}, "logging": {"tensorboard": False},
           "lora": {"target_modules": ["q_proj", "v_proj"]}}
    new = {"quant": {"format": "nf4"}, "logging": {"tensorboard": True},
           "lora": {"target_modules": ("q_proj", "v_proj")}}
    assert config_changes(old, new) == [
        {"field": "logging.tensorboard", "old": False, "new": True, "harmless": True},
        {"field": "quant.format", "old": "nvfp4", "new": "nf4", "harmless": False}]


def test_a_loss_type_and_its_alias_are_no_change():
    assert config_changes({"loss": {"loss_type": "bnpo"}},
                          {"loss": {"loss_type": "micro_batch_token_mean"}}) == []
    assert config_changes({"loss": {"loss_type": "bnpo"}},
                          {"loss": {"loss_type": "dapo"}})[0]["harmless"] is False


def test_a_field_added_since_at_its_default_is_no_change():
    defaults = field_defaults()
    assert config_changes({"loss": {"beta": 0.0}},
                          {"loss": {"beta": 0.0, "rollout_correction_cap": 3.0}},
                          defaults) == []
    assert config_changes({"loss": {"beta": 0.0}},
                          {"loss": {"beta": 0.0, "rollout_correction_cap": 2.0}}, defaults) == [
        {"field": "loss.rollout_correction_cap", "old": None, "new": 2.0, "harmless": False}]
    # without the schema's defaults a field the old run lacked is a change
    assert config_changes({"loss": {"beta": 0.0}},
                          {"loss": {"beta": 0.0, "rollout_correction_cap": 3.0}})[0]["old"] is None


def test_a_run_recorded_with_rollout_is_cap_resumes_under_the_fields_that_replaced_it():
    """rollout_is_cap 0 was no correction, cap c > 0 token_truncate at c: a resume with those
    settings changes nothing; another mode or cap is a change of what is trained."""
    defaults = field_defaults()
    new = {"loss": {"rollout_correction": "none", "rollout_correction_cap": 3.0}}
    assert config_changes({"loss": {"rollout_is_cap": 0.0}}, new, defaults) == []
    truncate = {"loss": {"rollout_correction": "token_truncate", "rollout_correction_cap": 2.0}}
    assert config_changes({"loss": {"rollout_is_cap": 2.0}}, truncate, defaults) == []
    assert config_changes({"loss": {"rollout_is_cap": 2.0}}, new, defaults) == [
        {"field": "loss.rollout_correction", "old": "token_truncate", "new": "none",
         "harmless": False},
        {"field": "loss.rollout_correction_cap", "old": 2.0, "new": 3.0, "harmless": False}]


def _earlier_run(workdir):
    os.makedirs(os.path.join(workdir, "checkpoints", "2"))
    os.makedirs(os.path.join(workdir, "warmup"))
    for name, text in (("run.json", '{"starts": []}'), ("metrics.jsonl", '{"step": 0}\n'),
                       ("checkpoints/2/data", "x"), ("warmup/model", "w")):
        with open(os.path.join(workdir, name), "w") as handle:
            handle.write(text)


def test_overwrite_moves_the_earlier_run_aside_and_keeps_the_warmup(tmp_path):
    workdir = str(tmp_path)
    _earlier_run(workdir)
    with pytest.raises(ConfigError, match="holds an earlier run"):
        check_workdir(workdir, {}, resume=False, overwrite=False, allow_config_changes=False)
    plan = check_workdir(workdir, {}, resume=False, overwrite=True, allow_config_changes=False)
    assert plan.move_aside == ("run.json", "metrics.jsonl", "checkpoints")
    assert os.path.isfile(os.path.join(workdir, "run.json"))   # checking moved nothing
    target = move_aside(workdir, plan.move_aside)
    assert os.path.basename(target).startswith(REPLACED_PREFIX)
    assert sorted(os.listdir(workdir)) == sorted([os.path.basename(target), "warmup"])
    with open(os.path.join(target, "checkpoints", "2", "data")) as handle:
        assert handle.read() == "x"


def test_a_resume_without_a_checkpoint_but_with_metrics_needs_restart(tmp_path):
    workdir = str(tmp_path)
    _earlier_run(workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
    with pytest.raises(ConfigError, match=r"no checkpoint in .* but the run left metrics.jsonl: "
                                          r"pass --restart"):
        check_workdir(workdir, {}, resume=True, overwrite=False, allow_config_changes=False)
    plan = check_workdir(workdir, {}, resume=True, overwrite=False, allow_config_changes=False,
                         restart=True)
    assert plan.move_aside == ("run.json", "metrics.jsonl")
    with pytest.raises(ConfigError, match="--restart goes with --resume"):
        check_workdir(workdir, {}, resume=False, overwrite=True, allow_config_changes=False,
                      restart=True)
    # an empty directory (or only the warm-up cache) resumes as a fresh start
    assert check_workdir(str(tmp_path / "new"), {}, resume=True, overwrite=False,
                         allow_config_changes=False).move_aside == ()


def test_an_unusable_workdir_path_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=f"--workdir {blocker}/a/b: cannot be created, "
                                          f"{blocker} is a file"):
        check_workdir_path(str(blocker / "a" / "b"))
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        check_workdir_path(str(blocker))
