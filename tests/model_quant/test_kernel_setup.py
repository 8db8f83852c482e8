"""The kernels on a whole model (qerl_jax/model_quant/kernel_setup.py: enable_kernels,
disable_kernels, the decode attention) on CPU with the Pallas kernels in interpret mode: the
tiny model's logits and gradients, the state conversions, the decode-attention kernel's steps,
and the sampler's preparation outside its decode loop. The single launches:
tests/quant/test_kernels.py.

Reference: the model on its checkpoint-layout weights (the XLA path). Tolerances as in
tests/quant/test_kernels.py: the tiny model compounds the per-launch bound (2^-6 max|y|) over two
layers: logits within 2^-4 * max|logits|, mean difference within 2^-8 * max|logits|.
"""

import dataclasses
import functools
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qerl_jax.model_quant.kernel_setup import (disable_decode_attention, disable_kernels,
                                               enable_decode_attention, enable_kernels)
from qerl_jax.quant.backends import kernel_layout
from qerl_jax.quant.backends.kernel_layout import KernelLayoutWeight
from qerl_jax.quant.dispatch import select_matmul_path
from qerl_jax.quant.formats import get_format
from qerl_jax.quant.kernel_options import KernelOptions
from qerl_jax.quant.kernel_registry import unregister_kernels
from qerl_jax.quant.qarray import QuantizedWeight
from tests.conftest import leaves_bitwise_equal


# every test sees the once-per-reason path log messages again
pytestmark = pytest.mark.usefixtures("fresh_path_log")


def _tiny_quantized_model(format_name, compute_dtype="bfloat16", layers=2):
    from qerl_jax.models.config import preset
    from qerl_jax.models.transformer import init_model
    from qerl_jax.model_quant.quantize import quantize_model
    config = preset("tiny_qwen2", compute_dtype=compute_dtype, num_hidden_layers=layers)
    model = init_model(config, seed=3)
    quantize_model(model, format_name)
    return model


@pytest.mark.parametrize("format_name", ["nvfp4", "nf4"])
def test_tiny_model_logits_with_kernels(format_name, interpret_kernels):
    """Forward of a LoRA-adapted tiny CausalLM through nnx.split / jit / merge, kernel layout in
    the frozen state. (Gradients through the kernels: test_kernel_paths_match_xla_forward_and_dx;
    a model-level backward in interpret mode takes ~20 s, too slow here.)"""
    from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora
    from qerl_jax.model_quant.quantize import QuantizedParam
    # one decoder layer (7 projections, N and K in {64, 128}) keeps interpret mode quick
    model = _tiny_quantized_model(format_name, layers=1)
    add_lora(model, LoRAConfig(rank=4), jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(secrets.randbits(32)).integers(0, 128, (2, 8)))

    @functools.partial(jax.jit, static_argnums=0)
    def logits(graphdef, trainable, frozen, tokens):
        return nnx.merge(graphdef, trainable, frozen)(tokens)

    logits_ref = logits(*nnx.split(model, TRAINABLE, ...), tokens)
    assert enable_kernels(model, platform="cpu", interpret=True) is model
    weights = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, QuantizedParam)]
    assert len(weights) == 7 and all(isinstance(w, KernelLayoutWeight) for w in weights)
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    def is_quantized(value):
        return isinstance(value, QuantizedWeight)

    assert not any(isinstance(leaf, QuantizedWeight)
                   for leaf in jax.tree_util.tree_leaves(trainable, is_leaf=is_quantized))
    assert sum(isinstance(leaf, KernelLayoutWeight)
               for leaf in jax.tree_util.tree_leaves(frozen, is_leaf=is_quantized)) == 7
    mlp = model.layers[0].mlp
    gate, up = mlp.gate_proj.weight.get_value(), mlp.up_proj.weight.get_value()
    assert gate.kernel_codes is up.kernel_codes and (gate.pair_view, up.pair_view) == (
        (32, 0), (32, 1))  # enable_kernels made them views of one interleaved pair
    jaxpr = str(jax.make_jaxpr(logits, static_argnums=0)(graphdef, trainable, frozen, tokens))
    # one kernel jaxpr per distinct projection shape (q/o, k/v, gate|up pair, down)
    assert jaxpr.count("pallas_call") >= 4
    assert f"{format_name}_matmul_swiglu_lora" in jaxpr  # M = 16: the fused SwiGLU launch
    logits_kernel = logits(graphdef, trainable, frozen, tokens)

    scale = float(np.abs(np.asarray(logits_ref)).max())
    diff = np.abs(np.asarray(logits_kernel) - np.asarray(logits_ref))
    assert diff.max() <= 2.0 ** -4 * scale and diff.mean() <= 2.0 ** -8 * scale, (diff.max(),
                                                                                  scale)


