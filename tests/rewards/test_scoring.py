"""Bounded-time scoring (qerl_jax/rewards/scoring.py): adversarial completions score fast with
every registered reward; a hanging or crashing reward costs its completion (0, one timeout, and a
worker restart unless a signal handler could stop it), never the batch; the limit counts CPU
time, so a worker the host does not run for longer than the limit still scores; the full GSM8K
test set scores full marks."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from qerl_jax.rewards import (DEFAULT_TIME_LIMIT_SECONDS, RewardScorer, get_reward_functions,
                              reward_names, score_completions)
from qerl_jax.rewards.scoring import WALL_CLOCK_FACTOR
from qerl_jax.data.gold_answers import gsm8k_gold_answer
from tests.rewards import hanging_rewards


def _wrap(answer, reasoning="..."):
    return f"<think>{reasoning}</think> <answer>{answer}</answer>"


REWARD_FUNCTIONS = get_reward_functions(reward_names())
_HUGE_DIGITS = "7" * 100_000
# (id, completion, gold): each must score with every registered reward in under a second
ADVERSARIAL = [
    ("tower_2^2^2^2^2^2", _wrap("2^{2^{2^{2^{2^{2}}}}}"), "36"),
    ("tower_9^9^9^9", _wrap("9^{9^{9^{9}}}"), "36"),
    ("python_9**9**9**9", _wrap("9**9**9**9"), "36"),
    ("python_10**10**10_bare", "10**10**10", "36"),
    ("tower_10^10^10", _wrap("10^{10^{10}}"), "36"),
    ("factorial_10^10", _wrap("(10^{10})!"), "36"),
    ("binomial_10^9", _wrap("\\binom{10^{9}}{5 \\cdot 10^{8}}"), "36"),
    ("tower_gold", _wrap("36"), "2^{2^{2^{2^{2^{2}}}}}"),
    ("parentheses_3000", _wrap("(" * 3000 + "1" + ")" * 3000), "1"),
    ("braces_3000", _wrap("{" * 3000 + "1" + "}" * 3000), "1"),
    ("sqrt_5000", _wrap("\\sqrt{" * 5000 + "2" + "}" * 5000), "2"),
    ("parentheses_3000_bare", "(" * 3000 + "1" + ")" * 3000, "1"),
    ("boxed_3000_unclosed", "\\boxed{" * 3000, "1"),
    ("think_open_100k", "<think>" * 14_300, "36"),
    ("answer_open_100k", "<answer>" * 12_500, "36"),
    ("think_close_answer_100k", "<think></think><answer>" * 4_350, "36"),
    ("close_think_answer_100k", "</think> <answer>" * 5_900, "36"),
    ("digits_1e5_answer", _wrap(_HUGE_DIGITS), "36"),
    ("digits_1e5_bare", _HUGE_DIGITS, "36"),
    ("digits_1e5_gold", _wrap("36"), _HUGE_DIGITS),
    ("decimal_1e5", _wrap("3." + _HUGE_DIGITS), "3"),
    ("text_100k_no_tags", "the answer is x + y " * 5_000, "36"),
    ("arabic_indic_digits", _wrap("٣٦"), "36"),
    ("fullwidth_digits", _wrap("３６"), "36"),
    ("empty_completion", "", "36"),
    ("empty_gold", _wrap("36"), ""),
    ("none_completion", None, "36"),
    ("none_gold", _wrap("36"), None),
]


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer() as module_scorer:
        yield module_scorer


def test_default_limit_is_a_few_seconds():
    assert DEFAULT_TIME_LIMIT_SECONDS == 5.0


@pytest.mark.parametrize("case", ADVERSARIAL, ids=[case[0] for case in ADVERSARIAL])
def test_adversarial_completion_scores_in_under_a_second(scorer, case):
    _, completion, gold = case
    scorer.score_completions(["warm"], ["1"], REWARD_FUNCTIONS)   # the worker's start not timed
    started = time.perf_counter()
    scores = scorer.score_completions([completion], [gold], REWARD_FUNCTIONS,
                                      time_limit_seconds=DEFAULT_TIME_LIMIT_SECONDS)
    elapsed = time.perf_counter() - started
    assert scores["timeouts"] == [0.0]
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    assert all(scores[name][0] >= 0.0 for name in REWARD_FUNCTIONS)


def test_adversarial_batch_keeps_one_worker(scorer):
    completions = [case[1] for case in ADVERSARIAL]
    golds = [case[2] for case in ADVERSARIAL]
    starts = scorer.worker_starts
    scores = scorer.score_completions(completions, golds, REWARD_FUNCTIONS)
    assert scores["timeouts"] == [0.0] * len(ADVERSARIAL)
    assert scorer.worker_starts == max(starts, 1)
    expected = {"arabic_indic_digits": 0.2, "fullwidth_digits": 0.2, "empty_completion": 0.0,
                "none_completion": 0.0}
    for (name, _, _), total in zip(ADVERSARIAL, scores["total"]):
        if name in expected:
            assert total >= expected[name], name


def test_hangs_and_crashes_cost_their_completion_only(scorer, caplog):
    functions = {"sleeping": hanging_rewards.sleeping_reward,
                 "int_power": hanging_rewards.int_power_reward,
                 "c_loop": hanging_rewards.c_loop_reward,
                 "exiting": hanging_rewards.exiting_reward,
                 "process_id": hanging_rewards.process_id_reward}
    completions = ["fine", "sleep", "fine", "power", "fine", "c_loop", "fine", "exit", "fine"]
    limit = 1.0
    starts = scorer.worker_starts
    started = time.perf_counter()
    with caplog.at_level("WARNING", logger="qerl_jax.rewards.scoring"):
        scores = scorer.score_completions(completions, ["1"] * len(completions), functions,
                                          time_limit_seconds=limit)
    elapsed = time.perf_counter() - started
    assert scores["timeouts"] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    for index, timed_out in enumerate(scores["timeouts"]):
        if timed_out:
            assert all(scores[name][index] == 0.0 for name in functions)
            assert scores["total"][index] == 0.0
        else:
            assert scores["sleeping"][index] == scores["int_power"][index] == 1.0
    # the sleep and the exit end their worker (the CPU-limited two may, on a loaded host)
    process_ids = [scores["process_id"][index] for index in (0, 2, 4, 6, 8)]
    assert len(set(process_ids)) >= 3
    assert 2 <= scorer.worker_starts - starts <= 4
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "4 of 9 completions" in lines[0], lines   # one line per batch
    assert "the worker died, the first starting 'exit'" in lines[0]
    # at most the wall limit for each hang, plus a restart (under 5 s: test_worker_starts_fast)
    assert elapsed < 3 * WALL_CLOCK_FACTOR * limit + 4 * 5.0, f"{elapsed:.1f} s"


def test_the_cpu_limit_stops_python_and_c_code(caplog):
    """The int power returns to the interpreter, where the CPU timer stops it and the worker
    stays; the C loop never does, and RLIMIT_CPU ends its worker. (A wall limit of 60x leaves
    the CPU limits to act first, however loaded the host.)"""
    functions = {"int_power": hanging_rewards.int_power_reward,
                 "c_loop": hanging_rewards.c_loop_reward,
                 "process_id": hanging_rewards.process_id_reward}
    with RewardScorer(wall_clock_factor=60.0) as own:
        with caplog.at_level("WARNING", logger="qerl_jax.rewards.scoring"):
            scores = own.score_completions(["fine", "power", "fine", "c_loop", "fine"],
                                           ["1"] * 5, functions, time_limit_seconds=1.0)
        assert scores["timeouts"] == [0.0, 1.0, 0.0, 1.0, 0.0]
        process_ids = [scores["process_id"][index] for index in (0, 2, 4)]
        assert process_ids[0] == process_ids[1] != process_ids[2]
        assert own.worker_starts == 2
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "2 over 1 s of CPU, the first starting 'power'" in lines[0], lines


def test_a_worker_the_host_does_not_run_still_scores(scorer):
    """The worker is stopped (SIGSTOP) for twice the limit while it scores, as on a host too
    busy to run it: the limit counts CPU time, so the completion scores."""
    functions = {"process_id": hanging_rewards.process_id_reward,
                 "format": REWARD_FUNCTIONS["format"]}
    worker_pid = int(scorer.score_completions(["warm"], ["1"], functions)["process_id"][0])
    limit = 1.0
    os.kill(worker_pid, signal.SIGSTOP)
    resume = threading.Timer(2 * limit, os.kill, (worker_pid, signal.SIGCONT))
    resume.start()
    try:
        scores = scorer.score_completions([_wrap("1")], ["1"], functions,
                                          time_limit_seconds=limit)
    finally:
        resume.join()
    assert scores["timeouts"] == [0.0]
    assert scores["format"] == [0.2]
    assert scores["process_id"] == [float(worker_pid)]


def test_failing_rewards_score_zero(scorer):
    functions = {"raising": hanging_rewards.raising_reward,
                 "none": hanging_rewards.none_reward, "nan": hanging_rewards.nan_reward,
                 "format": REWARD_FUNCTIONS["format"]}
    for limit in (DEFAULT_TIME_LIMIT_SECONDS, None):
        scores = scorer.score_completions([_wrap("1")], ["1"], functions,
                                          time_limit_seconds=limit)
        assert scores == {"raising": [0.0], "none": [0.0], "nan": [0.0], "format": [0.2],
                          "total": [0.2], "timeouts": [0.0]}


def test_worker_never_imports_jax(scorer):
    import jax  # noqa: F401  (the parent has it; the worker must not pay for it)
    scores = scorer.score_completions(["x"], ["1"], {"jax": hanging_rewards.jax_imported_reward})
    assert scores["jax"] == [0.0]


def test_worker_is_reused_across_batches_and_closes():
    with RewardScorer() as own:
        functions = {"process_id": hanging_rewards.process_id_reward}
        first = own.score_completions(["a", "b"], ["1", "1"], functions)["process_id"]
        second = own.score_completions(["c"], ["1"], functions)["process_id"]
        assert first[0] == first[1] == second[0] != float(os.getpid())
        assert own.worker_starts == 1
        process = own._slot.worker.process
    assert process.poll() is not None   # the with block closed it
    assert own.worker_starts == 1


def test_in_process_scoring_starts_no_worker():
    own = RewardScorer()
    functions = {"process_id": hanging_rewards.process_id_reward}
    for limit in (None, 0):
        scores = own.score_completions(["a"], ["1"], functions, time_limit_seconds=limit)
        assert scores["process_id"] == [float(os.getpid())]
    assert own.worker_starts == 0
    assert score_completions(["a"], ["1"], functions, time_limit_seconds=None)["process_id"] == [
        float(os.getpid())]


def test_unpicklable_reward_is_a_clear_error():
    functions = {"lambda": lambda completion, gold: 1.0}
    with pytest.raises(ValueError, match="time_limit_seconds=None"):
        score_completions(["a"], ["1"], functions)
    assert score_completions(["a"], ["1"], functions, time_limit_seconds=None)["lambda"] == [1.0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        score_completions(["a", "b"], ["1"], REWARD_FUNCTIONS)
    with pytest.raises(ValueError, match="reserved"):
        score_completions(["a"], ["1"], {"total": hanging_rewards.none_reward})
    with pytest.raises(ValueError, match="time_limit_seconds must be >= 0"):
        score_completions(["a"], ["1"], REWARD_FUNCTIONS, time_limit_seconds=-1.0)


def test_every_gsm8k_test_gold_scores_full_marks_through_the_worker(shared_data_dir, scorer):
    with open(os.path.join(shared_data_dir, "gsm8k", "test.jsonl")) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    assert len(rows) == 1319
    golds = [gsm8k_gold_answer(row["answer"]) for row in rows]
    completions = [_wrap(gold, row["answer"].rsplit("####", 1)[0])
                   for row, gold in zip(rows, golds)]
    functions = get_reward_functions(["format", "gsm8k_exact", "gsm8k_numeric"])
    scores = scorer.score_completions(completions, golds, functions)
    assert scores["gsm8k_exact"] == [2.0] * len(rows)
    assert scores["gsm8k_numeric"] == [2.0] * len(rows)
    assert scores["total"] == pytest.approx([4.2] * len(rows))
    assert scores["timeouts"] == [0.0] * len(rows)


def test_worker_starts_fast():
    with RewardScorer() as own:
        own.score_completions(["a"], ["1"], REWARD_FUNCTIONS)
        assert own.last_start_seconds < 5.0, own.last_start_seconds
    assert "qerl_jax.rewards.scoring_worker" not in sys.modules


def _running(pid):
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_worker_dies_with_its_parent_even_mid_computation():
    parent_code = (
        "from qerl_jax.rewards import RewardScorer\n"
        "from tests.rewards import hanging_rewards as h\n"
        "scorer = RewardScorer()\n"
        "functions = {'pid': h.process_id_reward, 'power': h.int_power_reward}\n"
        "print(int(scorer.score_completions(['x'], ['1'], functions)['pid'][0]), flush=True)\n"
        "scorer.score_completions(['power'], ['1'], functions, time_limit_seconds=600)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=root,
                              stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(0.5)   # the worker is inside 10**10**10 now
        assert _running(worker_pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5.0
    while _running(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(worker_pid)
