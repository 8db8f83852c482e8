"""The device mesh: logical axis rules and specs (in this process, one CPU device), and the
same computations on one device and on 8 forced host devices (in a subprocess, so the rest of
the suite keeps one device)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from qerl_jax.infra.errors import ConfigError
from tests.parallel.mesh_worker import COMPLETION, PROMPT, ROWS
from qerl_jax.experiment_config import base_config
from qerl_jax.parallel.mesh import (batch_spec, check_mesh_shape, logical_spec,
                                    mesh_from_config, tree_specs)
from qerl_jax.quant import get_format

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "parallel", "mesh_worker.py")
MESHES = ("data=8", "fsdp=2,tensor=4", "fsdp=8")


def _key(name):
    return jax.tree_util.DictKey(name)


def _weight_tree(projection: str, out_features: int, in_features: int, format_name="nvfp4"):
    weight = jax.random.normal(jax.random.key(0), (out_features, in_features), jnp.float32)
    quantized = get_format(format_name).quantize(weight, check_finite=False)
    return {"layers": {"0": {projection: {"weight": quantized,
                                          "lora_a": jnp.zeros((in_features, 4)),
                                          "lora_b": jnp.zeros((4, out_features))}}}}


def test_codes_and_block_scales_share_the_weights_logical_spec():
    tree = _weight_tree("q_proj", 64, 128)
    specs = tree_specs(tree, {"data": 1, "fsdp": 2, "tensor": 4})["layers"]["0"]["q_proj"]
    weight = specs["weight"]
    assert weight.codes == weight.block_scales == P("tensor", "fsdp")   # (out, in)
    assert weight.tensor_scale == P()
    assert specs["lora_a"] == P("fsdp") and specs["lora_b"] == P(None, "tensor")
    row_parallel = tree_specs(_weight_tree("down_proj", 64, 128),
                              {"fsdp": 2, "tensor": 4})["layers"]["0"]["down_proj"]["weight"]
    assert row_parallel.codes == row_parallel.block_scales == P("fsdp", "tensor")


def test_a_dimension_the_scales_cannot_split_stays_whole_for_codes_and_scales():
    # K = 64: NVFP4 codes [N, 32] split 8 ways, its block scales [N, 4] do not
    specs = tree_specs(_weight_tree("q_proj", 64, 64), {"fsdp": 8})["layers"]["0"]["q_proj"]
    assert specs["weight"].codes == specs["weight"].block_scales == P()
    nf4 = tree_specs(_weight_tree("up_proj", 64, 128, "nf4"),
                     {"fsdp": 2, "tensor": 2})["layers"]["0"]["up_proj"]["weight"]
    assert nf4.codes == nf4.block_scales == P("tensor", "fsdp")
    assert nf4.double_quant_scales == P() and nf4.tensor_scale == P()


def test_logical_and_batch_specs():
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    assert logical_spec(("vocab", "embed"), [(104, 128)], sizes) == P("tensor", "fsdp")
    assert logical_spec(("vocab", "embed"), [(103, 128)], sizes) == P(None, "fsdp")
    assert logical_spec((None, "rank"), [(8, 4)], sizes) == P()
    assert batch_spec((16, 5), sizes) == P(("data", "fsdp"))
    assert batch_spec((6, 5), sizes) == P("data")
    assert batch_spec((3, 5), sizes) == P()
    assert batch_spec((8,), {"data": 1, "fsdp": 4, "tensor": 2}) == P("fsdp")


def test_a_mesh_that_is_not_the_device_count_names_the_field():
    with pytest.raises(ConfigError, match=r"^config.mesh.data: data=2 x fsdp=1 x tensor=1 = "
                                          r"2 devices, but JAX sees 1"):
        check_mesh_shape({"data": 2, "fsdp": 1, "tensor": 1}, 1)
    config = base_config()
    assert mesh_from_config(config) is None   # 1 x 1 x 1: the single-device path
    config.mesh.tensor = 2
    with pytest.raises(ConfigError, match="config.mesh.data"):
        mesh_from_config(config)


def _run_worker(*args) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, WORKER, *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def test_meshes_compute_what_one_device_computes(tmp_path):
    """data=8, fsdp=2 x tensor=4 and fsdp=8 against one device, tiny float32 NVFP4 + LoRA model:
    greedy rollout tokens identical; the loss within 1e-6 relative; every gradient leaf within
    atol 1e-5 + rtol 1e-4 (float32 sums reordered across devices differ by ~1e-7 relative;
    gradients up to ~2 measured 1.3e-6 apart); the LoRA leaves after one AdamW update within
    atol 1e-6; and the 4-bit weights are actually split on the fsdp/tensor meshes."""
    out = str(tmp_path / "equality.npz")
    _run_worker("equality", out, *MESHES)
    results = np.load(out)
    single = {key.split("/", 1)[1]: results[key] for key in results if key.startswith("single/")}
    assert len(np.unique(single["tokens"])) > 8   # varied tokens, not one repeated id
    for mesh in MESHES:
        np.testing.assert_array_equal(results[f"{mesh}/tokens"], single["tokens"], err_msg=mesh)
        np.testing.assert_allclose(results[f"{mesh}/loss"], single["loss"], rtol=1e-6,
                                   err_msg=mesh)
        grads = [name for name in single if name.startswith("grad0")]
        updated = [name for name in single if name.startswith("updated")]
        assert len(grads) == len(updated) > 20
        for name in grads:
            np.testing.assert_allclose(results[f"{mesh}/{name}"], single[name], atol=1e-5,
                                       rtol=1e-4, err_msg=f"{mesh} {name}")
        for name in updated:
            np.testing.assert_allclose(results[f"{mesh}/{name}"], single[name], atol=1e-6,
                                       rtol=0, err_msg=f"{mesh} {name}")
        assert bool(results[f"{mesh}/frozen_sharded"]) == (mesh != "data=8"), mesh


@pytest.mark.slow
def test_pallas_kernels_run_per_device_on_a_mesh(tmp_path):
    """The Pallas kernels (interpret mode, bfloat16 compute) on meshes, per device on its rows:
    every launch of the fused and dequantize backends equals the inner backend run on each
    device's rows one at a time, bit for bit (data=2, data=2 x tensor=2, data=8); on data=2 and
    data=2 x tensor=2 (kv heads split too) the model's greedy rollout tokens equal one
    device's, the loss within 1e-6 relative and every gradient within (2^-7 + n 2^-24) of its
    leaf's largest magnitude: the mesh reorders the sums, and a sum rounded to bfloat16 (8
    significand bits) lands on one of the two bfloat16 neighbours of its value, at most one
    unit in the last place apart (2^-7 of its magnitude), while reordering float32 partial sums
    of n = rows x positions terms adds at most n 2^-24 relative (data=8 is not compared: with
    32 training rows per device the fused M <= 64 kernel, bfloat16 output, takes them where
    one device's 256 take dequantize + dot: 2.0e-2); the logs show the per-device kernels and decode
    attention registered."""
    out = str(tmp_path / "kernels.npz")
    _run_worker("kernels", out)
    results = np.load(out)
    single = {key.split("/", 1)[1]: results[key] for key in results if key.startswith("single/")}
    assert len(np.unique(single["tokens"])) > 8
    grads = [name for name in single if name.startswith("grad0")]
    for mesh in ("data=2", "data=2,tensor=2", "data=8"):
        launches = [key for key in results if key.startswith(f"{mesh}/launch/")]
        assert len(launches) == 7, launches
        assert all(bool(results[key]) for key in launches), \
            [key for key in launches if not results[key]]
    for mesh in ("data=2", "data=2,tensor=2"):
        np.testing.assert_array_equal(results[f"{mesh}/tokens"], single["tokens"], err_msg=mesh)
        np.testing.assert_allclose(results[f"{mesh}/loss"], single["loss"], rtol=1e-6,
                                   err_msg=mesh)
        for name in grads:
            scale = np.max(np.abs(single[name]))
            bound = (2.0 ** -7 + ROWS * (PROMPT + COMPLETION) * 2.0 ** -24) * scale
            assert np.max(np.abs(results[f"{mesh}/{name}"] - single[name])) <= bound, \
                (mesh, name)
        shape = "{" + ", ".join(f"'{axis}': {size}" for axis, size in zip(
            ("data", "fsdp", "tensor"), [dict(part.split("=") for part in mesh.split(",")).get(
                axis, "1") for axis in ("data", "fsdp", "tensor")])) + "}"
        log = list(results["log"])
        assert any(line.startswith("registered Pallas kernels for cpu") and
                   line.endswith(f"per device on mesh {shape})") for line in log), (mesh, shape)
        assert any(line == "registered the Pallas decode attention for cpu (interpret=True, "
                   f"per device on mesh {shape})" for line in log), mesh


def test_a_model_is_built_straight_onto_its_shards(tmp_path):
    """random_quantized_model and load_quantized_hf_model with place_parameter (what
    build_model does on a mesh of several devices) put every tensor on the sharding the
    trainer's Placement gives it, with the values of the one-device build, on fsdp=2 x tensor=4
    (4-bit weights split) and data=8 (replicated). The fused attention's inputs, placed as
    cuDNN's partitioner requires (constrain_attention_inputs), give the unplaced output (XLA's
    implementation of the same call; float32 sums reordered: within 1e-6)."""
    out = str(tmp_path / "placed.npz")
    _run_worker("placed", out, str(tmp_path / "hf"))
    results = np.load(out)
    for mesh in ("fsdp=2,tensor=4", "data=8"):
        for build in ("random", "hf"):
            assert results[f"{mesh}/{build}/shardings"], (mesh, build)
            assert results[f"{mesh}/{build}/values"], (mesh, build)
    assert results["fsdp=2,tensor=4/random/split"] and results["fsdp=2,tensor=4/hf/split"]
    assert not results["data=8/random/split"]
    for mesh in ("fsdp=2,tensor=4", "data=2,fsdp=2,tensor=2"):
        assert results[f"attention/{mesh}"] <= 1e-6, (mesh, results[f"attention/{mesh}"])
    # q, k, v one spec (4 q heads and 2 kv heads split over tensor=2; over tensor=4 the kv
    # heads cannot be, so neither is); the bias's rows as q's
    rows = "(('data', 'fsdp'),)"
    assert list(results["attention_specs/data=2,fsdp=2,tensor=2"]) == [
        "(('data', 'fsdp'), None, 'tensor')"] * 3 + [rows]
    assert list(results["attention_specs/fsdp=2,tensor=4"]) == ["('fsdp',)"] * 4


def test_attention_inputs_get_one_spec_that_cudnn_accepts():
    """q's heads (4) split over tensor=2 only where the kv heads (2) split the same way; rows
    over data x fsdp; sequence and head dims whole; the bias's rows as q's."""
    from jax.sharding import Mesh

    from qerl_jax.parallel.mesh import constrain_attention_inputs

    devices = np.asarray(jax.devices()[:1]).reshape(1, 1, 1)
    mesh = Mesh(devices, ("data", "fsdp", "tensor"))
    q = jnp.zeros((2, 4, 4, 8))
    assert constrain_attention_inputs(q, q[:, :, :2], q[:, :, :2], q[:, :1], None)[0] is q
    # one device: every axis has size 1, so nothing is split (and nothing raises)
    out = jax.jit(lambda *a: constrain_attention_inputs(*a, mesh))(q, q[:, :, :2], q[:, :, :2],
                                                                    q[:, :1])
    assert [o.shape for o in out] == [(2, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8), (2, 1, 4, 8)]
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    assert logical_spec(("batch", None, "heads", None), [(8, 16, 4, 32), (8, 16, 2, 32)],
                        sizes) == P(("data", "fsdp"), None, "tensor")
    assert logical_spec(("batch", None, "heads", None), [(8, 16, 4, 32), (8, 16, 1, 32)],
                        sizes) == P(("data", "fsdp"))


def test_a_checkpoint_saved_on_one_mesh_restores_on_another(tmp_path):
    """Train state (LoRA, norms, AdamW moments) saved on fsdp=2 x tensor=4 restores exactly onto
    data=8, fsdp=8 and one device, and one saved on one device restores onto fsdp=2 x tensor=4;
    each restored array carries the target mesh's sharding."""
    out = str(tmp_path / "checkpoint.npz")
    _run_worker("checkpoint", out, str(tmp_path / "checkpoints"))
    results = np.load(out)
    saved = {key.split("/", 1)[1]: results[key] for key in results if key.startswith("saved/")}
    assert len(saved) > 50
    for target in ("data=8", "fsdp=8", "single", "from_single"):
        for name, value in saved.items():
            np.testing.assert_array_equal(results[f"{target}/{name}"], value,
                                          err_msg=f"{target} {name}")
        if target != "single":
            assert bool(results[f"{target}/shardings_match"]), target


