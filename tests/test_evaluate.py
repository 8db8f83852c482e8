"""Evaluation (qerl_jax.evaluation) and its CLI: PEFT adapters load back exactly; pass@1 runs end
to end on GSM8K jsonl and scores every completion by the task's correctness reward; a training
run is evaluated as it was trained (its format, prompt style, checkpoint) without writing
anything into its directory; every completion's record goes beside --out, for every registered
task (a generated one's held-out problems, the run's with --run); bad inputs are one line and exit
status 2; `--help` loads no JAX."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from qerl_jax.infra.errors import ConfigError
from qerl_jax.evaluate import main
from qerl_jax.evaluation import load_peft_adapter, model_from_run, read_run_config
from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora, export_peft_adapter
from qerl_jax.models.char_tokenizer import build_char_tokenizer
from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.tasks import get_task, load_examples, task_names
from qerl_jax.trainer import Trainer
from tests.conftest import SHARED_DATA_DIR
from tests.hf_reference import make_hf_model
from tests.test_trainer import _config

SHARED_DATA = SHARED_DATA_DIR   # ../shared/data beside the repository (tests/conftest.py)
GSM8K = os.path.join(SHARED_DATA, "gsm8k", "test.jsonl")
# the test split of each registered task read from files (a generated task takes none)
TASK_DATA = {"gsm8k": GSM8K, "math": os.path.join(SHARED_DATA, "math500", "test.jsonl")}


def test_peft_round_trip_and_cli(tmp_path):
    base = str(tmp_path / "base")
    make_hf_model("qwen2", seed=3, vocab_size=104).save_pretrained(base)
    build_char_tokenizer(base)
    model = load_hf_model(base, param_dtype="float32")
    config = LoRAConfig(rank=2, alpha=4, target_modules=("q_proj", "up_proj"))
    add_lora(model, config, jax.random.key(0))
    for layer in model.layers:
        b = layer.mlp.up_proj.lora_b
        b.set_value(0.1 * jax.random.normal(jax.random.key(1), b.get_value().shape))
    adapter = str(tmp_path / "adapter")
    export_peft_adapter(model, adapter, config)
    fresh = load_hf_model(base, param_dtype="float32")
    load_peft_adapter(fresh, adapter)
    tokens = np.random.default_rng(0).integers(0, 104, size=(1, 6))
    np.testing.assert_allclose(np.asarray(fresh(tokens)), np.asarray(model(tokens)), atol=1e-6)

    out = str(tmp_path / "result.json")
    main(["--base", base, "--peft", adapter, "--data", GSM8K, "--task", "gsm8k", "--limit", "3",
          "--max_new_tokens", "8", "--max_prompt_length", "64", "--prompt_style", "plain",
          "--out", out])
    with open(out) as handle:
        result = json.load(handle)
    assert result["problems"] == 3 and 0.0 <= result["pass@1"] <= 1.0
    assert result["format"] == "bf16" and result["prompt_style"] == "plain"


def test_completions_keep_special_think_and_answer_tokens(tmp_path):
    """The char tokenizer registers <think>/<answer> as special tokens: evaluation must decode
    them (as the trainer does), or '<think>6*12</think><answer>72</answer>' reads as '6*1272'."""
    from qerl_jax.models.tokenizer import decode_completion, load_tokenizer
    from qerl_jax.tasks import get_task
    build_char_tokenizer(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    ids = tokenizer("<think>6*12</think><answer>72</answer>" + tokenizer.eos_token,
                    add_special_tokens=False)["input_ids"]
    text = decode_completion(tokenizer, ids)
    assert text == "<think>6*12</think><answer>72</answer>"
    assert get_task("gsm8k").correctness_function()(text, "72") > 0


def test_pass_at_1_scores_and_averages_every_completion(tmp_path):
    """pass_at_1 with a stand-in sampler whose completions are known: problem p's sample g is
    its gold answer when p + g is even. Every completion is scored (arithmetic: exact integer),
    pass@1 is the mean over all, mean_length the mean of the generated lengths, and each batch
    gets its own key."""
    from qerl_jax.data.sources import Example
    from qerl_jax.evaluation import pass_at_1
    from qerl_jax.rewards.arithmetic import arithmetic_reward
    from qerl_jax.models.tokenizer import load_tokenizer
    from qerl_jax.sampling import Rollout
    build_char_tokenizer(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    examples = [Example(f"{n}+1=", str(n + 1)) for n in range(5)]
    keys, calls = [], []

    def sample(tokens, mask, key):
        keys.append(np.asarray(jax.random.key_data(key)))
        first = sum(calls)
        calls.append(tokens.shape[0])
        texts = [examples[first + p].gold if (first + p + g) % 2 == 0 else "x"
                 for p in range(tokens.shape[0]) for g in range(2)]
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        width = max(len(row) for row in ids)
        padded = np.asarray([row + [0] * (width - len(row)) for row in ids], np.int32)
        lengths = np.asarray([len(row) for row in ids], np.int32)
        mask = np.arange(width)[None, :] < lengths[:, None]
        return Rollout(tokens=padded, logprobs=np.zeros(padded.shape, np.float32), mask=mask,
                       lengths=lengths, truncated=np.zeros(len(ids), bool))

    result = pass_at_1(sample, tokenizer, examples, correctness=arithmetic_reward,
                       samples_per_problem=2, max_prompt_length=16, batch_size=2,
                       prompt_style="plain", use_chat_template=False)
    assert calls == [2, 2, 1]
    assert result["pass@1"] == 0.5 and result["problems"] == 5
    assert result["samples_per_problem"] == 2
    golds = [len(e.gold) for e in examples]
    expected_length = np.mean([golds[p] if (p + g) % 2 == 0 else 1
                               for p in range(5) for g in range(2)])
    assert result["mean_length"] == pytest.approx(expected_length)
    assert len({key.tobytes() for key in keys}) == 3

    # correct means a correctness reward above 0 (GSM8K's is worth 2.0); a raise is wrong
    def rerun(correctness):
        calls.clear()
        return pass_at_1(sample, tokenizer, examples, correctness=correctness,
                         samples_per_problem=2, max_prompt_length=16, batch_size=2,
                         prompt_style="plain", use_chat_template=False)["pass@1"]

    def raising(completion, gold):
        raise RuntimeError("a broken reward")
    assert rerun(lambda completion, gold: 2.0 * arithmetic_reward(completion, gold)) == 0.5
    assert rerun(raising) == 0.0


def test_help_loads_no_jax_and_names_the_module():
    code = ("import sys\n"
            "from qerl_jax import evaluate\n"
            "try:\n"
            "    evaluate.main(['--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in ('jax', 'flax', 'transformers', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.startswith("usage: python -m qerl_jax.evaluate ")
    assert result.stdout.strip().splitlines()[-1] == "[]"
    tasks = ",".join(task_names())
    assert f"--task {{{tasks}}}" in " ".join(result.stdout.split()) and not result.stderr


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny random HF qwen2 checkpoint with the character tokenizer."""
    base = str(tmp_path_factory.mktemp("base"))
    make_hf_model("qwen2", seed=3, vocab_size=104).save_pretrained(base)
    build_char_tokenizer(base)
    return base