def test_enable_kernels_on_cpu_without_interpret_changes_nothing():
    from qerl_jax.model_quant.quantize import QuantizedParam
    model = _tiny_quantized_model("nvfp4", compute_dtype="float32")
    enable_kernels(model, platform="cpu")
    values = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, QuantizedParam)]
    assert values and not any(isinstance(v, KernelLayoutWeight) for v in values)
    assert select_matmul_path("nvfp4", 1, "cpu") == "xla"


def test_export_merge_and_state_conversion_after_enabling(tmp_path):
    from qerl_jax.lora import LoRAConfig, add_lora, merge_lora
    from qerl_jax.models.safetensors_io import SafetensorsFile
    from qerl_jax.model_quant.compressed_tensors_io import export_compressed_tensors
    model = _tiny_quantized_model("nvfp4", compute_dtype="float32", layers=1)
    export_compressed_tensors(model, str(tmp_path / "before"))
    state_before = nnx.state(model)
    leaves_before = jax.tree_util.tree_leaves(state_before)  # nnx.state shares the Variables
    # pure conversion of a State, and back
    converted = kernel_layout.prepare_for_kernels(state_before)
    assert any(isinstance(leaf, KernelLayoutWeight) for leaf in jax.tree_util.tree_leaves(
        converted, is_leaf=lambda v: isinstance(v, QuantizedWeight)))
    leaves_bitwise_equal(kernel_layout.restore_checkpoint_layout(converted), leaves_before)

    enable_kernels(model, platform="cpu", interpret=True)
    try:
        export_compressed_tensors(model, str(tmp_path / "after"))
        before = SafetensorsFile(str(tmp_path / "before" / "model.safetensors"))
        after = SafetensorsFile(str(tmp_path / "after" / "model.safetensors"))
        assert sorted(before.keys()) == sorted(after.keys())
        for name in before.keys():  # noqa: SIM118 - a SafetensorsFile, not a dict
            assert before.dtype(name) == after.dtype(name), name
            np.testing.assert_array_equal(np.asarray(after[name]).view(np.uint8),
                                          np.asarray(before[name]).view(np.uint8),
                                          err_msg=name)

        reference = _tiny_quantized_model("nvfp4", compute_dtype="float32", layers=1)
        for target in (model, reference):
            add_lora(target, LoRAConfig(rank=4), jax.random.key(1))
            merge_lora(target, dtype=jnp.float32)
        leaves_bitwise_equal(kernel_layout.restore_checkpoint_layout(nnx.state(model)),
                      nnx.state(reference))
    finally:
        unregister_kernels("cpu")
    model = _tiny_quantized_model("nvfp4", compute_dtype="float32", layers=1)
    enable_kernels(model, platform="cpu", interpret=True)
    unregister_kernels("cpu")
    leaves_bitwise_equal(nnx.state(disable_kernels(model)), leaves_before)


