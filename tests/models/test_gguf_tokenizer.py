"""The GGUF tokenizer (qerl_jax/models/gguf_io.py: load_gguf_tokenizer), built from the file's
metadata with `tokenizers`, against transformers' GGUF tokenizer (which needs torch) token for
token on a few hundred varied strings and chat-templated conversations; and the real-model path
(the SmolLM2 GGUF, config, CLI modules) loading and tokenizing with torch unimportable."""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gguf", reason="GGUF import needs gguf: pip install 'gguf>=0.10'")

from qerl_jax.models.gguf_io import GGUFError, gguf_tokenizer_backend, open_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ours(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def reference(smollm2):
    pytest.importorskip("torch", reason="transformers' GGUF tokenizer reads the file with torch")
    import transformers
    directory, name = os.path.split(smollm2)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name,
                                                      local_files_only=True)


_FIXED = [
    "", " ", "a", "Hello, world!", "What is 7 + 5?", "  leading", "trailing  ", "tab\there",
    "new\nline", "\n\n\n", "\r\n", " \t \n ", "x" * 300, "The answer is 42.", "3.14159",
    "1234567890", "-17", "1,000,000", "2^{10} = 1024", "\\frac{1}{2}", "$x^2 + y^2$",
    "don't won't it's I'm we'll they've", "CamelCaseWord snake_case kebab-case", "e.g. i.e. etc.",
    "naïve café résumé", "Straße", "日本語のテキスト", "中文字符", "한국어", "Ελληνικά", "русский",
    "العربية", "עברית", "हिन्दी", "🙂🚀👍🏽", "👨‍👩‍👧", "e\u0301", "\u00a0nbsp", "zero\u200bwidth",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>",
    "text<|im_end|>more", "<think>reasoning</think> <answer>36</answer>", "<repo_name>x",
    "<|im_start", "im_start|>", "<|IM_START|>", "```python\nprint('hi')\n```",
    "def f(x):\n    return x * 2\n", "{\"key\": [1, 2, 3]}", "http://example.com/a?b=c&d=e",
]


def _random_strings(count: int, seed: int) -> list[str]:
    """Strings drawn from ASCII, digits, whitespace runs, Latin-1, CJK, emoji and arbitrary
    code points (surrogates excluded)."""
    rng = np.random.default_rng(seed)
    pools = [
        [chr(c) for c in range(32, 127)],
        list("0123456789") * 3 + [" ", ".", ","],
        [" ", "  ", "\t", "\n", "\n\n", " \n", "\r\n", "    "],
        [chr(c) for c in range(0xA0, 0x180)],
        [chr(c) for c in range(0x4E00, 0x4E00 + 400)],
        [chr(c) for c in range(0x1F600, 0x1F650)],
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</answer>", " the", "ing"],
    ]
    strings = []
    for _ in range(count):
        length = int(rng.integers(1, 40))
        chosen = rng.integers(0, len(pools) + 1, size=length)
        parts = []
        for pool_index in chosen:
            if pool_index == len(pools):
                code = int(rng.integers(1, 0x30000))
                parts.append(chr(code) if not 0xD800 <= code < 0xE000 else "?")
            else:
                pool = pools[pool_index]
                parts.append(pool[int(rng.integers(len(pool)))])
        strings.append("".join(parts))
    return strings


_CONVERSATIONS = [
    [{"role": "user", "content": "What is 7 + 5?"}],
    [{"role": "system", "content": "Think step by step."},
     {"role": "user", "content": "Solve 2x + 3 = 11.\nAnswer in <answer></answer>."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 👋"},
     {"role": "user", "content": "  spaces   and\ttabs  "}],
]
STRINGS = _FIXED + _random_strings(300, seed=20261201)


def test_metadata_and_special_tokens_equal_transformers(ours, reference):
    assert len(ours) == len(reference)
    assert ours.get_vocab() == reference.get_vocab()
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(reference, name), name
        assert getattr(ours, f"{name}_id") == getattr(reference, f"{name}_id"), name
    assert set(ours.all_special_tokens) == set(reference.all_special_tokens)
    assert sorted(ours.added_tokens_decoder) == sorted(reference.added_tokens_decoder)
    assert ours.chat_template == reference.chat_template


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokens_equal_transformers_on_varied_strings(ours, reference, add_special_tokens):
    assert len(STRINGS) > 300
    for text in STRINGS:
        expected = reference(text, add_special_tokens=add_special_tokens).input_ids
        assert ours(text, add_special_tokens=add_special_tokens).input_ids == expected, repr(text)
        assert ours.decode(expected) == reference.decode(expected), repr(text)
        assert (ours.decode(expected, skip_special_tokens=True)
                == reference.decode(expected, skip_special_tokens=True)), repr(text)


@pytest.mark.parametrize("conversation", _CONVERSATIONS, ids=["user", "system", "turns"])
def test_chat_template_equals_transformers(ours, reference, conversation):
    for add_generation_prompt in (True, False):
        text = reference.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(conversation, tokenize=False,
                                        add_generation_prompt=add_generation_prompt) == text
        assert ours(text).input_ids == reference(text).input_ids


def test_unsupported_tokenizer_model_is_one_line(smollm2, monkeypatch):
    from qerl_jax.models import gguf_io
    monkeypatch.setattr(gguf_io, "SUPPORTED_TOKENIZER_MODELS", ("llama",))
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.model='gpt2' is not supported"):
        gguf_tokenizer_backend(open_gguf(smollm2))


_WITHOUT_TORCH = """
import importlib.util, sys

sys.modules["torch"] = None   # `import torch` raises ModuleNotFoundError; find_spec gives None
assert importlib.util.find_spec("torch") is None
import qerl_jax.train, qerl_jax.trainer, qerl_jax.model_setup   # the CLI's import path
from qerl_jax.models.gguf_io import load_gguf_tokenizer, read_gguf
from qerl_jax.models.tokenizer import chat_prompt
from tests.conftest import config_from_file

config = config_from_file("smollm2", "cpu")
tokenizer = load_gguf_tokenizer(config.model.gguf_path)
_, tensors = read_gguf(config.model.gguf_path)
assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
prompt = chat_prompt(tokenizer, "What is 7 + 5?")
print(len(tokenizer(prompt).input_ids), sys.modules["torch"] is not None)
"""


def test_real_model_path_loads_and_tokenizes_without_torch(smollm2, ours):
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], cwd=ROOT,
                            capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    from qerl_jax.models.tokenizer import chat_prompt
    expected = len(ours(chat_prompt(ours, "What is 7 + 5?")).input_ids)
    assert result.stdout.split()[-2:] == [str(expected), "False"]
