"""Runs a tiny NVFP4 + LoRA model on one device and on device meshes, and writes what each run
computed to an .npz file for tests/parallel/test_mesh.py to compare.

Started in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag must
be set before JAX starts, so the rest of the test suite keeps one CPU device).

    python tests/parallel/mesh_worker.py equality OUT.npz data=8 fsdp=2,tensor=4 fsdp=8
    python tests/parallel/mesh_worker.py checkpoint OUT.npz CHECKPOINT_DIR
    python tests/parallel/mesh_worker.py placed OUT.npz HF_DIR
    python tests/parallel/mesh_worker.py trainer WORKDIR MESH [COORDINATOR PROCESS_ID | resume]

equality: per mesh (and for the single device, key prefix 'single'): greedy rollout tokens,
the micro-batch loss, the gradient leaves and the LoRA leaves after one AdamW update.
checkpoint: the train state saved on one mesh and restored on another (and on one device):
the restored leaves, and whether each restored leaf carries the target's sharding.
placed: models built tensor by tensor onto a mesh (random and from an HF checkpoint written to
HF_DIR): each one's shardings and values, and the fused attention on placed inputs.
trainer: two steps of tests/test_trainer.py's tiny run on MESH ('' = one device), as one of two
processes with COORDINATOR, or a third step resumed from WORKDIR's checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from qerl_jax.infra.checkpointing import TrainingCheckpoints  # noqa: E402
from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora  # noqa: E402
from qerl_jax.model_quant.quantize import quantize_model  # noqa: E402
from qerl_jax.models.config import preset  # noqa: E402
from qerl_jax.models.transformer import init_model  # noqa: E402
from qerl_jax.parallel.mesh import Placement, make_mesh  # noqa: E402
from qerl_jax.rl.losses import LossConfig  # noqa: E402
from qerl_jax.rl.optimizer import make_optimizer  # noqa: E402
from qerl_jax.rl.train_step import make_train_programs  # noqa: E402
from qerl_jax.sampling import SamplingConfig, generate_from_states  # noqa: E402

ROWS, PROMPT, COMPLETION = 16, 8, 8


def _interpret() -> bool:
    """Pallas interpret mode, except on a GPU (asked only once a part runs: the trainer part
    must initialize jax.distributed before anything starts the backend)."""
    return jax.default_backend() != "gpu"


def parse_mesh(text: str) -> dict[str, int]:
    """'fsdp=2,tensor=4' -> {'fsdp': 2, 'tensor': 4} (unnamed axes are 1)."""
    return {name: int(size) for name, size in (part.split("=") for part in text.split(","))}


def build_states(prepare=None, compute_dtype: str = "float32"):
    """(graphdef, trainable, frozen) of a 2-layer NVFP4 model (float32 parameters) with LoRA on
    every projection (B drawn non-zero, so every adapter has a gradient) and trainable norms;
    `prepare(model)` runs after quantizing (e.g. enable_kernels)."""
    architecture = preset("tiny_qwen2", param_dtype="float32", compute_dtype=compute_dtype,
                          remat=False, vocab_size=104, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, tie_word_embeddings=False)
    model = init_model(architecture, seed=0)
    # a larger head than the N(0, 0.02) init: distinct logits, so greedy ties cannot flip
    model.lm_head.weight.set_value(model.lm_head.weight.get_value() * 20.0)
    quantize_model(model, "nvfp4")
    if prepare is not None:
        prepare(model)
    add_lora(model, LoRAConfig(rank=8, alpha=16.0, train_norms=True), jax.random.key(1))
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree_util.tree_leaves(trainable))))
    trainable = jax.tree_util.tree_map(
        lambda leaf: leaf + 0.05 * jax.random.normal(next(keys), leaf.shape, leaf.dtype),
        trainable)
    return graphdef, trainable, frozen


def training_batch() -> dict:
    rng = np.random.default_rng(3)
    length = PROMPT + COMPLETION
    tokens = rng.integers(1, 104, (ROWS, length), dtype=np.int32)
    attention = np.ones((ROWS, length), np.bool_)
    attention[:, :2] = rng.random((ROWS, 2)) < 0.5    # some left padding
    loss_mask = rng.random((ROWS, COMPLETION)) < 0.85
    return {"tokens": tokens, "attention_mask": attention,
            "completion_tokens": tokens[:, PROMPT:], "loss_mask": loss_mask,
            "advantages": rng.normal(size=ROWS).astype(np.float32),
            "rollout_logprobs": (-4.6 + 0.3 * rng.normal(size=(ROWS, COMPLETION))).astype(
                np.float32)}


def optimizer_config():
    return ml_collections.ConfigDict(dict(warmup_ratio=0.0, total_steps=10, learning_rate=1e-2,
                                          adam_b1=0.9, adam_b2=0.99, weight_decay=0.1,
                                          max_grad_norm=1.0))


def run(graphdef, trainable, frozen, placement: Placement, rollout: bool = True) -> dict:
    """Greedy tokens (rollout=True), loss, gradients and the updated trainable leaves on
    `placement`."""
    optimizer, _ = make_optimizer(optimizer_config())
    trainable, frozen = placement.states(trainable), placement.states(frozen)
    opt_state = placement.states(optimizer.init(trainable))
    shardings = (None if placement.mesh is None
                 else (placement.shardings(trainable), placement.shardings(opt_state)))
    programs = make_train_programs(graphdef, LossConfig(max_completion_length=COMPLETION),
                                   optimizer, temperature=1.0, completion_length=COMPLETION,
                                   logits_chunk_size=4, state_shardings=shardings)
    batch = {name: placement.rows(value) for name, value in training_batch().items()}
    tokens = jnp.float32(batch["loss_mask"].sum())
    (loss, _), grads = programs.accumulate_gradient(
        trainable, frozen, batch, tokens, jnp.float32(ROWS), programs.zero_grads(trainable))
    updated, _, norm, _ = programs.apply_update_copy(trainable, opt_state, grads)
    out = {"loss": np.asarray(loss), "grad_norm": np.asarray(norm)}
    if rollout:
        prompts = training_batch()["tokens"][:, :PROMPT]
        out["tokens"] = np.asarray(generate_from_states(
            graphdef, (trainable, frozen), prompts, np.ones_like(prompts, np.bool_),
            jax.random.key(4), SamplingConfig(max_new_tokens=12, greedy=True, prompt_bucket=8),
            mesh=placement.mesh).tokens)
    out.update({f"grad{i:03d}": np.asarray(g) for i, g in
                enumerate(jax.tree_util.tree_leaves(grads))})
    out.update({f"updated{i:03d}": np.asarray(u) for i, u in
                enumerate(jax.tree_util.tree_leaves(updated))})
    if placement.mesh is not None:   # the frozen 4-bit weights keep their shardings
        out["frozen_sharded"] = np.asarray(any(
            not leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(frozen)))
    return out


def equality(path: str, meshes: list[str]) -> None:
    graphdef, trainable, frozen = build_states()
    results = {f"single/{k}": v for k, v in run(graphdef, trainable, frozen,
                                                Placement(None)).items()}
    for text in meshes:
        placement = Placement(make_mesh(parse_mesh(text)))
        results.update({f"{text}/{k}": v for k, v in
                        run(graphdef, trainable, frozen, placement).items()})
    np.savez(path, **results)


class _KernelPaths(logging.Handler):
    """Collects the quantized-linear and decode-attention paths the run logs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# the model runs with kernels on these meshes; the backend launches also on data=8
