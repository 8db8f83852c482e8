"""Decoder configuration (Qwen2 / Qwen2.5 and Llama 3.x) and the published presets.

The config is a frozen dataclass that validates itself at construction: a bad field raises a
ValueError naming the field. `ModelConfig.from_hf_dict` reads an HF `config.json`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp

from qerl_jax.registry import MODEL_PRESETS

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
# How the full-sequence (training) attention is computed; the cached sampler paths always use
# the XLA einsums (prefill) or the decode-attention kernel (qerl_jax.models.attention_dispatch).
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def dtype_from_name(name: str, field: str = "dtype"):
    """Maps 'bfloat16' / 'float32' / 'float16' to the jnp dtype; raises naming `field`."""
    if name not in _DTYPES:
        raise ValueError(f"{field}={name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x rotary frequency scaling (HF rope_type 'llama3'); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of one decoder-only model.

    Attributes mirror the HF config names. `param_dtype` is the storage dtype of the
    parameters, `compute_dtype` the dtype of activations and matmuls; RMSNorm, softmax and the
    logits are always computed in float32. `remat` wraps each decoder layer in
    jax.checkpoint for training (gradient checkpointing). `attention_query_chunk`: the XLA
    attention of sequences longer than this runs over blocks of this many queries (lax.map,
    each block under jax.checkpoint), so the program's [chunk, S] float32 scores replace the
    [T, S] ones (0, the default: all T queries at once); opt-in, for long sequences (docs/
    decisions.md has the measurement).
    `attention_implementation`: how the full-sequence attention (training and the log-prob
    passes) is computed: 'xla' (default) materializes the float32 [T, S] scores per layer;
    'cudnn' calls cuDNN's fused flash attention through jax.nn.dot_product_attention, which
    keeps only [T] softmax statistics for the backward (NVIDIA GPU, bfloat16 / float16 compute
    only; see transformer.set_attention_implementation, which also resolves the trainer
    config's default 'auto' to one of the two). Not combinable with query chunks.
    """

    model_type: str = "qwen2"
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = True
    mlp_bias: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    param_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"
    remat: bool = False
    attention_query_chunk: int = 0
    attention_implementation: str = "xla"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; expected one of "
                f"{SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set head_dim explicitly")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta={self.rope_theta!r} must be positive and finite")
        if not (0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be in (0, 1)")
        dtype_from_name(self.param_dtype, "param_dtype")
        dtype_from_name(self.compute_dtype, "compute_dtype")
        if not isinstance(self.attention_query_chunk, int) or self.attention_query_chunk < 0:
            raise ValueError(f"attention_query_chunk={self.attention_query_chunk!r} must be an "
                             "integer >= 0 (0 = no chunking)")
        if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention_implementation={self.attention_implementation!r} is "
                             f"not one of {ATTENTION_IMPLEMENTATIONS}")
        if self.attention_implementation != "xla" and self.attention_query_chunk:
            raise ValueError(
                f"attention_query_chunk={self.attention_query_chunk} applies to the 'xla' "
                f"attention only; attention_implementation="
                f"{self.attention_implementation!r} never materializes the [T, S] scores. "
                "Set one of them.")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else (
            self.hidden_size // self.num_attention_heads)

    @property
    def jnp_param_dtype(self):
        return dtype_from_name(self.param_dtype, "param_dtype")

    @property
    def jnp_compute_dtype(self):
        return dtype_from_name(self.compute_dtype, "compute_dtype")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        """Exact parameter count implied by the architecture (embeddings and lm_head included)."""
        hidden, head_dim = self.hidden_size, self.resolved_head_dim
        q_out = self.num_attention_heads * head_dim
        kv_out = self.num_key_value_heads * head_dim
        attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
        if self.attention_bias:
            attention += q_out + 2 * kv_out
        mlp = 3 * hidden * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + hidden
        layer = attention + mlp + 2 * hidden
        embeddings = self.vocab_size * hidden
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * hidden
        return self.num_hidden_layers * layer + embeddings + lm_head + hidden

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], source: str = "config.json",
                     **overrides) -> "ModelConfig":
        """Builds a config from an HF config.json dict; errors name `source` and the field."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported; expected one of "
                f"{SUPPORTED_MODEL_TYPES}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (silu)")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        # transformers < 5 writes rope_theta + rope_scaling; >= 5 nests both in rope_parameters.
        rope_parameters = hf.get("rope_parameters") or {}
        raw_scaling = hf.get("rope_scaling") or rope_parameters
        rope_type = raw_scaling.get("rope_type", raw_scaling.get("type"))
        rope_scaling = None
        if rope_type == "llama3":
            try:
                rope_scaling = RopeScaling(
                    factor=float(raw_scaling["factor"]),
                    low_freq_factor=float(raw_scaling["low_freq_factor"]),
                    high_freq_factor=float(raw_scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        raw_scaling["original_max_position_embeddings"]))
            except KeyError as error:
                raise ValueError(f"{source}: llama3 rope scaling lacks {error}") from None
        elif rope_type not in (None, "default"):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported "
                             "(supported: default, llama3)")
        rope_theta = hf.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        default_bias = model_type == "qwen2"
        fields = dict(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            num_key_value_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            head_dim=hf.get("head_dim"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(hf.get("attention_bias", default_bias)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
        )
        fields.update(overrides)
        try:
            return cls(**fields)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json for this architecture (transformers reads it back)."""
        hf: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if self.model_type == "qwen2"
                              else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.head_dim is not None:
            hf["head_dim"] = self.head_dim
        if self.model_type == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = self.mlp_bias
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_id:
            hf["eos_token_id"] = (self.eos_token_id[0] if len(self.eos_token_id) == 1
                                  else list(self.eos_token_id))
        return hf


