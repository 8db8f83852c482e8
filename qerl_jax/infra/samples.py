"""Sample completions: every logging.samples.every_steps steps, logging.samples.count records of
the step's batch (samples.jsonl in the run directory, TensorBoard text, a W&B table), and the
evaluate CLI's records of every problem.

A record is {step, prompt, completion, rewards (reward name -> value), reward (their sum),
advantage, length (completion tokens), truncated, correct}; the evaluate CLI's also name their
problem and sample and have no advantage. Which rows: a choice without replacement drawn from
numpy's generator seeded with (config seed, step), so a rerun or a resume picks the same ones.
"""

from __future__ import annotations

import json
import math
from typing import Mapping, Sequence

import numpy as np

from qerl_jax.infra.atomic_io import write_text_atomic

TABLE_KEY = "samples"   # the TensorBoard text tag and the W&B table's key


def samples_due(step: int, every_steps: int) -> bool:
    """Whether `step` records samples (every_steps = 0: never)."""
    return every_steps > 0 and step % every_steps == 0


def chosen_rows(rows: int, count: int, seed: int, step: int) -> list[int]:
    """`count` distinct rows of `rows` (all when fewer), ascending, drawn from (seed, step)."""
    picked = np.random.default_rng((seed, step)).choice(rows, size=min(count, rows),
                                                        replace=False)
    return sorted(int(row) for row in picked)


def _number(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def training_samples(step: int, groups: Sequence[Mapping], advantages, reward_names,
                     correctness_key: str, *, count: int, seed: int) -> list[dict]:
    """The records of `count` rows of one step's batch.

    Args:
      groups: the step's rollout groups in batch order (the trainer's entries: prompt_text,
        completions [G], rollout (lengths [G], truncated [G]), scores (name -> [G])).
      advantages: [P * G] the batch's advantages, prompt-major as the groups.
      reward_names: the rewards summed into the training reward.
      correctness_key: the scores' entry whose value > 0 means a correct answer.
    """
    size = len(groups[0]["completions"])
    records = []
    for row in chosen_rows(len(groups) * size, count, seed, step):
        group, index = groups[row // size], row % size
        scores = group["scores"]
        records.append({
            "step": step, "prompt": group["prompt_text"],
            "completion": group["completions"][index],
            "rewards": {name: _number(scores[name][index]) for name in reward_names},
            "reward": _number(scores["total"][index]),
            "advantage": _number(advantages[row]),
            "length": int(group["rollout"].lengths[index]),
            "truncated": bool(group["rollout"].truncated[index]),
            "correct": bool(scores[correctness_key][index] > 0)})
    return records


def samples_markdown(records: Sequence[Mapping]) -> str:
    """The records as TensorBoard text (markdown): a line of facts each, its prompt and
    completion as code blocks."""
    parts = []
    for record in records:
        rewards = ", ".join(f"{name} {value}" for name, value in record["rewards"].items())
        facts = [f"reward {record['reward']} ({rewards})" if "reward" in record
                 else f"rewards {rewards}"]
        if record.get("advantage") is not None:
            facts.append(f"advantage {record['advantage']:.4f}")
        facts.append(f"{record['length']} tokens" + (", truncated" if record["truncated"]
                                                     else ""))
        facts.append("correct" if record["correct"] else "not correct")
        parts.append(f"**step {record.get('step')}**: {'; '.join(facts)}\n\nprompt:\n\n"
                     f"    {_indented(record['prompt'])}\n\ncompletion:\n\n"
                     f"    {_indented(record['completion'])}")
    return "\n\n---\n\n".join(parts)


def _indented(text: str) -> str:
    """`text` as the body of a markdown code block opened by four spaces."""
    return text.replace("\n", "\n    ")


def table_columns(records: Sequence[Mapping]) -> tuple[list[str], list[list]]:
    """(columns, rows) of the records as one table: the scalar fields, one 'rewards/NAME' column
    per reward."""
    names = list(records[0]["rewards"]) if records else []
    scalars = [key for key in records[0] if key != "rewards"] if records else []
    columns = scalars + [f"rewards/{name}" for name in names]
    rows = [[record[key] for key in scalars] + [record["rewards"][name] for name in names]
            for record in records]
    return columns, rows


def samples_lines(records: Sequence[Mapping]) -> str:
    """The records as strict-JSON lines (non-finite numbers are null already)."""
    return "".join(json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
                   for record in records)


def write_samples_file(path: str, records: Sequence[Mapping]) -> None:
    """The records to `path` as JSON lines, atomically (StorageError naming `path`)."""
    write_text_atomic(path, samples_lines(records))