KERNEL_MESHES = ("data=2", "data=2,tensor=2")


def _backend_launches(mesh) -> dict:
    """Each launch of the row-sharded fused and dequantize backends on `mesh` against the inner
    backend run on each device's rows one by one (the same program on the same rows)."""
    from qerl_jax.model_quant.kernel_setup import enable_kernels
    from qerl_jax.parallel.sharded_backend import RowShardedBackend, row_shards
    from qerl_jax.quant.backends.triton import TritonDecodeBackend, TritonDequantizeBackend
    from qerl_jax.quant.kernel_options import KernelOptions

    model = build_states(lambda model: enable_kernels(model, interpret=_interpret()), "bfloat16")
    frozen = model[2]
    mlp = frozen["layers"][0]["mlp"]
    attention = frozen["layers"][0]["self_attn"]
    gate, up = mlp["gate_proj"]["weight"].get_value(), mlp["up_proj"]["weight"].get_value()
    q, k = attention["q_proj"]["weight"].get_value(), attention["k_proj"]["weight"].get_value()
    rng = np.random.default_rng(5)
    rows = 16
    x = jnp.asarray(rng.normal(size=(rows, 128)), jnp.bfloat16)
    x_a = jnp.asarray(rng.normal(size=(rows, 16)), jnp.bfloat16)
    lora_b = jnp.asarray(0.1 * rng.normal(size=(8, q.shape[0])), jnp.bfloat16)
    group_bs = (lora_b, jnp.asarray(0.1 * rng.normal(size=(8, k.shape[0])), jnp.bfloat16))
    swiglu_bs = (jnp.asarray(0.1 * rng.normal(size=(8, 256)), jnp.bfloat16),) * 2
    grad = jnp.asarray(rng.normal(size=(rows, q.shape[0])), jnp.bfloat16)
    bf16 = jnp.bfloat16
    launches = {
        "apply": lambda b, x, x_a, g: b.apply(x, q, compute_dtype=bf16),
        "apply_lora": lambda b, x, x_a, g: b.apply_lora(x, q, x_a[:, :8], lora_b, 2.0,
                                                         compute_dtype=bf16),
        "apply_grouped": lambda b, x, x_a, g: b.apply_grouped(x, (q, k), x_a, group_bs,
                                                              (2.0, 0.5), compute_dtype=bf16),
        "apply_swiglu": lambda b, x, x_a, g: b.apply_swiglu(x, (gate, up), x_a, swiglu_bs,
                                                            (2.0, 2.0), None,
                                                            compute_dtype=bf16),
        "apply_backward": lambda b, x, x_a, g: b.apply_backward(g, q, compute_dtype=bf16),
    }
    shards = row_shards(mesh, rows)
    out = {}
    for inner in (TritonDecodeBackend("nvfp4", KernelOptions(), interpret=_interpret()),
                  TritonDequantizeBackend("nvfp4", interpret=_interpret())):
        sharded = RowShardedBackend(inner, mesh)
        for name, launch in launches.items():
            if name in ("apply_lora", "apply_grouped", "apply_swiglu") and \
                    not inner.lora_epilogue:
                continue
            got = jax.jit(lambda x, x_a, g: launch(sharded, x, x_a, g))(x, x_a, grad)
            pieces = [launch(inner, *(a[i * rows // shards:(i + 1) * rows // shards]
                                      for a in (x, x_a, grad))) for i in range(shards)]
            expected = jax.tree_util.tree_map(lambda *p: jnp.concatenate(p), *pieces)
            out[f"{inner.name}.{name}"] = np.asarray(all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                    jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected),
                    strict=True)))
    return out


