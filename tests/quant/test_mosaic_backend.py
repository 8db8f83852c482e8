"""The Mosaic GPU backend (qerl_jax/quant/backends/mosaic.py) on the CPU: which weights get
permuted buffers and LoRA operands; the SwiGLU and grouped q|k|v launches with a jnp stand-in
for the kernel against the interpreted Triton launches; the L2 prefetch chain; the option and
LoRA-rank refusals. The kernel itself: tests/pallas_kernels/test_mgpu_nvfp4.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mgpu_nvfp4 as mg
from pallas_kernels import mgpu_nvfp4_layout as layout
from pallas_kernels import mgpu_nvfp4_tuning as tuning
from qerl_jax.quant.backends import kernel_layout as kl
from qerl_jax.quant.backends import mosaic
from qerl_jax.quant.backends.triton import TritonDecodeBackend
from qerl_jax.quant.kernel_options import KernelOptions
from qerl_jax.quant.kernel_registry import unregister_kernels
from qerl_jax.quant.nvfp4 import nvfp4_quantize
from tests.pallas_kernels import kernel_checks as kc

# The device the launches below are sized for (the model shapes' expected split counts are
# this one's): no GPU here to read them from.
FACTS = tuning.DeviceFacts(sm_count=132, smem_per_block=227 * 1024)
CONFIG = mg.TuningConfig(device=FACTS)


def cfg(**fields) -> mg.TuningConfig:
    return mg.TuningConfig(device=FACTS, **fields)


@pytest.fixture
def device_facts(monkeypatch):
    """The backend's launches (qerl_jax.quant.backends.mosaic) read the default device's facts:
    give them FACTS; the jitted launches traced with stand-ins are dropped afterwards."""
    monkeypatch.setattr(tuning, "device_facts", lambda device=None: FACTS)
    yield
    jax.clear_caches()

def test_dispatch_attaches_the_lora_operand_once(monkeypatch):
    """MosaicWeight.with_lora_operand (the sampler's per-rollout preparation): with a permuted buffer
    present, the weight carries lora_operand(B) as a pytree child (it survives
    flatten/unflatten); otherwise the weight is returned as it is."""
    n, k, rank = 192, 512, 16
    w = jax.random.normal(jax.random.key(4), (n, k), jnp.float32)
    weight = kl.to_kernel_layout(nvfp4_quantize(w), tile_k=256)
    b = jax.random.normal(jax.random.key(5), (rank, n), jnp.float32)
    assert weight.with_lora_operand(b, 0.5) is weight  # no Mosaic copy
    weight = mosaic.MosaicWeight.from_kernel_layout(
        weight, mosaic_tiles=layout.permute_packed(weight.packed()))
    prepared = weight.with_lora_operand(b, 0.5)
    expected = layout.lora_operand(b, weight.packed().tensor_scale, 0.5,
                               n_pad=weight.packed().codes.shape[0])
    assert jnp.array_equal(prepared.mosaic_lora_operand, expected)
    assert prepared.mosaic_tiles is weight.mosaic_tiles
    rebuilt = jax.tree.map(lambda leaf: leaf, prepared)
    assert jnp.array_equal(rebuilt.mosaic_lora_operand, expected)
    assert mosaic._prepared_lora_operand(prepared, jnp.zeros((8, rank))) is not None
    assert mosaic._prepared_lora_operand(prepared, jnp.zeros((8, 32))) is None
    assert weight.with_lora_operand(jnp.zeros((24, n)), 0.5) is weight  # rank


def test_mosaic_swiglu_dispatch_matches_the_triton_launch(monkeypatch, device_facts):
    """The Mosaic GPU SwiGLU launch (a gate/up pair's permuted buffer, the pair LoRA
    operand, de-interleaving, per-half tensor scales, bf16 roundings, next-layer LoRA product)
    with the kernel replaced by a jnp reference, against the Triton fused SwiGLU launch
    (interpreted) on the same pair: equal within bf16 rounding of the outputs (2^-7 of the
    largest |output|; the two sum in different orders). The prepared operand
    (MosaicWeight.with_pair_lora_operand, as the sampler makes it) gives the same numbers."""
    n, k, rank, m = 96, 512, 16, 5
    keys = jax.random.split(jax.random.key(6), 8)
    gate, up = (kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(keys[i], (n, k))),
                                    tile_k=256) for i in (0, 1))
    views = kl.pair_gate_up(gate, up)
    tiles = layout.permute_packed(views[0].whole_pair())
    views = tuple(mosaic.MosaicWeight.from_kernel_layout(v, mosaic_tiles=tiles) for v in views)
    x = jax.random.normal(keys[2], (m, k)).astype(jnp.bfloat16)
    a = jax.random.normal(keys[3], (k, 2 * rank)) * 0.05
    down = (x.astype(jnp.float32) @ a).astype(jnp.bfloat16)
    lora_bs = (jax.random.normal(keys[4], (rank, n)), jax.random.normal(keys[5], (rank, n)))
    next_a = jax.random.normal(keys[6], (n, 8)) * 0.1
    scales = (0.5, 0.5)

    def launch(weights, interpret):
        backend = (TritonDecodeBackend("nvfp4", KernelOptions(), interpret=True) if interpret
                   else mosaic.MosaicBackend(KernelOptions()))
        return backend.apply_swiglu(x, weights, down, lora_bs, scales, None, next_a,
                                    compute_dtype=jnp.bfloat16)

    expected, expected_next = launch(views, True)  # Triton, interpreted
    monkeypatch.setattr(mg, "available", lambda: None)
    monkeypatch.setattr(mg, "matmul_unscaled", kc.mosaic_reference_unscaled)
    backend = mosaic.MosaicBackend(KernelOptions())
    assert all(backend.refusal(v, jnp.bfloat16) is None for v in views)
    assert backend.swiglu_refusal(m, views, (rank, rank), scales) is None
    got, got_next = launch(views, False)
    assert got.shape == expected.shape == (m, n) and got.dtype == jnp.bfloat16
    top = float(jnp.abs(expected.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               rtol=0, atol=2.0 ** -7 * top)
    top_next = float(jnp.abs(expected_next).max())
    np.testing.assert_allclose(np.asarray(got_next), np.asarray(expected_next), rtol=0,
                               atol=2.0 ** -7 * top_next)
    prepared = views[0].with_pair_lora_operand(views[1], *lora_bs, scales[0])
    assert prepared is not views[0] and prepared.mosaic_lora_operand.shape == (2 * 128, 32)
    again, again_next = launch((prepared, views[1]), False)
    assert jnp.array_equal(again, got) and jnp.array_equal(again_next, got_next)
    # the single-weight path leaves pair views alone; ranks the pair operand cannot take
    assert views[0].with_lora_operand(lora_bs[0], 0.5) is views[0]
    assert "LoRA ranks" in backend.swiglu_refusal(m, views, (24, 24), scales)
    assert "LoRA ranks" in backend.swiglu_refusal(m, views, (16, 32), scales)
    assert "different LoRA scales" in backend.swiglu_refusal(m, views, (rank, rank), (0.5, 1.0))
    assert "no copy in the Mosaic permuted layout" in backend.refusal(gate, jnp.bfloat16)


def test_swiglu_epilogue_up_to_its_row_limit(monkeypatch, device_facts):
    """KernelOptions.mosaic_swiglu_epilogue_max_m: a gate|up launch of at most that many rows
    asks mgpu_nvfp4_swiglu for the SwiGLU in the kernel's epilogue (fused), one of more rows
    for the XLA one; the default puts M = 8 and 16 in the kernel and 17-64 in XLA (per launch
    on an H100, benchmarks/RESULTS.md)."""
    n, k = 96, 512
    gate, up = (kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(jax.random.key(i), (n, k))),
                                    tile_k=256) for i in (0, 1))
    views = kl.pair_gate_up(gate, up)
    tiles = layout.permute_packed(views[0].whole_pair())
    views = tuple(mosaic.MosaicWeight.from_kernel_layout(v, mosaic_tiles=tiles) for v in views)
    asked = []
    monkeypatch.setattr(mg, "available", lambda: None)
    monkeypatch.setattr(mg, "mgpu_nvfp4_swiglu",
                        lambda x, *args, config, **kwargs: asked.append(
                            x.shape[0] <= config.swiglu_epilogue_max_m) or x)
    for options, m, fused in ((KernelOptions(), 8, True), (KernelOptions(), 16, True),
                              (KernelOptions(), 17, False), (KernelOptions(), 64, False),
                              (KernelOptions(mosaic_swiglu_epilogue_max_m=64), 64, True),
                              (KernelOptions(mosaic_swiglu_epilogue_max_m=0), 1, False)):
        backend = mosaic.MosaicBackend(options)
        backend.apply_swiglu(jnp.ones((m, k), jnp.bfloat16), views, None, (None, None),
                             (1.0, 1.0), None, None, compute_dtype=jnp.bfloat16)
        assert asked[-1] is fused, (options.mosaic_swiglu_epilogue_max_m, m)
    assert len(asked) == 6


def test_permuted_buffers_are_the_only_copy(caplog):
    """decode_fusion.add_decode_layouts (enable_kernels on a Hopper GPU): o/down get their
    permuted buffers, the gate/up pair one shared buffer (the whole pair's permute_packed), q
    one buffer of q|k|v stacked by rows (the grouped launch's) and k, v none. The weights given
    permuted buffers, and k, v of a group, drop their kernel-layout arrays and
    read their tiles from the buffer (the same array: q/k/v the group's at lines 0, q's rows,
    q's + k's; the pair views their pair's). Their kernel operands and checkpoint view are bit
    for bit the ones before, so the model's logits are identical at decode M (fused kernel,
    interpreted) and prefill M (W from the permuted-dequantize kernel, then a dot: no
    unpermute, no kernel-layout dequantize in its program); a pytree round trip keeps the form;
    the kernel-layout arrays are freed (nothing keeps them alive). A small-M launch of such weights
    on a Triton kernel (here: interpreted) logs that it unpermutes them at every call. The
    layouts are MosaicBackend.repack's (what enable_kernels passes on a Hopper GPU)."""
    import gc
    import weakref

    from flax import nnx

    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    from qerl_jax.model_quant.kernel_setup import enable_kernels
    from qerl_jax.model_quant.quantize import quantize_model
    from qerl_jax.models import decode_fusion
    from qerl_jax.quant.backends import mosaic, triton
    from qerl_jax.quant.kernel_options import KernelOptions
    # one decoder layer: every check below is per layer (interpret mode runs each launch)
    model = init_model(tiny_qwen2(param_dtype="bfloat16", compute_dtype="bfloat16",
                                  num_hidden_layers=1), seed=0)
    quantize_model(model, "nvfp4")
    enable_kernels(model, platform="cpu", interpret=True, tile_k=256)
    try:
        def weights():
            return {path: node.get_value() for path, node in nnx.iter_graph(model)
                    if isinstance(node, nnx.Variable)
                    and isinstance(node.get_value(), kl.KernelLayoutWeight)}

        tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, model.config.vocab_size)

        def forward(model, tokens):  # split/merge: nnx.jit would write copies back (unshared)
            graphdef, state = nnx.split(model)
            return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)

        def host(arrays):
            return tuple(np.array(a, copy=True) for a in arrays)

        before = {path: (host(w.kernel_arrays()), *host((w.codes, w.block_scales,
                                                          w.tensor_scale)))
                  for path, w in weights().items()}
        stored = [weakref.ref(a) for w in weights().values() for a in w.kernel_arrays()]
        logits = [forward(model, tokens[:1, :8]), forward(model, tokens)]  # M 8 and M 80
        expected_buffers = {}
        for layer in model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv = [p.weight.get_value() for p in (attention.q_proj, attention.k_proj,
                                                    attention.v_proj)]
            expected_buffers[id(attention)] = np.asarray(jnp.concatenate(
                [layout.permute_packed(w.packed()) for w in qkv]))
            for proj in (attention.o_proj, mlp.down_proj):
                expected_buffers[id(proj)] = np.asarray(layout.permute_packed(
                    proj.weight.get_value().packed()))
            expected_buffers[id(mlp)] = np.asarray(layout.permute_packed(
                mlp.gate_proj.weight.get_value().whole_pair()))
        del qkv  # nothing but the model may keep the kernel-layout arrays alive
        layer_count = len(model.layers)
        repack = mosaic.MosaicBackend(KernelOptions()).repack
        assert decode_fusion.add_decode_layouts(model, repack) == (
            4 * layer_count, layer_count, layer_count)
        gc.collect()
        assert all(ref() is None for ref in stored)
        after = weights()
        assert all(isinstance(w, mosaic.MosaicWeight) and w.single_copy
                   and w.kernel_codes is None and w.kernel_scales is None
                   for w in after.values())
        for path, w in after.items():
            (codes, scales), *checkpoint = before[path]
            got_codes, got_scales = w.kernel_arrays()
            assert np.array_equal(got_codes, codes) and np.array_equal(got_scales, scales)
            for got, expected in zip((w.codes, w.block_scales, w.tensor_scale), checkpoint):
                assert np.array_equal(np.asarray(got), expected), path
            assert w.packed().codes.shape == codes.shape
        for layer in model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            q, k, v = (p.weight.get_value() for p in (attention.q_proj, attention.k_proj,
                                                         attention.v_proj))
            assert q.kernel_source is k.kernel_source is v.kernel_source is q.mosaic_tiles
            assert k.mosaic_tiles is None and v.mosaic_tiles is None
            assert (q.kernel_source_line, k.kernel_source_line, v.kernel_source_line) == (
                0, mosaic.rows(q), mosaic.rows(q) + mosaic.rows(k))
            assert np.array_equal(q.mosaic_tiles, expected_buffers[id(attention)])
            for proj in (attention.o_proj, mlp.down_proj):
                weight = proj.weight.get_value()
                assert weight.kernel_source is weight.mosaic_tiles
                assert np.array_equal(weight.mosaic_tiles, expected_buffers[id(proj)])
            gate, up = mlp.gate_proj.weight.get_value(), mlp.up_proj.weight.get_value()
            assert gate.kernel_source is up.kernel_source is gate.mosaic_tiles is up.mosaic_tiles
            assert np.array_equal(gate.mosaic_tiles, expected_buffers[id(mlp)])
            backend = triton.TritonDecodeBackend("nvfp4", KernelOptions(), interpret=True)
            assert backend.swiglu_refusal(8, (gate, up), None, None) is None
        leaves, tree = jax.tree.flatten(q)
        rebuilt = jax.tree.unflatten(tree, leaves)
        assert (rebuilt.single_copy, rebuilt.kernel_source_line) == (True, q.kernel_source_line)
        triton._LOGGED.clear()
        with caplog.at_level("WARNING", logger=triton.__name__):
            again = [forward(model, tokens[:1, :8]), forward(model, tokens)]
        for expected, got in zip(logits, again):
            assert jnp.array_equal(got, expected)
        # prefill M: W straight from the permuted buffers (no unpermute)
        graphdef, state = nnx.split(model)
        jaxpr = str(jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))
        assert "nvfp4_permuted_dequantize" in jaxpr and "nvfp4_dequantize" not in jaxpr
        warned = [r.getMessage() for r in caplog.records if "unpermutes them" in r.getMessage()]
        assert any("gate|up SwiGLU launch" in m for m in warned), warned
        assert any("grouped launch" in m for m in warned), warned
        assert any("single-weight launch" in m for m in warned), warned
    finally:
        unregister_kernels("cpu")


