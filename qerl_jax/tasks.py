"""Tasks users pick by name (config.data.task, `evaluate --task`): where a task's examples come
from (rows of a file turned into Examples, or generated problems), how a gold answer is read,
which reward decides correctness (the trainer's `accuracy` and pass@1) and which rewards it
trains with by default. Pure Python: the names are known without importing JAX.

    register_task(Task("my_task", correctness="my_reward", default_rewards=("format",
                       "my_reward"), row_to_example=my_row_to_example))
    get_task("my_task").correctness_function()      # REWARDS.get("my_reward")
    load_examples("my_task", "rows.jsonl")

A task's callables take `options`, the config.data fields it reads (`Task.options` names them,
with their defaults), so one task serves every setting of them (the arithmetic phrasings).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Iterable, Mapping, Sequence

from qerl_jax.data.arithmetic import (arithmetic_examples, arithmetic_gold_answer,
                                      held_out_arithmetic_examples)
from qerl_jax.data.gold_answers import (gsm8k_example, gsm8k_gold_answer, math_example,
                                        math_gold_answer)
from qerl_jax.data.sources import (Example, RowToExample, is_local_source, read_rows,
                                   rows_to_examples)
from qerl_jax.infra.errors import ConfigError
from qerl_jax.registry import TASKS
from qerl_jax.rewards.registry import RewardFunction, get_reward_functions

Options = Mapping[str, Any]   # config.data field -> value, for the fields in Task.options



@dataclasses.dataclass(frozen=True)
class Task:
    """A task: its examples' source, gold parser, correctness reward and default rewards.

    Attributes:
      name: what config.data.task and `evaluate --task` say.
      correctness: the reward (a REWARDS name) whose value > 0 means a correct answer, or
        options -> that name.
      default_rewards: the rewards it trains with unless config.rewards.names says otherwise,
        or options -> them.
      row_to_example: (row dict, 'file:LINE') -> Example, ConfigError for a bad row; for a task
        read from files (config.data.path).
      gold_answer: reference solution text -> gold answer string (what rewards compare with).
      generate: (options, seed) -> the training Examples, for a task of generated problems.
      held_out: (options, seed, count, training Examples) -> the first `count` held-out
        Examples (config.eval), never a training question; with `generate`.
      options: the config.data fields `generate`, `held_out`, `correctness` and
        `default_rewards` read -> their defaults.
      count_option: the option that sets how many problems `generate` draws.
      description: one line for listings.
    """

    name: str
    correctness: str | Callable[[Options], str]
    default_rewards: tuple[str, ...] | Callable[[Options], tuple[str, ...]] = ()
    row_to_example: RowToExample | None = None
    gold_answer: Callable[[str], str] | None = None
    generate: Callable[[Options, int], list[Example]] | None = None
    held_out: Callable[[Options, int, int, Sequence[Example]], list[Example]] | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    count_option: str | None = None
    description: str = ""

    def __post_init__(self):
        where = f"task {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a task name must be a non-empty string, got {self.name!r}")
        if (self.row_to_example is None) == (self.generate is None):
            raise ValueError(f"{where}: give exactly one of row_to_example (rows read from a "
                             "file) or generate (generated problems)")
        if self.held_out is not None and self.generate is None:
            raise ValueError(f"{where}: held_out goes with generate (a file task's held-out "
                             "split is a file, config.eval.data_path)")
        if not (callable(self.correctness) or (isinstance(self.correctness, str)
                                                and self.correctness)):
            raise ValueError(f"{where}: correctness must be a reward name or options -> name, "
                             f"got {self.correctness!r}")
        if self.count_option is not None and self.count_option not in self.options:
            raise ValueError(f"{where}: count_option {self.count_option!r} is not one of its "
                             f"options {sorted(self.options)}")
        if not callable(self.default_rewards):
            object.__setattr__(self, "default_rewards", tuple(self.default_rewards))
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))

    @property
    def reads_files(self) -> bool:
        """Whether its examples are rows of a file (else they are generated)."""
        return self.row_to_example is not None

    def option_values(self, data: Options | None = None) -> dict[str, Any]:
        """Each option's value in `data` (a config.data section, or a mapping of some of the
        options), else its default."""
        return {name: (data[name] if data is not None and name in data else default)
                for name, default in self.options.items()}

    def correctness_reward(self, data: Options | None = None) -> str:
        """The name of the reward that decides correctness under `data`'s options."""
        if callable(self.correctness):
            return self.correctness(self.option_values(data))
        return self.correctness

    def correctness_function(self, data: Options | None = None) -> RewardFunction:
        """The correctness reward itself (ValueError naming the known rewards if unknown)."""
        name = self.correctness_reward(data)
        return get_reward_functions([name])[name]

    def reward_names(self, data: Options | None = None) -> tuple[str, ...]:
        """The rewards it trains with by default under `data`'s options."""
        if callable(self.default_rewards):
            return tuple(self.default_rewards(self.option_values(data)))
        return self.default_rewards


