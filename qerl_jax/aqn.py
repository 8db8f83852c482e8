"""Adaptive Quantization Noise (QeRL section 3.3): scheduled Gaussian noise on RMSNorm scales.

z ~ N(0, sigma(step)^2 I) of shape [hidden] is added, in float32, to each decoder layer's
input_layernorm and post_attention_layernorm scale of the *rollout* policy. Since
(w + z) * x / rms(x) = (1 + z / w) * (w * x / rms(x)), this is row-wise multiplicative noise on
the q/k/v and gate/up weights that follow, with no change to the quantized matmul.

Everything here is a pure function of (base key, step, schedule): the noisy scales are made
fresh from the clean state at every step, so nothing accumulates across steps (the released
code's in-place noise does not have that property). The schedule kinds are registered functions
(AQN_SCHEDULES, `register_aqn_schedule`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.registry import AQN_SCHEDULES

_DECODER_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclasses.dataclass(frozen=True)
class AQNSchedule:
    """Exponential-decay noise schedule over `total_steps` split into `stages` stages.

    kind='released_code' (default, what the released scripts run): K-1 levels
      s_j = start * (end/start)^(j/(K-2)), j = 0..K-2; interval = floor(step / (T/K));
      interval 0 -> 0, interval i >= 1 -> s_{min(i-1, K-2)}.
    kind='paper' (QeRL eq. in section 3.3): stage k = floor(step * K / T); stage 0 -> 0,
      stage k >= 1 -> start * (end/start)^((k-1)/(K-1)).
    """

    total_steps: int
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    stages: int = 10
    kind: str = "released_code"

    def __post_init__(self):
        if self.kind not in AQN_SCHEDULES:
            raise ValueError(AQN_SCHEDULES.unknown_message(self.kind))
        if self.total_steps <= 0:
            raise ValueError(f"aqn total_steps={self.total_steps} must be positive")
        if self.stages < 3:
            raise ValueError(f"aqn stages={self.stages} must be >= 3")
        if not (self.sigma_start > 0 and self.sigma_end > 0):
            raise ValueError(f"aqn sigma_start={self.sigma_start} and sigma_end="
                             f"{self.sigma_end} must be positive")


def register_aqn_schedule(name: str):
    """Registers a schedule kind: (step float32 scalar, AQNSchedule) -> float32 noise std."""
    return AQN_SCHEDULES.register(name)


def aqn_sigma(step, schedule: AQNSchedule) -> jax.Array:
    """The noise std at optimizer step `step` (int or traced int32) -> float32 scalar."""
    step = jnp.asarray(step, jnp.float32)
    return AQN_SCHEDULES.get(schedule.kind)(step, schedule)


@register_aqn_schedule("released_code")
def _released_code_sigma(step, schedule: AQNSchedule) -> jax.Array:
    k, total = schedule.stages, schedule.total_steps
    ratio = schedule.sigma_end / schedule.sigma_start
    interval = jnp.floor(step / (total / k))
    level = jnp.minimum(interval - 1, k - 2)
    sigma = schedule.sigma_start * ratio ** (level / (k - 2))
    return jnp.where(interval < 1, 0.0, sigma).astype(jnp.float32)


@register_aqn_schedule("paper")
def _paper_sigma(step, schedule: AQNSchedule) -> jax.Array:
    k, total = schedule.stages, schedule.total_steps
    ratio = schedule.sigma_end / schedule.sigma_start
    stage = jnp.minimum(jnp.floor(step * k / total), k - 1)
    sigma = schedule.sigma_start * ratio ** ((stage - 1) / (k - 1))
    return jnp.where(stage < 1, 0.0, sigma).astype(jnp.float32)


def _is_decoder_norm_scale(path) -> bool:
    names = [getattr(part, "key", getattr(part, "name", None)) for part in path]
    return (len(names) >= 3 and names[0] == "layers" and "scale" in names
            and any(norm in names for norm in _DECODER_NORMS))


def aqn_noisy_state(state: nnx.State, key: jax.Array, step, schedule: AQNSchedule) -> nnx.State:
    """The state with fresh noise added to every decoder layer's norm scales (float32).

    Args:
      state: the model state (nnx.split); it is not modified.
      key: the run's AQN base key; the draw for `step` is fold_in(key, step), and each norm
        gets fold_in(that, its index), so the result depends on (key, step, schedule) only.
    Returns:
      A new state whose decoder norm scales are float32 (scale + z); everything else shared.
    """
    sigma = aqn_sigma(step, schedule)
    step_key = jax.random.fold_in(key, jnp.asarray(step, jnp.uint32))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    out, index = [], 0
    for path, leaf in leaves:
        if _is_decoder_norm_scale(path):
            noise = sigma * jax.random.normal(jax.random.fold_in(step_key, index), leaf.shape,
                                              jnp.float32)
            leaf = leaf.astype(jnp.float32) + noise
            index += 1
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)