@pytest.mark.parametrize("task_name", task_names())
def test_the_cli_writes_every_completions_record_for_every_task(tmp_path, tiny_base, task_name):
    """Beside --out, one record per completion (2 problems x 2 samples): its problem and
    sample, prompt, completion, the task's reward components and correctness recomputed here
    from the completion, length and truncation; no step for a base model."""
    from qerl_jax.data.prompts import build_prompt_text
    from qerl_jax.models.tokenizer import load_tokenizer
    from qerl_jax.rewards import get_reward_functions

    task = get_task(task_name)
    data = ["--data", TASK_DATA[task_name]] if task.reads_files else []
    out = str(tmp_path / "result.json")
    result = main(["--base", tiny_base, "--task", task_name, *data, "--limit", "2", "--n", "2",
                   "--temperature", "1.0", "--max_new_tokens", "6", "--max_prompt_length",
                   "64", "--prompt_style", "plain", "--out", out])
    path = str(tmp_path / "result.samples.jsonl")
    with open(out) as handle:
        assert json.load(handle)["samples_file"] == path
    with open(path) as handle:
        records = [json.loads(line) for line in handle]
    assert records == result["samples"]
    problems = (load_examples(task_name, TASK_DATA[task_name], limit=2) if task.reads_files
                else task.held_out(task.option_values(), 0, 2, load_examples(task_name)))
    tokenizer = load_tokenizer(tiny_base)
    rewards = get_reward_functions(list(task.reward_names()))
    correctness = task.correctness_function()
    assert [(r["problem"], r["sample"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for record in records:
        assert set(record) == {"step", "problem", "sample", "prompt", "completion", "rewards",
                               "correct", "length", "truncated"}
        problem = problems[record["problem"]]
        assert record["step"] is None
        assert record["prompt"] == build_prompt_text(tokenizer, problem.question, style="plain")
        assert record["rewards"] == {name: float(function(record["completion"], problem.gold))
                                     for name, function in rewards.items()}
        assert record["correct"] == (correctness(record["completion"], problem.gold) > 0)
        assert 1 <= record["length"] <= 6
        assert not record["truncated"] or record["length"] == 6
    assert result["pass@1"] == np.mean([record["correct"] for record in records])


# ---------------------------------------------------------------------- a training run
def _run_config():
    """The tiny NVFP4 config (plain prompts, as configs/tiny.py): 2 GRPO steps, a checkpoint
    after each."""
    config = _config(total_steps=2)
    config.checkpoint.every_steps = 1
    return config


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_warmup):
    """(run directory, the trainer's final trainable leaves): a 2-step run with a leftover
    temporary directory of a save killed midway, which evaluate must neither read nor clean."""
    workdir = str(tmp_path_factory.mktemp("run"))
    shutil.copytree(tiny_warmup, os.path.join(workdir, "warmup"))
    trainer = Trainer(_run_config(), workdir)
    trainer.train()
    os.makedirs(os.path.join(workdir, "checkpoints", "3.orbax-checkpoint-tmp-1234", "arrays"))
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(trainer.trainable)]
    return workdir, leaves


def _tree_snapshot(directory: str) -> dict:
    """Every path under `directory` with its mtime (and a file's bytes): any write shows."""
    snapshot = {".": os.stat(directory).st_mtime_ns}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            content = None
            if os.path.isfile(path):
                with open(path, "rb") as handle:
                    content = handle.read()
            snapshot[os.path.relpath(path, directory)] = (os.stat(path).st_mtime_ns, content)
    return snapshot


def _copy_run(run: str, destination: str) -> str:
    shutil.copytree(run, destination)
    return destination


def _evaluate_args(run: str, *extra: str) -> list[str]:
    return ["--run", run, "--data", GSM8K, "--task", "gsm8k", "--limit", "2",
            "--max_new_tokens", "6", "--max_prompt_length", "48", "--batch_size", "2", *extra]


def test_evaluating_a_run_writes_nothing_there_and_records_the_run(tmp_path, trained_run):
    run, trained_leaves = trained_run
    config = read_run_config(run)
    before = _tree_snapshot(run)
    out = str(tmp_path / "result.json")
    main(_evaluate_args(run, "--out", out))
    assert _tree_snapshot(run) == before
    with open(out) as handle:
        result = json.load(handle)
    assert result["format"] == config.quant.format == "nvfp4"
    assert result["prompt_style"] == config.data.prompt_style == "plain"
    assert result["prompt_style_from"] == "run"
    assert result["use_chat_template"] == config.data.use_chat_template
    assert result["step"] == 2
    assert result["run"] == os.path.abspath(run) and result["run_seed"] == config.seed
    assert result["problems"] == 2 and 0.0 <= result["pass@1"] <= 1.0
    with open(result["samples_file"]) as handle:
        records = [json.loads(line) for line in handle]
    assert [record["step"] for record in records] == [2, 2]
    # trained on arithmetic, evaluated on gsm8k: the gsm8k task's reward components
    assert all(set(record["rewards"]) == {"format", "gsm8k_exact"} for record in records)

    # a generated task's problems are the run's held-out ones, its rewards the run's
    result = main(["--run", run, "--task", "arithmetic", "--limit", "3", "--max_new_tokens",
                   "6", "--max_prompt_length", "48"])
    arithmetic = get_task("arithmetic")
    options = arithmetic.option_values(config.data)
    held_out = arithmetic.held_out(options, config.seed, 3,
                                   load_examples(arithmetic, seed=config.seed, **options))
    assert len(result["samples"]) == 3 and all(
        example.question in record["prompt"]
        for example, record in zip(held_out, result["samples"], strict=True))
    assert all(set(record["rewards"]) == set(config.rewards.names)
               for record in result["samples"])
    assert _tree_snapshot(run) == before

    # the restored adapters are the trainer's final ones
    model, _, _, step = model_from_run(run)
    assert step == 2
    restored = jax.tree_util.tree_leaves(nnx.state(model, TRAINABLE))
    for x, y in zip(restored, trained_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)

    # --step picks an older checkpoint; an explicit prompt style is recorded as an override;
    # without --out nothing is written anywhere
    result = main(_evaluate_args(run, "--step", "1", "--prompt_style", "paper"))
    assert result["step"] == 1
    assert result["prompt_style"] == "paper" and result["prompt_style_from"] == "command line"
    assert result["run_prompt_style"] == "plain"
    assert _tree_snapshot(run) == before


def _exits_with_one_line(capsys, argv, *fragments):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "Traceback" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_run_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, trained_run, capsys):
    run = trained_run[0]
    before = _tree_snapshot(run)
    _exits_with_one_line(capsys, _evaluate_args(run, "--format", "bf16"),
                         "--format bf16", "'nvfp4'")
    _exits_with_one_line(capsys, _evaluate_args(run, "--step", "7"), "--step 7", "[1, 2]")
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    _exits_with_one_line(capsys, _evaluate_args(empty), os.path.join(empty, "run.json"))
    unsaved = str(tmp_path / "unsaved")
    os.makedirs(unsaved)
    shutil.copy(os.path.join(run, "run.json"), unsaved)
    _exits_with_one_line(capsys, _evaluate_args(unsaved), os.path.join(unsaved, "checkpoints"))
    assert os.listdir(unsaved) == ["run.json"] and os.listdir(empty) == []
    assert _tree_snapshot(run) == before
    with pytest.raises(ConfigError):   # --debug raises instead of exiting
        main(_evaluate_args(run, "--step", "7", "--debug"))

    # a damaged checkpoint is named, not skipped for an older one, and not moved aside
    damaged = _copy_run(run, str(tmp_path / "damaged"))
    shutil.rmtree(os.path.join(damaged, "checkpoints", "2", "arrays"))
    before = _tree_snapshot(damaged)
    _exits_with_one_line(capsys, _evaluate_args(damaged),
                         os.path.join(damaged, "checkpoints", "2"))
    assert _tree_snapshot(damaged) == before