@pytest.mark.parametrize("cache_dtype", [None, "int8", "float8_e4m3fn"])
def test_decode_steps_with_the_decode_attention_kernel(cache_dtype):
    """Prefill then decode steps of a tiny bf16 model (left-padded rows, one finished row) with
    the Pallas decode attention (interpret mode) registered: every step's logits equal the XLA
    path's within the module's model tolerance, and the kernel is in the decode program; with
    a bf16 cache and with an 8-bit one (codes + scales, read by both paths)."""
    from qerl_jax.models.config import preset
    from qerl_jax.models.kv_cache import init_kv_cache
    from qerl_jax.models.transformer import decode_step, init_model, prefill
    model = init_model(preset("tiny_qwen2", compute_dtype="bfloat16", param_dtype="bfloat16",
                              num_hidden_layers=1), seed=5)
    rng = np.random.default_rng(secrets.randbits(32))
    tokens = jnp.asarray(rng.integers(0, 128, (3, 6)), jnp.int32)
    mask = jnp.asarray([[1] * 6, [0, 0, 1, 1, 1, 1], [1] * 6], jnp.bool_)
    active = jnp.asarray([True, True, False])

    def run():
        cache = init_kv_cache(model.config, 3, 40, cache_dtype)
        logits, cache = prefill(model, tokens, mask, cache)
        steps = [logits]
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        for _ in range(4):
            logits, cache = decode_step(model, token, cache, active=active)
            steps.append(logits)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return steps

    reference = run()
    try:
        assert enable_decode_attention("cpu", interpret=True)
        with_kernel = run()
        cache = init_kv_cache(model.config, 3, 40, cache_dtype)
        jaxpr = str(jax.make_jaxpr(lambda t, c: decode_step(model, t, c))(tokens[:, 0], cache))
        assert "decode_attention" in jaxpr
    finally:
        disable_decode_attention("cpu")
    for step, (got, want) in enumerate(zip(with_kernel, reference)):
        scale = float(np.abs(np.asarray(want[:2])).max())
        diff = np.abs(np.asarray(got[:2]) - np.asarray(want[:2]))  # the finished row is unused
        assert np.isfinite(np.asarray(got)).all()
        assert diff.max() <= 2.0 ** -4 * scale and diff.mean() <= 2.0 ** -8 * scale, (step,
                                                                                      diff.max())


@pytest.mark.parametrize("rank", [16, 12])
def test_decode_attention_computes_the_o_projection_lora_x_a(rank):
    """With an o-projection adapter, the decode attention's combine kernel returns each head's
    share of x @ A (rank 16; rank 12 is not a Triton tile: XLA makes the shares) and the layer
    uses their sum: every decode step's logits equal, within 2^-6 of their scale, those of the
    same kernel registered without it (the model's own x @ A), which the test above checks
    against the XLA attention; the combine kernel with the product is in the decode program."""
    from qerl_jax.models import attention_dispatch
    from qerl_jax.quant.kernel_options import KernelOptions
    from pallas_kernels.decode_attention import DecodeAttentionConfig
    from qerl_jax.lora import LoRAConfig, add_lora
    from qerl_jax.models.config import preset
    from qerl_jax.models.kv_cache import init_kv_cache
    from qerl_jax.models.transformer import decode_step, init_model, prefill
    model = init_model(preset("tiny_qwen2", compute_dtype="bfloat16", param_dtype="bfloat16",
                              num_hidden_layers=2), seed=7)
    add_lora(model, LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=("o_proj",)),
             jax.random.key(3))
    rng = np.random.default_rng(secrets.randbits(32))
    for layer in model.layers:  # B = 0 at init: make the adapters count
        o_proj = layer.self_attn.o_proj
        o_proj.lora_b.set_value(jnp.asarray(
            0.5 * rng.standard_normal(o_proj.lora_b.get_value().shape), jnp.float32))
    tokens = jnp.asarray(rng.integers(0, 128, (3, 6)), jnp.int32)
    mask = jnp.asarray([[1] * 6, [0, 0, 1, 1, 1, 1], [1] * 6], jnp.bool_)

    def run():
        cache = init_kv_cache(model.config, 3, 40)
        logits, cache = prefill(model, tokens, mask, cache)
        steps = []
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        for _ in range(3):
            logits, cache = decode_step(model, token, cache)
            steps.append(logits)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return steps

    options = KernelOptions(decode_attention_tiling=DecodeAttentionConfig(block_s=16, splits=3))
    try:
        assert enable_decode_attention("cpu", options, interpret=True)
        kernel = attention_dispatch._KERNELS["cpu"]
        attention_dispatch._KERNELS["cpu"] = dataclasses.replace(kernel, lora_x_a=False)
        own = run()
        attention_dispatch._KERNELS["cpu"] = kernel
        shared = run()
        cache = init_kv_cache(model.config, 3, 40)
        jaxpr = str(jax.make_jaxpr(lambda t, c: decode_step(model, t, c))(tokens[:, 0], cache))
        assert ("decode_attention_combine_lora" in jaxpr) == (rank == 16)
    finally:
        disable_decode_attention("cpu")
    for step, (got, want) in enumerate(zip(shared, own)):
        scale = float(np.abs(np.asarray(want)).max())
        assert np.isfinite(np.asarray(got)).all()
        assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 2.0 ** -6 * scale, step