def test_mosaic_group_dispatch_matches_the_triton_launch(monkeypatch):
    """The Mosaic GPU grouped q|k|v launch (one matmul over the stacked buffer, the
    block-diagonal LoRA operand, each member's own tensor scale, bf16 rounding) with the kernel
    replaced by a jnp reference, against the Triton grouped launch (interpreted) on the same
    weights: equal within bf16 rounding of each output (2^-7 of its largest |value|). The
    prepared operand (MosaicWeight.with_group_lora_operand) gives the same numbers; the
    single-weight launch refuses q's grouped buffer."""
    k, rank, m = 512, 16, 5
    ns = (192, 64, 64)
    keys = jax.random.split(jax.random.key(9), 8)
    weights = tuple(kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(keys[i], (n, k))
                                                       * (i + 1)), tile_k=256)
                    for i, n in enumerate(ns))
    x = jax.random.normal(keys[3], (m, k)).astype(jnp.bfloat16)
    a = jax.random.normal(keys[4], (k, 3 * rank)) * 0.05
    down = (x.astype(jnp.float32) @ a).astype(jnp.bfloat16)
    lora_bs = tuple(jax.random.normal(keys[5 + i], (rank, n)) for i, n in enumerate(ns))
    scales = (0.5, 0.5, 0.5)

    def launch(ws, interpret):
        backend = (TritonDecodeBackend("nvfp4", KernelOptions(), interpret=True) if interpret
                   else mosaic.MosaicBackend(KernelOptions()))
        return backend.apply_grouped(x, ws, down, lora_bs, scales, compute_dtype=jnp.bfloat16)

    expected = launch(weights, True)  # Triton, interpreted
    monkeypatch.setattr(mg, "available", lambda: None)
    monkeypatch.setattr(mg, "matmul_unscaled", kc.mosaic_reference_unscaled)
    tiles = layout.group_permuted([layout.permute_packed(w.packed()) for w in weights], [k] * 3)
    grouped = (mosaic.MosaicWeight.from_kernel_layout(weights[0], mosaic_tiles=tiles),
               *(mosaic.MosaicWeight.from_kernel_layout(w) for w in weights[1:]))
    backend, ranks = mosaic.MosaicBackend(KernelOptions()), (rank,) * 3
    assert all(backend.refusal(w, jnp.bfloat16) is None for w in grouped)
    assert backend.group_refusal(grouped, ranks) is None
    assert backend.group_refusal(weights, ranks) == "no permuted group buffer"
    assert "LoRA ranks" in backend.group_refusal(grouped, (24,) * 3)
    got = launch(grouped, False)
    for g, e, n in zip(got, expected, ns):
        assert g.shape == e.shape == (m, n)
        top = float(jnp.abs(e).max())
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=0, atol=2.0 ** -7 * top)
    prepared = grouped[0].with_group_lora_operand(grouped, lora_bs, scales)
    assert prepared is not grouped[0] and prepared.mosaic_lora_operand.shape == (512, 48)  # N_pad: 128s
    again = launch((prepared, *grouped[1:]), False)
    assert all(jnp.array_equal(a_, g) for a_, g in zip(again, got))
    # q's grouped buffer is not its own: the single-weight path and its operand refuse it
    assert "grouped" in backend.launch_refusal(grouped[0], None)
    assert grouped[0].with_lora_operand(lora_bs[0], 0.5) is grouped[0]
    # ranks whose sum the kernel cannot take; a stale group (k given its own buffer)
    assert grouped[0].with_group_lora_operand(grouped, [jnp.zeros((24, n)) for n in ns],
                                              scales) is grouped[0]
    own = mosaic.MosaicWeight.from_kernel_layout(
        weights[1], mosaic_tiles=layout.permute_packed(weights[1].packed()))
    assert backend.group_refusal((grouped[0], own, weights[2]),
                                 ranks) == "no permuted group buffer"