def _first_divergence(states, single_tokens, mesh_tokens) -> np.ndarray:
    """Per row whose greedy tokens differ between one device and a mesh (compiled kernels on
    GPUs, whose XLA dots need not round alike at another row count): [row, position, the
    one-device model's logit gap between the two chosen tokens there, its logits' range],
    from a full forward over the prompt and the tokens both runs agree on."""
    from qerl_jax.quant.kernel_options import KernelOptions
    from qerl_jax.quant.kernel_registry import register_kernels

    register_kernels(jax.default_backend(), KernelOptions())   # one device's, as it ran there
    graphdef, trainable, frozen = states
    model = nnx.merge(graphdef, trainable, frozen)
    prompts = training_batch()["tokens"][:, :PROMPT]
    rows = []
    for row in np.flatnonzero(np.any(single_tokens != mesh_tokens, axis=1)):
        position = int(np.argmax(single_tokens[row] != mesh_tokens[row]))
        tokens = np.concatenate([prompts[row], single_tokens[row, :position]])[None]
        logits = np.asarray(model(jnp.asarray(tokens)), np.float32)[0, -1]
        gap = abs(logits[single_tokens[row, position]] - logits[mesh_tokens[row, position]])
        rows.append([row, position, gap, logits.max() - logits.min()])
    return np.asarray(rows, np.float32).reshape(-1, 4)


