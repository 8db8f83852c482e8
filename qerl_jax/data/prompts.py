"""Prompt text through the tokenizer's chat template, and left-padded token batches."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from qerl_jax.registry import PROMPT_STYLES

logger = logging.getLogger(__name__)

# QeRL paper, appendix E: appended to each question.
QERL_THINK_ANSWER_SUFFIX = (
    " Solve the following math problem step by step. The reasoning process and direct answer "
    "are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>:")
THINK_ANSWER_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
    "process here </think> <answer> answer here </answer>")


@dataclasses.dataclass
class PromptBatch:
    """tokens [P, T] int32 left-padded, mask [P, T] bool, and the number left-truncated."""

    tokens: np.ndarray
    mask: np.ndarray
    truncated: int


# prompt style -> question -> (user message, system message or None)
PROMPT_STYLES.register("paper", lambda question: (question + QERL_THINK_ANSWER_SUFFIX, None))
PROMPT_STYLES.register("system", lambda question: (question, THINK_ANSWER_SYSTEM_PROMPT))
PROMPT_STYLES.register("plain", lambda question: (question, None))


def build_prompt_text(tokenizer, question: str, *, style: str = "paper",
                      use_chat_template: bool = True) -> str:
    """The prompt for one question. style 'paper' appends the paper's think/answer instruction
    to the question; 'system' puts it in a system message; 'plain' uses the question as is."""
    if style not in PROMPT_STYLES:
        raise ValueError(PROMPT_STYLES.unknown_message(style))
    user, system = PROMPT_STYLES.get(style)(question)
    if not use_chat_template:
        return user if system is None else f"{system}\n{user}"
    from qerl_jax.models.tokenizer import chat_prompt
    return chat_prompt(tokenizer, user, system_message=system)


def encode_prompts(tokenizer, texts: Sequence[str], max_prompt_length: int,
                   pad_id: int | None = None) -> PromptBatch:
    """Tokenizes prompts, left-truncates those over `max_prompt_length` (with a warning) and
    left-pads to the longest."""
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length={max_prompt_length} must be positive")
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    truncated = sum(len(ids) > max_prompt_length for ids in encoded)
    if truncated:
        logger.warning("%d of %d prompts exceed max_prompt_length=%d and were left-truncated",
                       truncated, len(encoded), max_prompt_length)
    encoded = [ids[-max_prompt_length:] for ids in encoded]
    length = max(len(ids) for ids in encoded)
    tokens = np.full((len(encoded), length), pad_id, np.int32)
    mask = np.zeros((len(encoded), length), np.bool_)
    for row, ids in enumerate(encoded):
        if ids:
            tokens[row, length - len(ids):] = ids
            mask[row, length - len(ids):] = True
    return PromptBatch(tokens=tokens, mask=mask, truncated=truncated)
