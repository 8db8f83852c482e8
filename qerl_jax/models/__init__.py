"""Qwen2.5 / Llama decoders as Flax NNX modules, KV cache, presets and HF checkpoint I/O."""

from qerl_jax.models.config import ModelConfig, PRESETS, preset
from qerl_jax.models.kv_cache import KVCache, init_kv_cache
from qerl_jax.models.transformer import (CausalLM, abstract_model, count_parameters,
                                         decode_step, init_model, positions_from_mask, prefill)

__all__ = ["ModelConfig", "PRESETS", "preset", "KVCache", "init_kv_cache", "CausalLM",
           "abstract_model", "count_parameters", "decode_step", "init_model",
           "positions_from_mask", "prefill"]
