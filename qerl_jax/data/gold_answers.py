"""Gold answers of the file-based built-in tasks, and their rows -> Examples (checked field by
field; a bad row raises ConfigError naming its file:line):

  gsm8k: `question`; gold = the text after the last '####' of `answer`
  math:  `problem` (or `question`, `prompt`); gold = `answer` (MATH-500), else the last
         \\boxed{...} of `solution`
"""

from __future__ import annotations

from qerl_jax.data.sources import Example, json_type_name, text_field
from qerl_jax.infra.errors import ConfigError


def gsm8k_gold_answer(solution: str) -> str:
    """The gold answer of a GSM8K solution: the text after the last '####', stripped."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' answer marker: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip()


def boxed_answer(text: str) -> str | None:
    """The contents of the last \\boxed{...} of `text` (braces balanced), None when absent."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def math_gold_answer(solution: str) -> str:
    """The gold answer of a MATH solution: its last boxed answer, else the whole text
    stripped."""
    return boxed_answer(solution) or solution.strip()


def gsm8k_example(row: dict, where: str) -> Example:
    """A GSM8K row {'question', 'answer': '... #### gold'} as an Example."""
    if "question" not in row or "answer" not in row:
        raise ConfigError(f"{where}: a gsm8k row needs 'question' and 'answer' fields, "
                          f"got {sorted(row)}")
    question = text_field(row, "question", where)
    answer = text_field(row, "answer", where)
    if "####" not in answer:
        raise ConfigError(f"{where}: field 'answer' has no '####' before the final answer "
                          f"(GSM8K's format): ...{answer[-60:]!r}")
    gold = gsm8k_gold_answer(answer)
    if not gold:
        raise ConfigError(f"{where}: field 'answer' has nothing after its '####'")
    return Example(question, gold)


def math_example(row: dict, where: str) -> Example:
    """A MATH row {'problem', 'answer'} (or a 'solution' with a boxed answer) as an Example."""
    name = next((key for key in ("problem", "question", "prompt") if key in row), None)
    solution = row.get("solution")
    answer = row.get("answer")
    if name is None or (answer in (None, "") and not solution):
        raise ConfigError(f"{where}: a math row needs 'problem' and 'answer' (or a boxed "
                          f"'solution'), got {sorted(row)}")
    question = text_field(row, name, where)
    if answer not in (None, ""):
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ConfigError(f"{where}: field 'answer' must be a string or a number, got "
                              f"{json_type_name(answer)}")
        return Example(question, str(answer))
    return Example(question, math_gold_answer(text_field(row, "solution", where)))