def register_task(task: Task, *, aliases: Iterable[str] = (), replace: bool = False) -> Task:
    """Registers `task` under task.name (a plug-in module calls this on import)."""
    if not isinstance(task, Task):
        raise TypeError(f"register_task takes a Task, got {type(task).__name__}")
    return TASKS.register(task.name, task, aliases=aliases, replace=replace)


def task_names() -> tuple[str, ...]:
    """The registered task names, in registration order."""
    return TASKS.names()


def get_task(task: str | Task) -> Task:
    """The task registered as `task` (a Task passes through); ConfigError (one line, listing
    the known names) for an unknown name."""
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ConfigError(TASKS.unknown_message(task))
    return TASKS.get(task)


def load_examples(task: str | Task, source: str = "", *, split: str = "train",
                  subset: str | None = None, limit: int | None = None, seed: int = 0,
                  **options) -> list[Example]:
    """Examples of `task`: the rows of `source` (a local .jsonl/.parquet path, or a hub dataset
    name) for a file task, or `generate(options, seed)` for a generated one.

    Every row is checked (also those past `limit`). `options` are the task's own (e.g.
    arithmetic_count=32, arithmetic_phrasing='question'); the rest keep their defaults.

    Raises:
      ConfigError: an unknown task or option, a missing or unreadable source, or a bad row
        (naming file:line).
    """
    task = get_task(task)
    unknown = sorted(set(options) - set(task.options))
    if unknown:
        raise ConfigError(f"task {task.name!r} has no option(s) {unknown}; its options: "
                          f"{sorted(task.options) or 'none'}")
    if task.generate is not None:
        if source:
            raise ConfigError(f"{source}: task {task.name!r} generates its problems and reads "
                              "no data source")
        examples = task.generate(task.option_values(options), seed)
    else:
        if not source:
            raise ConfigError(f"task {task.name!r} needs a data source (a .jsonl/.parquet path "
                              "or a hub dataset name)")
        examples = rows_to_examples(read_rows(source, split=split, subset=subset),
                                    task.row_to_example)
    if not examples:
        raise ConfigError(f"{source or task.name}: holds no examples")
    return examples[:limit] if limit else examples


def _config_task(config) -> Task:
    try:
        return get_task(config.data.task)
    except ConfigError as error:
        raise ConfigError(f"config.data.task: {error}") from None


def load_training_examples(config) -> list[Example]:
    """The examples config.data asks for, checked before any model work: the file, every row,
    and that there are enough for one step (train.prompts_per_step).

    Args:
      config: a config validate_config accepts.
    Raises:
      ConfigError: naming the config field, or the file and line of a bad row.
    """
    data = config.data
    task = _config_task(config)
    if task.reads_files and is_local_source(data.path) and data.split != "train":
        raise ConfigError(f"config.data.split: {data.split!r} applies to hub datasets only; "
                          f"data.path {data.path!r} is a local file (the file is the split)")
    examples = load_examples(task, data.path if task.reads_files else "", split=data.split,
                             subset=data.subset or None, limit=data.limit or None,
                             seed=config.seed, **task.option_values(data))
    needed = config.train.prompts_per_step
    if len(examples) < needed:
        if task.reads_files:
            field, source = "data.path", data.path
        else:
            field, source = f"data.{task.count_option or 'task'}", f"the {task.name} task"
        after = f" (after data.limit={data.limit})" if data.limit else ""
        raise ConfigError(f"config.{field}: {source} holds {len(examples)} examples{after}, "
                          f"fewer than config.train.prompts_per_step={needed} (one step's "
                          "prompts)")
    return examples