def _while_body_concatenates(jaxpr) -> list[tuple[int, ...]]:
    """Output shapes of the concatenate equations inside any while loop body of `jaxpr`."""
    return [shapes[-1] for shapes in _while_body_equations(jaxpr, "concatenate")]


def _while_body_equations(jaxpr, primitive: str) -> list[tuple[tuple[int, ...], ...]]:
    """(operand shapes..., output shape) of the `primitive` equations inside any while loop
    body of `jaxpr`."""
    shapes = []

    def visit(inner, in_loop):
        for eqn in inner.eqns:
            if eqn.primitive.name == primitive and in_loop:
                shapes.append((*(tuple(getattr(v.aval, "shape", ())) for v in eqn.invars),
                               tuple(eqn.outvars[0].aval.shape)))
            for name, param in eqn.params.items():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        visit(sub, in_loop or (eqn.primitive.name == "while"
                                               and name == "body_jaxpr"))

    visit(jaxpr.jaxpr, False)
    return shapes


def test_sampler_stacks_grouped_adapters_outside_the_decode_loop(interpret_kernels, monkeypatch):
    """The sampler stacks each layer's [A_q | A_k | A_v] and [A_gate | A_up], and the fused
    SwiGLU launch's pair B, once, before its while_loop (decode_fusion.stack_grouped_adapters): the loop
    body has no concatenate of adapter shapes, and the sampled tokens and log-probs equal, bit
    for bit, those of the sampler that stacks them inside every launch."""
    from qerl_jax import sampling
    from qerl_jax.lora import LoRAConfig, add_lora
    from qerl_jax.models import decode_fusion
    from qerl_jax.models.decode_fusion import stack_grouped_adapters
    from qerl_jax.models.layers import apply_linears
    model = _tiny_quantized_model("nvfp4", layers=1)
    add_lora(model, LoRAConfig(rank=4), jax.random.key(0))
    for _, layer in nnx.iter_graph(model):
        if getattr(layer, "lora_b", None) is not None:  # B = 0 would hide a wrong A
            b = layer.lora_b.get_value()
            layer.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(b.shape[1]), b.shape))
    enable_kernels(model, platform="cpu", interpret=True)
    hidden = model.config.hidden_size
    prompts = jnp.asarray(np.random.default_rng(7).integers(0, 128, (2, 5)), jnp.int32)
    mask = jnp.asarray([[1] * 5, [0, 0, 1, 1, 1]], jnp.bool_)
    config = sampling.SamplingConfig(max_new_tokens=3, num_generations=2, prompt_bucket=8)
    key = jax.random.key(11)
    graphdef, state = nnx.split(model)

    def program_jaxpr():
        return jax.make_jaxpr(
            lambda s: sampling._generate_program(graphdef, (s,), prompts, mask, key,
                                                 config=config, cache_length=11))(state)

    inner = model.config.intermediate_size
    pair_b = (32, 2 * inner)  # [r' gate + r' up, 2 N_pad] (rank 4 padded to 16; N_pad = inner)
    stacked = sampling.generate(model, prompts, mask, key, config)
    in_loop = _while_body_concatenates(program_jaxpr())
    assert not [s for s in in_loop if s in ((hidden, 12), (hidden, 8), pair_b)], in_loop
    assert (2,) not in in_loop  # the pair's two tensor scales reach the kernel unstacked

    monkeypatch.setattr(decode_fusion, "stack_grouped_adapters", lambda model: 0)
    sampling._generate_program.clear_cache()  # retrace with the patched function
    in_loop = _while_body_concatenates(program_jaxpr())
    assert [s for s in in_loop if s in ((hidden, 12), (hidden, 8))]  # the check can see them
    assert pair_b in in_loop
    restacked = sampling.generate(model, prompts, mask, key, config)
    np.testing.assert_array_equal(np.asarray(stacked.tokens), np.asarray(restacked.tokens))
    np.testing.assert_array_equal(np.asarray(stacked.logprobs), np.asarray(restacked.logprobs))
    merged = nnx.merge(graphdef, state)
    assert stack_grouped_adapters(merged) == 2  # attention and MLP
    assert merged.layers[0].mlp.pair_lora_b.shape == pair_b
    attention = merged.layers[0].self_attn
    x = jnp.ones((2, hidden), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"stacked_lora_a \(64, 8\)"):
        apply_linears(x, (attention.q_proj, attention.k_proj, attention.v_proj),
                      attention.grouped_lora_a[:, :8])


