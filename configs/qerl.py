"""QeRL released-script hyperparameters, variant 'qerl' (see qerl_jax.experiment_config).

    python -m qerl_jax.train --config configs/qerl.py:7b,gsm8k \
        --config.model.hf_path=/path/to/Qwen2.5-7B-Instruct --workdir runs/qerl_7b_gsm8k
Spec 'SIZE,DATASET': SIZE in 3b/7b/14b/32b, DATASET in gsm8k/bigmath.
"""

from qerl_jax.released_configs import released_script_config


def get_config(spec="7b,gsm8k"):
    return released_script_config("qerl", spec)