def load_eval_examples(config, training_examples: list[Example]) -> list[Example]:
    """The fixed held-out subset config.eval asks for ([] when eval.every_steps is 0): the first
    eval.num_examples rows of the task's test split, in file order (as `evaluate --limit`).

    The test split is eval.data_path (a local file, or a hub dataset's 'test' split); '' means
    the 'test' split of the hub dataset data.path. A generated task makes its own (`held_out`,
    never a training question).

    Args:
      config: a config validate_config accepts.
      training_examples: load_training_examples(config).
    Raises:
      ConfigError: naming the config field, or the file and line of a bad row.
    """
    data, evaluation = config.data, config.eval
    if not evaluation.every_steps:
        return []
    count = evaluation.num_examples
    task = _config_task(config)
    if not task.reads_files:
        if evaluation.data_path:
            raise ConfigError(f"config.eval.data_path: {evaluation.data_path!r} is unused by "
                              f"task {task.name!r} (its held-out problems are generated); "
                              "set ''")
        if task.held_out is None:
            raise ConfigError(f"config.eval.every_steps: task {task.name!r} generates no "
                              "held-out problems; set 0")
        return task.held_out(task.option_values(data), config.seed, count, training_examples)
    source = evaluation.data_path or data.path
    if not evaluation.data_path and is_local_source(data.path):
        raise ConfigError(f"config.eval.data_path: required with a local data.path "
                          f"({data.path!r} is the training split); set the test split's "
                          ".jsonl/.parquet file")
    try:
        examples = load_examples(task, source, split="test", subset=data.subset or None)
    except ConfigError as error:
        raise ConfigError(f"config.eval.data_path: {error}") from None
    if len(examples) < count:
        raise ConfigError(f"config.eval.num_examples: {count} is more than the "
                          f"{len(examples)} examples of the test split {source}")
    return examples[:count]


# ------------------------------------------------------------------ built-in tasks

def _arithmetic_generate(options: Options, seed: int) -> list[Example]:
    return arithmetic_examples(options["arithmetic_count"], seed,
                               max_operand=options["arithmetic_max_operand"],
                               phrasing=options["arithmetic_phrasing"])


def _arithmetic_held_out(options: Options, seed: int, count: int,
                         training: Sequence[Example]) -> list[Example]:
    return held_out_arithmetic_examples(
        count, seed, options["arithmetic_max_operand"], options["arithmetic_count"],
        {example.question for example in training}, phrasing=options["arithmetic_phrasing"])


def _arithmetic_correctness(options: Options) -> str:
    # an instruct model restates 'What is 7 + 5?' before the result: read the last integer
    return ("arithmetic_last_integer" if options["arithmetic_phrasing"] == "question"
            else "arithmetic")


def _arithmetic_rewards(options: Options) -> tuple[str, ...]:
    return (_arithmetic_correctness(options), "format")


register_task(Task(
    "gsm8k", correctness="gsm8k_numeric", default_rewards=("format", "gsm8k_exact"),
    row_to_example=gsm8k_example, gold_answer=gsm8k_gold_answer,
    description="GSM8K rows {question, answer: '... #### gold'}; QeRL's format + exact answer"))
register_task(Task(
    "math", correctness="math_verify", default_rewards=("format", "math_verify"),
    row_to_example=math_example, gold_answer=math_gold_answer,
    description="MATH rows {problem, answer} or a boxed solution; math-verify"))
register_task(Task(
    "arithmetic", correctness=_arithmetic_correctness, default_rewards=_arithmetic_rewards,
    gold_answer=arithmetic_gold_answer, generate=_arithmetic_generate,
    held_out=_arithmetic_held_out,
    options={"arithmetic_count": 1000, "arithmetic_max_operand": 20,
             "arithmetic_phrasing": "expression"},
    count_option="arithmetic_count",
    description="generated 'a+b=' / 'What is a + b?' problems with exact integer answers"))