def test_decode_loop_takes_the_down_lora_product_from_the_swiglu_launch(interpret_kernels):
    """With LoRA on the down projection, the sampler's decode loop runs no x @ A_down dot of
    its own: the fused SwiGLU launch returns it (linear_swiglu's next_lora_a). With
    the launch asked for no product (the model's own dot) the dot is back, and the tokens are
    the same (the two products differ only in the order of their float32 sums)."""
    from qerl_jax import sampling
    from qerl_jax.models import layers
    from qerl_jax.lora import LoRAConfig, add_lora
    model = _tiny_quantized_model("nvfp4", layers=1)
    add_lora(model, LoRAConfig(rank=4), jax.random.key(0))
    inner = model.config.intermediate_size
    prompts = jnp.asarray(np.random.default_rng(3).integers(0, 128, (2, 5)), jnp.int32)
    mask = jnp.ones((2, 5), jnp.bool_)
    for _, layer in nnx.iter_graph(model):
        if getattr(layer, "lora_b", None) is not None:  # B = 0 would hide a wrong product
            b = layer.lora_b.get_value()
            layer.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(b.shape[1]), b.shape))
    config = sampling.SamplingConfig(max_new_tokens=3, num_generations=1, prompt_bucket=8,
                                     greedy=True)
    enable_kernels(model, platform="cpu", interpret=True)
    key = jax.random.key(5)
    graphdef, state = nnx.split(model)

    def down_dots():
        sampling._generate_program.clear_cache()
        jaxpr = jax.make_jaxpr(
            lambda s: sampling._generate_program(graphdef, (s,), prompts, mask, key,
                                                 config=config, cache_length=11))(state)
        return [eq for eq in _while_body_equations(jaxpr, "dot_general")
                if eq[1] == (inner, 4)]

    assert down_dots() == []
    fused = sampling.generate(model, prompts, mask, key, config)
    fused_swiglu = layers.linear_swiglu

    def without_next_product(*args, next_lora_a=None, **kwargs):
        y = fused_swiglu(*args, **kwargs)
        return y if next_lora_a is None else (y, None)

    layers.linear_swiglu = without_next_product
    try:
        assert down_dots()  # the check can see the dot
        sampling._generate_program.clear_cache()
        separate = sampling.generate(model, prompts, mask, key, config)
    finally:
        layers.linear_swiglu = fused_swiglu
        sampling._generate_program.clear_cache()
    np.testing.assert_array_equal(np.asarray(fused.tokens), np.asarray(separate.tokens))


@pytest.mark.parametrize("format_name", ["nvfp4", "nf4"])
def test_donating_repack_gives_the_same_layout_and_consumes_only_unpadded_weights(format_name):
    """to_kernel_layout(donate=True) (what enable_kernels(donate=True) and the trainer use)
    gives the kernel layout of the default call, bit for bit; it consumes the checkpoint-layout
    weight where no padding is needed ([256, 512]: its buffers become the kernel layout's) and
    leaves a padded one ([96, 192]) valid. enable_kernels without donate keeps earlier
    references valid; with donate=True on a Module the model runs as before."""
    rng = np.random.default_rng(11)
    for shape, padded in (((256, 512), False), ((96, 192), True)):
        dense = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
        fmt = get_format(format_name)
        expected = kernel_layout.to_kernel_layout(fmt.quantize(dense, name="w"))
        weight = fmt.quantize(dense, name="w")
        donated = kernel_layout.to_kernel_layout(weight, donate=True)
        leaves_bitwise_equal(donated, expected)
        assert weight.codes.is_deleted() is not padded, shape
    model = _tiny_quantized_model("nvfp4", compute_dtype="float32", layers=1)
    tokens = jnp.arange(12).reshape(2, 6) % 50
    before = np.asarray(model(tokens))
    try:
        enable_kernels(model, platform="cpu", interpret=True, donate=True)
        np.testing.assert_allclose(np.asarray(model(tokens)), before, rtol=1e-5, atol=1e-5)
    finally:
        unregister_kernels("cpu")