def test_grpo_step_benchmark_runs_on_a_mesh(tmp_path):
    """benchmarks/grpo_step.py on a mesh (--config.mesh.*, the GPU scaling runs' entry) as a CPU
    smoke on 8 forced host devices: two GRPO steps of the tiny NVFP4 model on data=2 x fsdp=2 x
    tensor=2, the sampler compiled ahead of time for the mesh-placed weights
    (rollout.offload_weights_for_compile on)."""
    import json

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "grpo_step.py"), "--smoke",
         "--formats", "nvfp4", "--config.mesh.data=2", "--config.mesh.fsdp=2",
         "--config.mesh.tensor=2", "--prompts", "2", "--micro-batch", "8",
         "--config.rollout.offload_weights_for_compile=on", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "grpo_step_tiny.json") as handle:
        (row,) = json.load(handle)["rows"]
    assert row["status"] == "ok", row
    assert row["mesh"] == "data=2,fsdp=2,tensor=2" and row["mesh_devices"] == 8
    assert row["prompts"] == 2 and row["steps_done"] == 2
    assert row["step_tokens_per_s_per_device"] * 8 == pytest.approx(row["step_tokens_per_s"])
    assert row["step0_sampler_compile_s"] > 0


def test_grpo_step_mesh_fields_are_checked_before_any_work(tmp_path):
    """The mesh is config.mesh.* through the trainer's validation: a bad axis size is one line
    naming the field, exit status 2, before any worker starts."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "grpo_step.py"), "--smoke",
         "--formats", "nvfp4", "--config.mesh.data=0", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "config.mesh.data" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _trainer_run(workdir, mesh: str, devices: int, *extra, background=False):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    command = [sys.executable, WORKER, "trainer", str(workdir), mesh, *extra]
    if background:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_the_trainer_on_a_mesh_and_over_two_processes(tmp_path, tiny_warmup):
    """tests/test_trainer.py's tiny run (2 GRPO steps, sampled rollouts, AQN, KL term, held-out
    greedy evaluation at step 0) on one
    device and on data=2 x fsdp=2 x tensor=2 over two processes of 4 forced host devices each
    (jax.distributed on localhost, CPU collectives over gloo). Same
    rollouts (rewards, accuracy and completion lengths exactly: the random draws do not depend
    on the sharding), loss, grad_norm, entropy and KL within 1e-4 relative + 1e-6 absolute
    (measured ~2e-6 relative); only process 0 writes metrics and run.json. Resuming the
    two-process run's checkpoint on one device continues at step 2."""
    import json
    import shutil

    from qerl_jax.infra.metrics import read_metrics
    from qerl_jax.infra.run_record import read_starts

    single, processes = tmp_path / "single", tmp_path / "processes"
    shutil.copytree(tiny_warmup, single / "warmup")
    _trainer_run(single, "", 1)
    shutil.copytree(single / "warmup", processes / "warmup")
    coordinator = f"localhost:{_free_port()}"
    other = _trainer_run(processes, "data=2,fsdp=2,tensor=2", 4, coordinator, "1",
                         background=True)
    try:
        _trainer_run(processes, "data=2,fsdp=2,tensor=2", 4, coordinator, "0")
        assert other.wait(timeout=300) == 0, other.stdout.read()[-4000:]
    finally:
        if other.poll() is None:
            other.kill()
    reference = read_metrics(str(single))
    assert [row["step"] for row in reference] == [0, 1] and "eval/pass@1" in reference[0]
    rows = read_metrics(str(processes))
    assert len(rows) == 2
    for row, expected in zip(rows, reference):
        for name in ("reward", "accuracy", "completion_length", "truncated_fraction",
                     "learning_rate", "aqn_sigma", "eval/pass@1", "eval/mean_length"):
            assert row.get(name) == expected.get(name), name
        for name in ("loss", "grad_norm", "entropy", "kl", "clip_fraction"):
            assert row[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    assert len(read_starts(str(processes))) == 1   # one writer
    with open(processes / "metrics.jsonl") as handle:
        assert len(handle.read().splitlines()) == 2
    _trainer_run(processes, "", 1, "resume")   # the 8-device checkpoint onto one device
    rows = read_metrics(str(processes))
    assert [row["step"] for row in rows] == [0, 1, 2, 3]   # 3: the final policy's evaluation
    assert "eval/pass@1" in rows[2] and "eval/pass@1" in rows[3]
    starts = read_starts(str(processes))
    assert starts[-1]["start_step"] == 2 and starts[-1]["config"]["mesh"]["data"] == 1