def kernels(path: str) -> None:
    """The tiny model in bfloat16 compute with the Pallas kernels (interpret mode; the CPU has
    no bf16 x bf16 -> f32 dot for the XLA path): on one device, and per device on each of
    KERNEL_MESHES (data=2 on 2 of the 8 devices, data=2 x tensor=2 on 4: rows and kv heads
    split, the matmul kernels registered for that mesh directly so that each launch gathers
    its tensor-split weight); plus each backend launch against its rows one device at a time,
    on those meshes and on data=8."""
    from qerl_jax.model_quant.kernel_setup import enable_decode_attention, enable_kernels
    from qerl_jax.parallel.sharded_backend import PerDeviceRows
    from qerl_jax.quant.kernel_options import KernelOptions
    from qerl_jax.quant.kernel_registry import register_kernels

    paths = _KernelPaths()
    logging.getLogger("qerl_jax").addHandler(paths)
    logging.getLogger("qerl_jax").setLevel(logging.INFO)
    results = {}
    def mesh_of(name):
        shape = parse_mesh(name)
        return make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])

    def fits(name):
        return np.prod(list(parse_mesh(name).values())) <= jax.device_count()

    for name in ("single", *filter(fits, KERNEL_MESHES)):
        mesh = None if name == "single" else mesh_of(name)
        replicated = mesh is None or mesh.shape["tensor"] == 1
        states = build_states(lambda model: enable_kernels(
            model, interpret=_interpret(), mesh=mesh if replicated else None), "bfloat16")
        if not replicated:
            register_kernels(jax.default_backend(), KernelOptions(), interpret=_interpret(),
                             wrap=PerDeviceRows(mesh))
            enable_decode_attention(jax.default_backend(), interpret=_interpret(), mesh=mesh)
        results.update({f"{name}/{k}": v for k, v in run(*states, Placement(mesh)).items()})
        if name == "single":
            single_states = states
        elif not _interpret():
            results[f"{name}/first_divergence"] = _first_divergence(
                single_states, results["single/tokens"], results[f"{name}/tokens"])
    for name in filter(fits, (*KERNEL_MESHES, "data=8")):
        results.update({f"{name}/launch/{k}": v
                        for k, v in _backend_launches(mesh_of(name)).items()})
    results["log"] = np.asarray(paths.messages)
    np.savez(path, **results)


def cudnn(path: str) -> None:
    """GPUs only: the tiny model in bfloat16 compute with cuDNN's fused training attention on
    one GPU and on fsdp=2 and data=2 (the mesh the model is built for: set_attention_mesh):
    loss, gradients and updated leaves per run."""
    from qerl_jax.models.transformer import set_attention_implementation, set_attention_mesh

    results = {}
    for name in ("single", "fsdp=2", "data=2"):
        mesh = None if name == "single" else make_mesh(parse_mesh(name), jax.devices()[:2])

        def prepare(model, mesh=mesh):
            set_attention_implementation(model, "cudnn")
            set_attention_mesh(model, mesh)
        states = build_states(prepare, "bfloat16")
        results.update({f"{name}/{k}": v for k, v in run(*states, Placement(mesh),
                                                         rollout=False).items()})
    np.savez(path, **results)


