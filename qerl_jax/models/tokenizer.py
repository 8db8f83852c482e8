"""Tokenizers from a local HF directory, and chat-templated prompts.

Only local files are read (local_files_only=True): nothing is downloaded at run time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """AutoTokenizer from `directory` (local files only); clear error when it is missing."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"{directory}: no loadable tokenizer (tokenizer.json / tokenizer_config.json): "
            f"{error}") from None


def chat_prompt(tokenizer: PreTrainedTokenizerBase, user_message: str,
                system_message: str | None = None) -> str:
    """The prompt text for one user turn through the tokenizer's chat template.

    Ends with the assistant generation prompt, ready for sampling.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; set one "
                         "in tokenizer_config.json")
    messages = []
    if system_message is not None:
        messages.append({"role": "system", "content": system_message})
    messages.append({"role": "user", "content": user_message})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase,
                  extra: Sequence[int] = ()) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's eos plus `extra` (e.g. config eos ids)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    ids.extend(int(i) for i in extra)
    return tuple(dict.fromkeys(ids))


def decode_completion(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """The text of a generated completion, as the rewards must see it.

    Special tokens are kept (a tokenizer may register <think>/<answer> as special, as the char
    tokenizer does; skipping them would glue the reasoning to the answer) except the eos and
    pad tokens, which are removed.
    """
    text = tokenizer.decode(list(token_ids), skip_special_tokens=False)
    for special in {tokenizer.eos_token, tokenizer.pad_token} - {None}:
        text = text.replace(special, "")
    return text
