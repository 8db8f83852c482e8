"""Sample completions: every logging.samples.every_steps steps, logging.samples.count records of
the step's batch (samples.jsonl in the run directory, TensorBoard text, a W&B table), and the
evaluate CLI's records of every problem.

A record is {step, prompt, completion, rewards (reward name -> value), reward (their sum),
advantage, length (completion tokens), truncated, correct}; a training record's prompt is the
prompt tokens the policy saw, decoded; the evaluate CLI's records also name their problem and
sample and have no advantage. Which rows of a step: a choice without replacement drawn from
numpy's generator seeded with (config seed, step), so a rerun or a resume picks the same ones,
and only those are decoded.
"""

from __future__ import annotations

import json
import math
from typing import Callable, Mapping, Sequence

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


def training_samples(step: int, batch: Mapping, rewards: Mapping, truncated, *,
                     reward_names: Sequence[str], correctness_key: str,
                     decode_prompt: Callable[[list[int]], str],
                     decode_completion: Callable[[list[int]], str], count: int,
                     seed: int) -> list[dict]:
    """The records of `count` rows of one step's training batch (rl.train_step.training_batch).

    Args:
      batch: 'tokens' [N, T + C] (prompts left-padded to T, then the completions),
        'attention_mask' [N, T + C], 'completion_tokens' [N, C], 'advantages' [N].
      rewards: name -> [N] values ('total': their sum; `correctness_key`: > 0 = correct).
      truncated: [N] whether each completion hit the length limit.
      reward_names: the rewards summed into 'total' (the records' components).
      decode_prompt, decode_completion: token ids -> text (a completion as the rewards saw it).
    """
    completion_tokens = np.asarray(batch["completion_tokens"])
    rows, width = completion_tokens.shape
    tokens = np.asarray(batch["tokens"])
    prompt_width = tokens.shape[1] - width
    attention = np.asarray(batch["attention_mask"], bool)
    records = []
    for row in chosen_rows(rows, count, seed, step):
        prompt = tokens[row, :prompt_width][attention[row, :prompt_width]]
        completion = completion_tokens[row][attention[row, prompt_width:]]
        records.append({
            "step": step, "prompt": decode_prompt(prompt.tolist()),
            "completion": decode_completion(completion.tolist()),
            "rewards": {name: _number(rewards[name][row]) for name in reward_names},
            "reward": _number(rewards["total"][row]),
            "advantage": _number(batch["advantages"][row]), "length": int(completion.size),
            "truncated": bool(truncated[row]), "correct": bool(rewards[correctness_key][row] > 0)})
    return records


def step_samples(step: int, batch: Mapping, rewards: Mapping, truncated, settings, *,
                 seed: int, **sources) -> list[dict] | None:
    """training_samples of the step when `settings` (config.logging.samples) has it record
    them (`sources`: training_samples' keyword arguments but count and seed), else None."""
    if not samples_due(step, settings.every_steps):
        return None
    return training_samples(step, batch, rewards, truncated, count=settings.count, seed=seed,
                            **sources)


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