def checkpoint(path: str, directory: str) -> None:
    """Saves on fsdp=2,tensor=4 and restores onto data=8, fsdp=8 and one device; saves on one
    device and restores onto fsdp=2,tensor=4."""
    _, trainable, _ = build_states()
    optimizer, _ = make_optimizer(optimizer_config())

    def state(placement):
        placed = placement.states(trainable)
        return {"trainable": placed, "opt_state": placement.states(optimizer.init(placed))}

    results = {}
    source = Placement(make_mesh(parse_mesh("fsdp=2,tensor=4")))
    saved = state(source)
    results.update({f"saved/{i:03d}": np.asarray(leaf)
                    for i, leaf in enumerate(jax.tree_util.tree_leaves(saved))})
    checkpoints = TrainingCheckpoints(os.path.join(directory, "sharded"))
    checkpoints.save(1, saved, {"step": 1})
    for name, placement in (("data=8", Placement(make_mesh(parse_mesh("data=8")))),
                            ("fsdp=8", Placement(make_mesh(parse_mesh("fsdp=8")))),
                            ("single", Placement(None))):
        template = state(placement)
        restored, _ = checkpoints.restore(template, 1)
        leaves = jax.tree_util.tree_leaves(restored)
        results.update({f"{name}/{i:03d}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
        results[f"{name}/shardings_match"] = np.asarray(all(
            r.sharding.is_equivalent_to(t.sharding, np.ndim(t)) for r, t in
            zip(leaves, jax.tree_util.tree_leaves(template), strict=True)))
    checkpoints.close()
    single = TrainingCheckpoints(os.path.join(directory, "single"))
    single.save(1, state(Placement(None)), {"step": 1})
    restored, _ = single.restore(saved, 1)
    leaves = jax.tree_util.tree_leaves(restored)
    results.update({f"from_single/{i:03d}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
    results["from_single/shardings_match"] = np.asarray(all(
        r.sharding.is_equivalent_to(t.sharding, np.ndim(t))
        for r, t in zip(leaves, jax.tree_util.tree_leaves(saved), strict=True)))
    single.close()
    np.savez(path, **results)


def placed_build(path: str, directory: str) -> None:
    """The tiny NVFP4 model built tensor by tensor straight onto fsdp=2 x tensor=4 and data=8
    (random_quantized_model and, from an HF checkpoint of it, load_quantized_hf_model, with
    place_parameter): every leaf on the sharding Placement gives the built model, with the
    values of the same build on one device; and the fused-attention inputs placed by
    constrain_attention_inputs give the unconstrained output."""
    from qerl_jax.model_quant.quantize import load_quantized_hf_model
    from qerl_jax.model_quant.random_model import random_quantized_model
    from qerl_jax.models.hf_io import save_hf_model
    from qerl_jax.models.transformer import _attend_fused
    from qerl_jax.parallel.mesh import constrain_attention_inputs, place_parameter

    architecture = preset("tiny_qwen2", param_dtype="float32", compute_dtype="float32",
                          vocab_size=104, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, tie_word_embeddings=False)
    save_hf_model(init_model(architecture, seed=0), directory)
    builds = {
        "random": lambda place: random_quantized_model(architecture, "nvfp4", seed=0,
                                                       place=place),
        "hf": lambda place: load_quantized_hf_model(directory, "nvfp4",
                                                    compute_dtype="float32", place=place)[0],
    }
    results = {}
    for mesh_name in ("fsdp=2,tensor=4", "data=8"):
        mesh = make_mesh(parse_mesh(mesh_name), jax.devices())
        for build_name, build in builds.items():
            single = nnx.state(build(None))
            placed = nnx.state(build(lambda path, value: place_parameter(path, value, mesh)))
            expected = Placement(mesh).shardings(placed)
            leaves = jax.tree_util.tree_leaves(placed)
            tag = f"{mesh_name}/{build_name}"
            results[f"{tag}/shardings"] = np.asarray(all(
                leaf.sharding.is_equivalent_to(sharding, leaf.ndim) for leaf, sharding in zip(
                    leaves, jax.tree_util.tree_leaves(expected), strict=True)))
            results[f"{tag}/values"] = np.asarray(all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                    leaves, jax.tree_util.tree_leaves(single), strict=True)))
            results[f"{tag}/split"] = np.asarray(any(
                not leaf.sharding.is_fully_replicated for leaf in leaves))
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.normal(size=(8, 16, 2, 2, 32)), jnp.float32)
    keys, values = (jnp.asarray(rng.normal(size=(8, 16, 2, 32)), jnp.float32) for _ in range(2))
    mask = jnp.tril(jnp.ones((16, 16), jnp.bool_))[None].repeat(8, 0)
    attend = functools.partial(_attend_fused, scale=0.2, compute_dtype=jnp.float32,
                               implementation="xla")
    reference = np.asarray(jax.jit(lambda q, k, v: attend(q, mask, keys=k, values=v))(
        q, keys, values))
    for mesh_name in ("fsdp=2,tensor=4", "data=2,fsdp=2,tensor=2"):
        mesh = make_mesh(parse_mesh(mesh_name), jax.devices())
        got = jax.jit(lambda q, k, v, mesh=mesh: attend(q, mask, keys=k, values=v, mesh=mesh))(
            q, keys, values)
        results[f"attention/{mesh_name}"] = np.asarray(np.max(np.abs(np.asarray(got)
                                                                      - reference)))
        placed = jax.jit(lambda *a, mesh=mesh: constrain_attention_inputs(*a, mesh))(
            q.reshape(8, 16, 4, 32), keys, values, jnp.zeros((8, 1, 16, 16)))
        results[f"attention_specs/{mesh_name}"] = np.asarray(
            [str(tuple(array.sharding.spec)) for array in placed])
    np.savez(path, **results)


def trainer_config(mesh: str):
    """tests/test_trainer.py's tiny run (3 steps) on `mesh` ('' = one device)."""
    from tests.conftest import small_trainer_config

    config = small_trainer_config(total_steps=3)
    config.logging.tensorboard = False
    config.eval.every_steps = 2      # held-out greedy pass@1 at steps 0 and 2
    config.eval.num_examples = 8
    config.eval.batch_size = 8
    for axis, size in (parse_mesh(mesh).items() if mesh else ()):
        config.mesh[axis] = size
    return config


def trainer(workdir: str, mesh: str, coordinator: str = "", process_id: str = "") -> None:
    """The first two steps of the tiny run in `workdir` (checkpointed at the stop); with
    `coordinator`, as process `process_id` of two (config.distributed set explicitly); with
    coordinator 'resume', the third step, resumed from the workdir's checkpoint."""
    from qerl_jax.trainer import Trainer

    config = trainer_config(mesh)
    if coordinator == "resume":
        Trainer(config, workdir, resume=True).train()
        return
    if coordinator:
        config.distributed.coordinator_address = coordinator
        config.distributed.num_processes = 2
        config.distributed.process_id = int(process_id)
    Trainer(config, workdir).train(stop_after=2)


if __name__ == "__main__":
    part, out, *rest = sys.argv[1:]
    if part == "trainer":   # device count: whatever the caller set up
        trainer(out, *rest)
        sys.exit(0)
    if part == "kernels" and not _interpret():   # the meshes that fit the GPUs there are
        kernels(out)
        sys.exit(0)
    if part == "cudnn":
        cudnn(out)
        sys.exit(0)
    assert jax.device_count() == 8, jax.devices()
    if part == "equality":
        equality(out, rest)
    elif part == "placed":
        placed_build(out, rest[0])
    elif part == "kernels":
        kernels(out)
    else:
        checkpoint(out, rest[0])
