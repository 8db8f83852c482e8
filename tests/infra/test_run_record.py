"""run.json's config comparison on resume: which changes are refused, which are harmless."""

from qerl_jax.infra.run_record import config_changes


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
    assert config_changes({"loss": {"beta": 0.0}},
                          {"loss": {"beta": 0.0, "rollout_is_cap": 0.0}}) == []
    assert config_changes({"loss": {"beta": 0.0}},
                          {"loss": {"beta": 0.0, "rollout_is_cap": 2.0}}) == [
        {"field": "loss.rollout_is_cap", "old": None, "new": 2.0, "harmless": False}]