# ------------------------------------------------------------------------------ presets
# From the published HF config.json files of Qwen/Qwen2.5-*-Instruct.
def register_preset(name: str):
    """Registers a preset: a function (**overrides) -> ModelConfig."""
    return MODEL_PRESETS.register(name)


def _qwen2p5(**fields) -> ModelConfig:
    return ModelConfig(model_type="qwen2", rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       attention_bias=True, max_position_embeddings=32768,
                       bos_token_id=151643, eos_token_id=(151645, 151643), **fields)


@register_preset("qwen2p5_0p5b")
def qwen2p5_0p5b(**overrides) -> ModelConfig:
    """Qwen2.5-0.5B (0.49B parameters, tied embeddings)."""
    return _qwen2p5(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    tie_word_embeddings=True).replace(**overrides)


@register_preset("qwen2p5_1p5b")
def qwen2p5_1p5b(**overrides) -> ModelConfig:
    """Qwen2.5-1.5B (1.54B parameters, tied embeddings)."""
    return _qwen2p5(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                    num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                    tie_word_embeddings=True).replace(**overrides)


@register_preset("qwen2p5_3b")
def qwen2p5_3b(**overrides) -> ModelConfig:
    """Qwen2.5-3B (3.09B parameters, tied embeddings)."""
    return _qwen2p5(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                    num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                    tie_word_embeddings=True).replace(**overrides)


@register_preset("qwen2p5_7b")
def qwen2p5_7b(**overrides) -> ModelConfig:
    """Qwen2.5-7B (7.62B parameters)."""
    return _qwen2p5(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    tie_word_embeddings=False).replace(**overrides)


@register_preset("qwen2p5_14b")
def qwen2p5_14b(**overrides) -> ModelConfig:
    """Qwen2.5-14B (14.7B parameters)."""
    return _qwen2p5(vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                    tie_word_embeddings=False).replace(**overrides)


@register_preset("qwen2p5_32b")
def qwen2p5_32b(**overrides) -> ModelConfig:
    """Qwen2.5-32B (32.5B parameters)."""
    return _qwen2p5(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                    num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                    tie_word_embeddings=False).replace(**overrides)


@register_preset("qwen2p5_72b")
def qwen2p5_72b(**overrides) -> ModelConfig:
    """Qwen2.5-72B (72.7B parameters)."""
    return _qwen2p5(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                    tie_word_embeddings=False).replace(**overrides)


@register_preset("llama3p1_8b")
def llama3p1_8b(**overrides) -> ModelConfig:
    """Llama-3.1-8B (8.03B parameters), from its published config.json."""
    return ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        attention_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=(128001, 128008, 128009)).replace(**overrides)


@register_preset("tiny_qwen2")
def tiny_qwen2(**overrides) -> ModelConfig:
    """A tiny Qwen2-architecture model for CPU tests and the end-to-end default."""
    return ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rope_theta=1_000_000.0,
                       tie_word_embeddings=True, param_dtype="float32",
                       compute_dtype="float32").replace(**overrides)


PRESETS = MODEL_PRESETS   # name -> (**overrides) -> ModelConfig


def preset(name: str, **overrides) -> ModelConfig:
    """Looks up a preset by name; raises a ValueError listing the known names."""
    if name not in MODEL_PRESETS:
        raise ValueError(MODEL_PRESETS.unknown_message(name))
    return MODEL_PRESETS.get(name)(**overrides)