def test_link_decode_prefetch_chains_the_decode_launches(device_facts):
    """decode_fusion.link_decode_prefetch: in decode order each Mosaic launch's weight
    holds the next launch's permuted buffer (the same array, no copy) and its K: q|k|v -> o ->
    gate|up -> down -> the next layer's q|k|v; the last down none; and the LoRA A that the
    x @ A before that launch reads (o's A, the MLP's and next attention's stacked A, down's
    A: the same arrays), in the plan (KernelOptions.mosaic_prefetch_tiles K tiles; none with 0).
    The pytree round trip keeps the link."""
    from qerl_jax.lora import LoRAConfig, add_lora, cast_adapters_for_compute
    from qerl_jax.model_quant.kernel_setup import enable_kernels
    from qerl_jax.model_quant.quantize import quantize_model
    from qerl_jax.models import decode_fusion
    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    model = init_model(tiny_qwen2(param_dtype="bfloat16", compute_dtype="bfloat16"), seed=0)
    quantize_model(model, "nvfp4")
    add_lora(model, LoRAConfig(rank=16), jax.random.key(1))
    enable_kernels(model, platform="cpu", interpret=True, tile_k=256)
    try:
        decode_fusion.add_decode_layouts(model, mosaic.MosaicBackend(KernelOptions()).repack)
        cast_adapters_for_compute(model)
        decode_fusion.stack_grouped_adapters(model)
        layers = list(model.layers)
        assert decode_fusion.link_decode_prefetch(model) == 4 * len(layers) - 1
        chain = []
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            chain += [(attention.q_proj, attention.grouped_lora_a),
                      (attention.o_proj, attention.o_proj.lora_a.get_value()),
                      (mlp.gate_proj, mlp.grouped_lora_a),
                      (mlp.down_proj, mlp.down_proj.lora_a.get_value())]
        for (proj, _), following in zip(chain, chain[1:] + [None]):
            weight = proj.weight.get_value()
            if following is None:
                assert weight.mosaic_prefetch is None
                assert mosaic.prefetch_plan(weight, 1, 8) is None
                continue
            target, lora_a = following[0].weight.get_value(), following[1]
            assert weight.mosaic_prefetch is target.mosaic_tiles
            assert weight.mosaic_prefetch_lora_a is lora_a
            assert weight.mosaic_prefetch_k == target.shape[1]
            plan = mosaic.prefetch_plan(weight, 1, 8)
            assert plan.buffer is target.mosaic_tiles and plan.ahead == 1
            assert plan.extra is lora_a and tuning.extra_prefetchable(lora_a)
            assert mosaic.prefetch_plan(weight, 0, 8) is None
            # the plan's grid is the following launch's, under each schedule, with that
            # launch's LoRA operand (the width of the x @ A it reads)
            row_tiles = target.mosaic_tiles.shape[0] // (
                layout.TILE_LINES * -(-target.shape[1] // layout.TILE_K))
            for schedule in ("split_k", "warp_specialized", "auto"):
                expected = tuning.launch_splits(
                    row_tiles, -(-target.shape[1] // layout.TILE_K), m=64,
                    rank=lora_a.shape[1], config=cfg(schedule=schedule))
                got = mosaic.prefetch_plan(weight, 1, 64, schedule)
                assert (got.row_tiles, got.splits) == (row_tiles, expected), schedule
            leaves, treedef = jax.tree_util.tree_flatten(weight)
            again = jax.tree_util.tree_unflatten(treedef, leaves)
            assert again.mosaic_prefetch_k == weight.mosaic_prefetch_k
        up = layers[0].mlp.up_proj.weight.get_value()
        assert up.mosaic_prefetch is None  # the pair's launch is the gate view's
    finally:
        unregister_kernels("cpu")


@pytest.mark.parametrize("rank,ok", [(16, True), (12, False)])
def test_mosaic_option_and_lora_ranks(caplog, monkeypatch, rank, ok):
    """KernelOptions.mosaic_nvfp4 ('auto', 'on' or 'off'; another value an error naming the
    field), and a LoRA rank the Mosaic GPU kernel does not take (enable_kernels' lora_rank, or
    an adapter the model has) keeps the Triton kernels for the whole model, with the reason
    logged (info for 'auto', a warning for 'on')."""
    import logging
    from qerl_jax.lora import LoRAConfig, add_lora
    from qerl_jax.model_quant.kernel_setup import _lora_ranks
    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    from qerl_jax.quant import kernel_registry as kernels
    with pytest.raises(ValueError, match="mosaic_nvfp4='yes'"):
        KernelOptions(mosaic_nvfp4="yes")
    assert kernels.mosaic_refusal(KernelOptions(mosaic_nvfp4="off"), interpret=False) == (
        "mosaic_nvfp4 is off")
    assert kernels.mosaic_refusal(KernelOptions(), interpret=True) == "interpret mode"
    assert mosaic.rank_refusal({16, 32, 64}) is None
    model = init_model(tiny_qwen2(), seed=0)
    assert (mosaic.rank_refusal(_lora_ranks(model, rank)) is None) == ok
    assert not _lora_ranks(model, None)  # no adapters yet
    add_lora(model, LoRAConfig(rank=rank, alpha=16.0), jax.random.key(0))
    refusal = mosaic.rank_refusal(_lora_ranks(model, None))
    assert (refusal is None) == ok
    if not ok:
        assert f"LoRA rank [{rank}]" in refusal
        with caplog.at_level(logging.INFO, logger=kernels.logger.name):
            # as on a Hopper GPU
            monkeypatch.setattr(mosaic.MosaicBackend, "unavailable", staticmethod(lambda: None))
            assert kernels.mosaic_refusal(KernelOptions(mosaic_nvfp4="on"), interpret=False,
                                          lora_ranks={rank}) == refusal
        assert "keep the kernel layout and the Triton kernels" in caplog.text
        assert any(r.levelno == logging.WARNING for r in caplog.records)




def test_dispatch_asks_mosaic_first_and_falls_through_to_triton(monkeypatch, device_facts, caplog):
    """The backends as register_kernels orders them on a Hopper GPU (Mosaic GPU, then Triton's
    decode and dequantize backends), here on the CPU with the kernel replaced by its jnp
    reference: a weight with its own permuted buffer runs on the Mosaic backend (its output
    within bf16 rounding of the interpreted Triton launch, 2^-7 of the largest |output|); a
    kernel-layout weight, a LoRA rank the kernel does not take and M > 64 fall through to the
    Triton backends, and the log names each refusal once."""
    import logging

    from qerl_jax.quant import dispatch
    from qerl_jax.quant.backends.triton import TritonDequantizeBackend
    from qerl_jax.quant.linear_op import LoRAProduct, linear

    monkeypatch.setattr(mg, "available", lambda: None)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    calls = []

    def stand_in(x, permuted, tensor_scale, *, n, k, l2_prefetch=None, config=None, **lora):
        calls.append((x.shape[0], n))
        return mg.mgpu_nvfp4_matmul_reference(x, permuted, tensor_scale, n=n, k=k, **lora)

    monkeypatch.setattr(mg, "mgpu_nvfp4_matmul", stand_in)
    n, k = 192, 512
    plain = kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(jax.random.key(2), (n, k))),
                                tile_k=256)
    own = mosaic.MosaicBackend().repack([plain])[0]
    assert isinstance(own, mosaic.MosaicWeight) and own.single_copy
    options = KernelOptions()
    backends = [mosaic.MosaicBackend(options), TritonDecodeBackend("nvfp4", options,
                                                                   interpret=True),
                TritonDequantizeBackend("nvfp4", interpret=True)]
    for backend in backends:
        dispatch.register_backend("nvfp4", "cpu", backend)
    x = jax.random.normal(jax.random.key(3), (8, k)).astype(jnp.bfloat16)
    try:
        with caplog.at_level(logging.INFO, logger=dispatch.logger.name):
            got = linear(x, own)
            assert calls == [(8, n)]
            expected = linear(x, plain)  # the Triton decode kernel, interpreted
            assert calls == [(8, n)]
            lora = LoRAProduct(a=jnp.zeros((k, 12)), b=jnp.zeros((12, n)), scale=1.0)
            linear(x, own, lora=lora)  # rank 12: the Triton kernel (on the unpermuted layout)
            linear(jnp.ones((65, k), jnp.bfloat16), own)  # the dequantize backend
        assert calls == [(8, n)]
        top = float(jnp.abs(expected.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(got, np.float32),
                                   np.asarray(expected, np.float32), rtol=0,
                                   atol=2.0 ** -7 * top)
        messages = [r.getMessage() for r in caplog.records if r.name == dispatch.logger.name]
        assert messages[0] == ("nvfp4 matmul on cpu at M=8: nvfp4_mosaic path (Mosaic GPU "
                               "4-bit kernel (Hopper))"), messages
        assert any("nvfp4_fused path" in m and "nvfp4_mosaic refused: the weight has no copy "
                   "in the Mosaic permuted layout" in m for m in messages), messages
        assert any("nvfp4_fused path" in m and "nvfp4_mosaic refused: LoRA rank 12" in m
                   for m in messages), messages
        assert any(m.startswith("nvfp4 matmul on cpu at M=65: nvfp4_dequantize_xla path")
                   for m in messages), messages
    finally:
        dispatch.unregister_backends("nvfp4", "cpu")