def test_a_run_without_its_warmup_cache_is_refused_not_retrained(tmp_path, trained_run, capsys):
    run = _copy_run(trained_run[0], str(tmp_path / "run"))
    shutil.rmtree(os.path.join(run, "warmup"))
    before = _tree_snapshot(run)
    with pytest.raises(ConfigError, match=os.path.join(run, "warmup")):
        model_from_run(run)
    _exits_with_one_line(capsys, _evaluate_args(run), os.path.join(run, "warmup"))
    assert _tree_snapshot(run) == before

    # a cache made with other settings is refused too
    run = _copy_run(trained_run[0], str(tmp_path / "other"))
    record_path = os.path.join(run, "run.json")
    with open(record_path) as handle:
        record = json.load(handle)
    configs = [start["config"] for start in record["starts"]] if "starts" in record \
        else [record["config"]]
    for config in configs:
        config["warmup"]["learning_rate"] *= 2
    with open(record_path, "w") as handle:
        json.dump(record, handle)
    before = _tree_snapshot(run)
    with pytest.raises(ConfigError, match="learning_rate"):
        model_from_run(run)
    assert _tree_snapshot(run) == before


def test_run_config_is_the_last_start_of_either_run_json_form(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.json").write_text(json.dumps({"seed": 3, "config": {"seed": 3}}))
    assert read_run_config(str(old)).seed == 3
    new = tmp_path / "new"
    new.mkdir()
    (new / "run.json").write_text(json.dumps(
        {"starts": [{"config": {"seed": 1}}, {"config": {"seed": 2}, "resumed_at": 5}]}))
    assert read_run_config(str(new)).seed == 2
    (new / "run.json").write_text(json.dumps({"starts": [{"config": {"seed": 1}}, {}]}))
    with pytest.raises(ConfigError, match="holds no config"):
        read_run_config(str(new))
    (new / "run.json").write_text("{")
    with pytest.raises(ConfigError, match="run.json"):
        read_run_config(str(new))
