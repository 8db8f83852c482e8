"""The think/answer format of QeRL's prompts and answer extraction."""

from __future__ import annotations

import re

from qerl_jax.rewards.registry import register_reward

FORMAT_REWARD = 0.2
_WHITESPACE = re.compile(r"\s*")   # the regex engine's \s, so the format keeps its meaning


def has_think_answer_format(completion: str) -> bool:
    """Whether `<think>.*?</think>\\s*<answer>.*?</answer>` (DOTALL) matches anywhere in
    `completion`, decided in time linear in its length.

    The regex itself backtracks over every <think> x </think> x <answer> triple when the blocks
    are left open (cubic time in the length). The first <think>, and the first </think> after it
    that whitespace and <answer> follow, are the only candidates worth trying: each leaves the
    most room for what must come after it.
    """
    think = completion.find("<think>")
    if think < 0:
        return False
    search_from = think + len("<think>")
    while True:
        close = completion.find("</think>", search_from)
        if close < 0:
            return False
        answer = _WHITESPACE.match(completion, close + len("</think>")).end()
        if completion.startswith("<answer>", answer):
            return completion.find("</answer>", answer + len("<answer>")) >= 0
        # the whitespace runs after distinct </think> are disjoint, so the scan stays linear
        search_from = close + 1


@register_reward("format")
def format_reward(completion: str, gold: str | None = None) -> float:
    """0.2 when a <think>...</think> block is followed by an <answer>...</answer> block.

    `gold` is unused: every reward is called as f(completion, gold).
    """
    del gold
    try:
        return FORMAT_REWARD if has_think_answer_format(completion) else 0.0
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
