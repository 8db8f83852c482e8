"""The think/answer format of QeRL's prompts and answer extraction."""

from __future__ import annotations

import re

_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
FORMAT_REWARD = 0.2


def format_reward(completion: str) -> float:
    """0.2 when a <think>...</think> block is followed by an <answer>...</answer> block."""
    try:
        return FORMAT_REWARD if _FORMAT.search(completion) else 0.0
    except Exception:  # never raise, whatever the input
        return 0.0


def extract_answer(completion: str) -> str | None:
    """Text after the last <answer>, cut at </answer>, stripped; None when absent."""
    try:
        if "<answer>" not in completion:
            return None
        answer = completion.rsplit("<answer>", 1)[1].split("</answer>", 1)[0]
        return answer.strip()
    except Exception:
        return None
