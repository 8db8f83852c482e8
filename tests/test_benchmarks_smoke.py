"""The GPU benchmark scripts' --smoke modes on CPU (tiny model, few tokens), as subprocesses, so
a change in the sampler, trainer, quantization or kernel hook that breaks them fails CI.

Both scripts run at the same time (each one parent + one worker process) to keep the test
short; the rollout one goes through the Pallas kernel path in interpret mode.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


def _start(script, out_dir, *flags):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke",
               "--out", str(out_dir), *flags]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(process):
    output, _ = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, output[-4000:]
    return output


def _worker_logs(out_dir, raw):
    folder = os.path.join(out_dir, raw)
    return "\n".join(open(os.path.join(folder, name)).read()[-3000:]
                     for name in sorted(os.listdir(folder)) if name.endswith(".log"))


def test_rollout_and_e2e_smoke(tmp_path):
    rollout_out, e2e_out = tmp_path / "rollout", tmp_path / "e2e"
    rollout = _start("rollout.py", rollout_out, "--formats", "nvfp4", "--batches", "2,3",
                     "--kernels-interpret")
    e2e = _start("e2e_step.py", e2e_out, "--formats", "nvfp4")
    rollout_text, e2e_text = _finish(rollout), _finish(e2e)

    with open(rollout_out / "rollout_tiny.json") as handle:
        rows = json.load(handle)["rows"]
    assert [row["batch"] for row in rows] == [2, 3], rollout_text[-3000:]
    for row in rows:
        assert row["status"] == "ok", (row, _worker_logs(rollout_out, "rollout_raw"))
        assert row["generated_tokens"] == row["batch"] * 8      # EOS off: every token made
        assert row["tokens_per_s"] > 0 and row["compile_s"] > 0
        assert row["kernel_layout_weights"] == "14 of 14"         # 2 layers x 7 projections
        assert row["path_decode"] == "nvfp4_fused"
    assert (rollout_out / "rollout_tiny.md").read_text().count("| tiny | nvfp4 |") == 2

    with open(e2e_out / "e2e_step_tiny.json") as handle:
        (row,) = json.load(handle)["rows"]
    assert row["status"] == "ok", (row, _worker_logs(e2e_out, "e2e_raw"))
    assert row["steps_done"] == 2
    assert row["step_s"] > 0 and row["step0_rollout_s"] > 0 and row["step0_train_s"] > 0
    assert row["aqn"] is True
    assert "| tiny | nvfp4 |" in e2e_text
