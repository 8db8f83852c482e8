"""pallas_kernels.mgpu_nvfp4 on the CPU: its permuted layout (lossless, the same weights as the
checkpoint's float64 dequantization), its bit math (an integer emulation of the kernel's decode
gives those weights), the LoRA operands' scale folding (float64), the split-K counts, that the
Mosaic GPU kernel (split-K, uneven splits, grouped operand widths) and the SwiGLU path lower
for CUDA, and
the Mosaic GPU backend (qerl_jax/quant/backends/mosaic.py: which weights get buffers and
operands; the SwiGLU and grouped q|k|v launches with a jnp stand-in for the kernel against the
interpreted Triton launches). The
kernel's numbers are checked on a GPU by test_mgpu_nvfp4_gpu.py (Mosaic GPU has no interpret
mode for TMA copies)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mgpu_nvfp4 as mg
from pallas_kernels import nvfp4_matmul
from qerl_jax.quant.backends import kernel_layout as kl
from qerl_jax.quant.backends import mosaic
from qerl_jax.quant.backends.triton import TritonDecodeBackend
from qerl_jax.quant.kernel_options import KernelOptions
from qerl_jax.quant.kernels import unregister_kernels
from qerl_jax.quant.nvfp4 import nvfp4_quantize
from tests.pallas_kernels import kernel_checks as kc

@pytest.mark.parametrize("n,k", [(200, 608), (64, 256), (130, 512)])
def test_permuted_layout_is_lossless_and_dequantizes_to_the_checkpoint(n, k):
    q, packed = kc.nvfp4_packed(n, k)
    permuted = mg.permute_packed(packed)
    k_tiles = -(-k // 256)
    assert permuted.shape == (packed.codes.shape[0] // 64 * k_tiles * 72, 128)
    codes, scales = mg.unpermute_tiles(permuted)
    assert jnp.array_equal(mg.permute_tiles(codes, scales), permuted)
    # back to the kernel layout (a single-copy weight's operand for the other kernels)
    rows = packed.codes.shape[0]
    back = mg.kernel_layout_from_permuted(permuted, rows=rows, k=k)
    assert jnp.array_equal(back[0], packed.codes) and jnp.array_equal(back[1], packed.scales)
    stacked = jnp.concatenate([permuted, permuted])  # a group's buffer: the second member
    back = mg.kernel_layout_from_permuted(stacked, rows=rows, k=k, line=permuted.shape[0])
    assert jnp.array_equal(back[0], packed.codes) and jnp.array_equal(back[1], packed.scales)
    with pytest.raises(ValueError, match="lines"):
        mg.kernel_layout_from_permuted(permuted, rows=rows, k=k, line=72)
    with pytest.raises(ValueError, match="multiple of 64"):
        mg.kernel_layout_from_permuted(permuted, rows=rows - 32, k=k)
    got = np.asarray(mg.permuted_dequantize_reference(permuted, packed.tensor_scale, n=n, k=k), np.float64)
    expected = kc.nvfp4_float64_weights(q)
    np.testing.assert_allclose(got, expected, rtol=2e-7, atol=0)  # float32 division


def test_kernel_bit_math_gives_the_weights():
    """Integer emulation of _decode_tile (rotations, masks, bf16x2 pattern x 2^126 x scale) on
    every thread's words gives the weights of each tile (e2m1 x block scale, before the
    tensor scale)."""
    q, packed = kc.nvfp4_packed(128, 512, seed=3)
    permuted = np.asarray(mg.permute_packed(packed)).reshape(-1, 72 * 128)
    codes, scale_codes = (np.asarray(a) for a in mg.unpermute_tiles(jnp.asarray(permuted)))
    scale_values = np.asarray(nvfp4_matmul.scale_values_from_codes(jnp.asarray(scale_codes), 0)
                              .astype(jnp.float32), np.float64)
    expected = kc.E2M1[codes] * np.repeat(scale_values, 16, axis=-1)

    def rotl(w, r):
        return ((w << np.uint64(r)) | (w >> np.uint64((32 - r) % 32))) & np.uint64(0xFFFFFFFF)

    def pair_bits(w, k):
        if k < 3:
            return rotl(w, (0, 6, 12)[k]) & np.uint64(0x81C081C0)
        return (rotl(w, 2) & np.uint64(0x00400040)) | (rotl(w, 10) & np.uint64(0x81808180))

    def bf16(bits):
        return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)

    words = permuted[:, :8192].view(np.uint32).reshape(-1, 4, 128, 4)
    got = np.full(expected.shape, np.nan)
    for t in range(128):
        row0, lane_col = 16 * (t // 32) + (t % 32) // 4, t % 4
        for i in range(16):
            w = words[:, i // 4, t, i % 4].astype(np.uint64)
            for k, (c_half, h) in enumerate(mg.PAIR_SLOTS):
                bits = pair_bits(w, k)
                row, col = row0 + 8 * h, 16 * i + 8 * c_half + 2 * lane_col
                scale = scale_values[:, row, i]
                for half in (0, 1):
                    value = bf16((bits >> np.uint64(16 * half)) & np.uint64(0xFFFF))
                    got[:, row, col + half] = value * 2.0 ** 126 * scale
    np.testing.assert_array_equal(got, expected)


def test_lora_operand_folds_the_scales_into_b_transposed():
    """Split 0 adds lora_operand(B) @ down^T into the weight accumulator, which is rescaled by
    2^8 / tensor_scale: that must give lora_scale * down @ B (float64 reference; tolerance:
    the operand's bf16 rounding, 2^-8 relative per term) and zero rows past N."""
    rank, n, m = 32, 200, 5
    b = np.asarray(jax.random.normal(jax.random.key(1), (rank, n)), np.float64)
    down = np.asarray(jax.random.normal(jax.random.key(2), (m, rank)), np.float64)
    tensor_scale, lora_scale = 1234.5, 0.75
    bt = mg.lora_operand(jnp.asarray(b, jnp.float32), jnp.asarray([tensor_scale], jnp.float32),
                         lora_scale)
    assert bt.shape == (256, rank) and bt.dtype == jnp.bfloat16
    bt = np.asarray(bt.astype(jnp.float32), np.float64)
    assert not bt[n:].any()
    got = (bt[:n] @ down.T).T * 2.0 ** -mg.SCALED_EXPONENT / tensor_scale
    expected = lora_scale * down @ b
    bound = 2.0 ** -8 * lora_scale * np.abs(down) @ np.abs(b)
    assert np.all(np.abs(got - expected) <= bound)
    with pytest.raises(ValueError, match=r"lora_b \(24, 200\)"):
        mg.lora_operand(jnp.zeros((24, n)), jnp.ones((1,)))
    with pytest.raises(ValueError, match="n_pad=100"):
        mg.lora_operand(jnp.zeros((rank, n)), jnp.ones((1,)), n_pad=100)


@pytest.mark.parametrize("m,rank,splits,prepared", [(8, 0, None, False), (5, 32, 3, False),
                                                    (16, 16, 1, False), (8, 32, None, True)])
def test_kernel_lowers_for_cuda(m, rank, splits, prepared):
    n, k = 256, 1024
    _, packed = kc.nvfp4_packed(n, k)
    permuted = jax.ShapeDtypeStruct(mg.permute_packed(packed).shape, jnp.uint8)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    args = [x, permuted, packed.tensor_scale]
    if rank:
        args += [jax.ShapeDtypeStruct((m, rank), jnp.bfloat16),
                 jax.ShapeDtypeStruct((n, rank) if prepared else (rank, n), jnp.bfloat16)]

    def f(x, permuted, ts, *lora):
        kwargs = {}
        if lora and prepared:
            kwargs = dict(lora_x_a=lora[0], lora_bt=lora[1])
        elif lora:
            kwargs = dict(lora_x_a=lora[0], lora_b=lora[1], lora_scale=2.0)
        return mg.mgpu_nvfp4_matmul(x, permuted, ts, n=n, k=k, splits=splits, **kwargs)

    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert lowered.out_info.shape == (m, n)


def test_refusals_and_bad_shapes():
    q, packed = kc.nvfp4_packed(64, 256)
    assert mg.refusal(packed) is None
    import dataclasses
    nf4_packed = dataclasses.replace(packed, fmt="nf4")  # (only the fields are read)
    assert "format nf4" in mg.refusal(nf4_packed)
    with pytest.raises(ValueError, match="format nf4"):
        mg.permute_packed(nf4_packed)
    permuted = mg.permute_packed(packed)
    with pytest.raises(ValueError, match=r"x \(8, 128\)"):
        mg.mgpu_nvfp4_matmul(jnp.zeros((8, 128), jnp.bfloat16), permuted, packed.tensor_scale,
                             n=64, k=256)
    with pytest.raises(ValueError, match="splits=3 for 1 K tiles"):
        mg.mgpu_nvfp4_matmul(jnp.zeros((8, 256), jnp.bfloat16), permuted, packed.tensor_scale,
                             n=64, k=256, splits=3)
    with pytest.raises(ValueError, match="operand None"):
        mg.matmul_unscaled(jnp.zeros((8, 256), jnp.bfloat16), permuted, n=64, k=256,
                           lora_x_a=jnp.zeros((8, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"operand \(192, 32\)"):
        mg.mgpu_nvfp4_matmul(jnp.zeros((8, 256), jnp.bfloat16), permuted, packed.tensor_scale,
                             n=64, k=256, lora_x_a=jnp.zeros((8, 32), jnp.bfloat16),
                             lora_bt=jnp.zeros((192, 32), jnp.bfloat16))


def test_dispatch_attaches_the_lora_operand_once(monkeypatch):
    """mosaic.with_lora_operand (the sampler's per-rollout preparation): with a permuted buffer
    present, the weight carries lora_operand(B) as a pytree child (it survives
    flatten/unflatten); otherwise the weight is returned as it is."""
    n, k, rank = 192, 512, 16
    w = jax.random.normal(jax.random.key(4), (n, k), jnp.float32)
    weight = kl.to_kernel_layout(nvfp4_quantize(w), tile_k=256)
    b = jax.random.normal(jax.random.key(5), (rank, n), jnp.float32)
    assert mosaic.with_lora_operand(weight, b, 0.5) is weight  # no Mosaic copy
    weight = weight.replace(mosaic_tiles=mg.permute_packed(weight.packed()))
    prepared = mosaic.with_lora_operand(weight, b, 0.5)
    expected = mg.lora_operand(b, weight.packed().tensor_scale, 0.5,
                               n_pad=weight.packed().codes.shape[0])
    assert jnp.array_equal(prepared.mosaic_lora_operand, expected)
    assert prepared.mosaic_tiles is weight.mosaic_tiles
    rebuilt = jax.tree.map(lambda leaf: leaf, prepared)
    assert jnp.array_equal(rebuilt.mosaic_lora_operand, expected)
    assert mosaic._prepared_lora_operand(prepared, jnp.zeros((8, rank))) is not None
    assert mosaic._prepared_lora_operand(prepared, jnp.zeros((8, 32))) is None
    assert mosaic.with_lora_operand(weight, jnp.zeros((24, n)), 0.5) is weight  # rank


def _reference_unscaled(x, permuted, *, n, k, splits=None, lora_x_a=None, lora_bt=None,
                        stages=None, l2_prefetch=None, swiglu=None, schedule="auto"):
    """mg.matmul_unscaled's result from the permuted buffer by float32 jnp (the kernel's
    numbers are checked on the GPU by test_mgpu_nvfp4_gpu.py; an L2 prefetch is a
    hint that changes no result); with swiglu, the fused epilogue's (h, shares) as its
    docstring states them."""
    del splits, stages, l2_prefetch, schedule
    n_pad = mg.padded_rows(permuted, k)
    raw = mg.permuted_dequantize_reference(permuted, jnp.asarray([2.0 ** -mg.SCALED_EXPONENT]),
                                 n=n_pad, k=k)  # e2m1 x block scale x 2^-8
    y = x.astype(jnp.float32) @ raw.T
    if lora_x_a is not None:
        y = y + (lora_x_a.astype(jnp.bfloat16).astype(jnp.float32)
                 @ lora_bt.astype(jnp.float32).T)
    if swiglu is None:
        return y
    m, tiles = x.shape[0], n_pad // 64
    y = y.reshape(m, tiles, 2, 32)
    halves = [(y[:, :, i].reshape(m, -1) * 2.0 ** -mg.SCALED_EXPONENT
               / jnp.asarray(ts, jnp.float32).reshape(())).astype(jnp.bfloat16)
              .astype(jnp.float32) for i, ts in enumerate((swiglu.gate_divisor,
                                                           swiglu.up_divisor))]
    h = (halves[0] / (1.0 + jnp.exp(-halves[0])) * halves[1]).astype(jnp.bfloat16)
    if swiglu.next_lora_a is None:
        return h, None
    a = swiglu.next_lora_a.astype(jnp.float32).reshape(tiles, 32, -1)
    shares = jnp.einsum("mtj,tjr->tmr", h.astype(jnp.float32).reshape(m, tiles, 32), a)
    return h, shares


def test_mosaic_swiglu_dispatch_matches_the_triton_launch(monkeypatch):
    """The Mosaic GPU SwiGLU launch (a gate/up pair's permuted buffer, the pair LoRA
    operand, de-interleaving, per-half tensor scales, bf16 roundings, next-layer LoRA product)
    with the kernel replaced by a jnp reference, against the Triton fused SwiGLU launch
    (interpreted) on the same pair: equal within bf16 rounding of the outputs (2^-7 of the
    largest |output|; the two sum in different orders). The prepared operand
    (mosaic.with_pair_lora_operand, as the sampler makes it) gives the same numbers."""
    n, k, rank, m = 96, 512, 16, 5
    keys = jax.random.split(jax.random.key(6), 8)
    gate, up = (kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(keys[i], (n, k))),
                                    tile_k=256) for i in (0, 1))
    views = kl.pair_gate_up(gate, up)
    tiles = mg.permute_packed(views[0].whole_pair())
    views = tuple(v.replace(mosaic_tiles=tiles) for v in views)
    x = jax.random.normal(keys[2], (m, k)).astype(jnp.bfloat16)
    a = jax.random.normal(keys[3], (k, 2 * rank)) * 0.05
    down = (x.astype(jnp.float32) @ a).astype(jnp.bfloat16)
    lora_bs = (jax.random.normal(keys[4], (rank, n)), jax.random.normal(keys[5], (rank, n)))
    next_a = jax.random.normal(keys[6], (n, 8)) * 0.1
    scales = (0.5, 0.5)

    def launch(weights, interpret):
        backend = TritonDecodeBackend("nvfp4", KernelOptions(), interpret=interpret)
        return backend.apply_swiglu(x, weights, down, lora_bs, scales, None, next_a,
                                    compute_dtype=jnp.bfloat16)

    expected, expected_next = launch(views, True)  # Triton, interpreted
    monkeypatch.setattr(mg, "available", lambda: None)
    monkeypatch.setattr(mg, "matmul_unscaled", _reference_unscaled)
    assert mosaic.swiglu_refusal(x, views[0], down, lora_bs) is None
    got, got_next = launch(views, False)
    assert got.shape == expected.shape == (m, n) and got.dtype == jnp.bfloat16
    top = float(jnp.abs(expected.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               rtol=0, atol=2.0 ** -7 * top)
    top_next = float(jnp.abs(expected_next).max())
    np.testing.assert_allclose(np.asarray(got_next), np.asarray(expected_next), rtol=0,
                               atol=2.0 ** -7 * top_next)
    prepared = mosaic.with_pair_lora_operand(*views, *lora_bs, scales[0])
    assert prepared is not views[0] and prepared.mosaic_lora_operand.shape == (2 * 128, 32)
    again, again_next = launch((prepared, views[1]), False)
    assert jnp.array_equal(again, got) and jnp.array_equal(again_next, got_next)
    # the single-weight path leaves pair views alone; ranks the pair operand cannot take
    assert mosaic.with_lora_operand(views[0], lora_bs[0], 0.5) is views[0]
    assert mosaic.swiglu_refusal(x, views[0], jnp.zeros((m, 48)), lora_bs) is not None


def test_swiglu_epilogue_up_to_its_row_limit(monkeypatch):
    """KernelOptions.mosaic_swiglu_epilogue_max_m: a gate|up launch of at most that many rows
    asks mgpu_nvfp4_swiglu for the SwiGLU in the kernel's epilogue (fused), one of more rows
    for the XLA one; the default puts M = 8 and 16 in the kernel and 17-64 in XLA (per launch
    on an H100, benchmarks/RESULTS.md)."""
    n, k = 96, 512
    gate, up = (kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(jax.random.key(i), (n, k))),
                                    tile_k=256) for i in (0, 1))
    views = kl.pair_gate_up(gate, up)
    tiles = mg.permute_packed(views[0].whole_pair())
    views = tuple(v.replace(mosaic_tiles=tiles) for v in views)
    asked = []
    monkeypatch.setattr(mg, "available", lambda: None)
    monkeypatch.setattr(mg, "mgpu_nvfp4_swiglu",
                        lambda x, *args, fused=True, **kwargs: asked.append(fused) or x)
    for options, m, fused in ((KernelOptions(), 8, True), (KernelOptions(), 16, True),
                              (KernelOptions(), 17, False), (KernelOptions(), 64, False),
                              (KernelOptions(mosaic_swiglu_epilogue_max_m=64), 64, True),
                              (KernelOptions(mosaic_swiglu_epilogue_max_m=0), 1, False)):
        backend = TritonDecodeBackend("nvfp4", options)
        backend.apply_swiglu(jnp.ones((m, k), jnp.bfloat16), views, None, (None, None),
                             (1.0, 1.0), None, None, compute_dtype=jnp.bfloat16)
        assert asked[-1] is fused, (options.mosaic_swiglu_epilogue_max_m, m)
    assert len(asked) == 6


def _swiglu_lowering_args(n: int, k: int, m: int):
    """Shapes of a fused SwiGLU launch over a [n, k] gate/up pair at M = m, LoRA r32 on each
    half: x, the pair's permuted buffer, the two tensor scales, x @ A, the pair operand, the
    next layer's LoRA A."""
    gate, up = (kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(jax.random.key(i),
                                                                      (n, k))), tile_k=256)
                for i in (0, 1))
    view = kl.pair_gate_up(gate, up)[0]
    tiles = jax.ShapeDtypeStruct(mg.permute_packed(view.whole_pair()).shape, jnp.uint8)
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), tiles,
            jax.ShapeDtypeStruct((1,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32),
            jax.ShapeDtypeStruct((m, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((2 * n, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, 32), jnp.bfloat16))


def test_swiglu_lowers_for_cuda():
    n, k, m = 128, 512, 8
    args = _swiglu_lowering_args(n, k, m)

    def f(x, tiles, ts_g, ts_u, down, operand, next_a):
        return mg.mgpu_nvfp4_swiglu(x, tiles, ts_g, ts_u, out_n=n, k=k, half_block=32,
                                    lora_x_a=down, lora_bt=operand, next_lora_a=next_a)

    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert [o.shape for o in lowered.out_info] == [(m, n), (m, 32)]
    # one split: the fused SwiGLU epilogue (with and without the next LoRA product)
    for with_next in (True, False):
        def fused(x, tiles, ts_g, ts_u, down, operand, next_a, with_next=with_next):
            return mg.mgpu_nvfp4_swiglu(x, tiles, ts_g, ts_u, out_n=n, k=k, half_block=32,
                                        lora_x_a=down, lora_bt=operand, splits=1,
                                        next_lora_a=next_a if with_next else None)
        lowered = jax.jit(fused).trace(*args).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "mosaic_gpu" in text
        shapes = jax.tree.map(lambda o: o.shape, lowered.out_info)
        assert shapes == (((m, n), (m, 32)) if with_next else (m, n)), shapes


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
    on a Triton kernel (here: interpreted) logs that it unpermutes them at every call."""
    import gc
    import weakref

    from flax import nnx

    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    from qerl_jax.model_quant.kernels import enable_kernels
    from qerl_jax.model_quant.quantize import quantize_model
    from qerl_jax.models import decode_fusion
    from qerl_jax.quant.backends import mosaic, triton
    from qerl_jax.quant.kernel_options import KernelOptions
    model = init_model(tiny_qwen2(param_dtype="bfloat16", compute_dtype="bfloat16"), seed=0)
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
                [mg.permute_packed(w.packed()) for w in qkv]))
            for proj in (attention.o_proj, mlp.down_proj):
                expected_buffers[id(proj)] = np.asarray(mg.permute_packed(
                    proj.weight.get_value().packed()))
            expected_buffers[id(mlp)] = np.asarray(mg.permute_packed(
                mlp.gate_proj.weight.get_value().whole_pair()))
        del qkv  # nothing but the model may keep the kernel-layout arrays alive
        layer_count = len(model.layers)
        assert decode_fusion.add_decode_layouts(model) == (4 * layer_count, layer_count,
                                                           layer_count)
        gc.collect()
        assert all(ref() is None for ref in stored)
        after = weights()
        assert all(w.single_copy and w.kernel_codes is None and w.kernel_scales is None
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
            assert backend.swiglu_refusal(8, (gate, up), None) is None
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
        assert any("gate|up SwiGLU launch" in m and "interpret mode" in m for m in warned)
        assert any("grouped launch" in m for m in warned), warned
        assert any("single-weight launch" in m for m in warned), warned
    finally:
        unregister_kernels("cpu")


def test_default_splits_at_the_model_shapes():
    """The fewest steps per program within 528 programs, then the fewest splits; splits need
    not divide the K tiles (7B's down projection: 74 K tiles, 9 splits of 8-9 tiles)."""
    assert mg.default_splits(56, 74) == 9  # 7B down (N 3584, K 18944)
    assert mg.default_splits(56, 14) == 7  # 7B q/o
    assert mg.default_splits(592, 14) == 1  # 7B gate|up pair
    assert mg.default_splits(80, 20) == 5  # 14B/32B q/o
    assert mg.default_splits(112, 20) == 4  # 14B/32B q|k|v grouped
    assert mg.default_splits(80, 54) == 6  # 14B down
    assert mg.default_splits(80, 108) == 6  # 32B down
    assert mg.default_splits(864, 20) == 1  # 32B gate|up pair
    for row_tiles in (1, 7, 56, 80, 300, 600):
        for k_tiles in (1, 3, 14, 37, 74, 108):
            splits = mg.default_splits(row_tiles, k_tiles)
            assert 1 <= splits <= k_tiles
            assert row_tiles * splits <= max(528, row_tiles)


def test_splits_follow_the_programs_shared_memory_lets_an_sm_hold():
    """Up to M = 24 an SM holds 4 programs (registers); from M = 32 their x tiles fill its
    shared memory first (3, then 2 at M = 48-64), and the splits shrink to one wave of those:
    the 7B shapes at M = 64 get the counts measured fastest there (q|k|v 3, down 4)."""
    tile_bytes = lambda m: 2 * (m * 256 * 2 + 72 * 128) + m * 64 * 4  # noqa: E731
    for m_pad in range(8, 65, 8):
        resident = mg.resident_programs(m_pad)
        assert resident == min(4, 227 * 1024 // tile_bytes(m_pad))
        for row_tiles, k_tiles in ((56, 74), (56, 14), (72, 14), (592, 14)):
            assert mg.default_splits(row_tiles, k_tiles, m=m_pad) == mg.default_splits(
                row_tiles, k_tiles, 132 * resident)
    assert [mg.resident_programs(m) for m in (8, 24, 32, 40, 48, 64)] == [4, 4, 3, 3, 2, 2]
    assert mg.resident_programs(57) == mg.resident_programs(64)  # x is padded to 8 rows
    assert mg.default_splits(72, 14, m=64) == 3  # 7B q|k|v at M = 64 (7 at M = 8)
    assert mg.default_splits(56, 74, m=64) == 4  # 7B down (9 at M = 8)
    assert mg.default_splits(56, 14, m=8) == mg.default_splits(56, 14) == 7
    assert mg.l2_prefetch_for(jnp.zeros((56 * 14 * 72, 128), jnp.uint8), k=3584,
                              m=64).splits == 4


@pytest.mark.parametrize("rank,splits", [(96, None), (48, 3), (192, 2)])
def test_kernel_lowers_with_grouped_operands_and_uneven_splits(rank, splits):
    """Operand widths of grouped launches (3r: 48, 96, 192; 64- and 32-byte swizzles) and
    splits that do not divide the K tiles (the skipped last step) lower for CUDA."""
    n, k, m = 384, 1792, 8  # 7 K tiles
    permuted = jax.ShapeDtypeStruct((n // 64 * 7 * mg.TILE_LINES, 128), jnp.uint8)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), permuted,
            jax.ShapeDtypeStruct((m, rank), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, rank), jnp.bfloat16))

    def f(x, permuted, down, operand):
        return mg.matmul_unscaled(x, permuted, n=n, k=k, splits=splits, lora_x_a=down,
                                  lora_bt=operand)

    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert lowered.out_info.shape == (m, n)


def test_group_lora_operand_is_block_diagonal():
    """group_lora_operand: member i's rows hold its lora_operand in its own columns, zeros in
    the others' (float64 check of the folding is lora_operand's test)."""
    keys = jax.random.split(jax.random.key(8), 3)
    ns, rank = (192, 64, 64), 16
    bs = [jax.random.normal(key, (rank, n)) for key, n in zip(keys, ns)]
    tss = [jnp.asarray([3.0]), jnp.asarray([0.5]), jnp.asarray([7.0])]
    operand = mg.group_lora_operand(bs, tss, (0.5, 0.5, 0.25), (256, 128, 128))
    assert operand.shape == (512, 48) and operand.dtype == jnp.bfloat16
    rows = 0
    for i, (b, ts, scale, n_pad) in enumerate(zip(bs, tss, (0.5, 0.5, 0.25), (256, 128, 128))):
        block = operand[rows:rows + n_pad]
        assert jnp.array_equal(block[:, 16 * i:16 * i + 16],
                               mg.lora_operand(b, ts, scale, n_pad=n_pad))
        assert not jnp.any(jnp.delete(block, np.arange(16 * i, 16 * i + 16), axis=1))
        rows += n_pad
    with pytest.raises(ValueError, match="sum to 24"):
        mg.group_lora_operand([jnp.zeros((8, 64))] * 3, tss, (1.0,) * 3, (64,) * 3)


def test_mosaic_group_dispatch_matches_the_triton_launch(monkeypatch):
    """The Mosaic GPU grouped q|k|v launch (one matmul over the stacked buffer, the
    block-diagonal LoRA operand, each member's own tensor scale, bf16 rounding) with the kernel
    replaced by a jnp reference, against the Triton grouped launch (interpreted) on the same
    weights: equal within bf16 rounding of each output (2^-7 of its largest |value|). The
    prepared operand (mosaic.with_group_lora_operand) gives the same numbers; the single-weight
    launch refuses q's grouped buffer."""
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
        backend = TritonDecodeBackend("nvfp4", KernelOptions(), interpret=interpret)
        return backend.apply_grouped(x, ws, down, lora_bs, scales, compute_dtype=jnp.bfloat16)

    expected = launch(weights, True)  # Triton, interpreted
    monkeypatch.setattr(mg, "available", lambda: None)
    monkeypatch.setattr(mg, "matmul_unscaled", _reference_unscaled)
    tiles = mg.group_permuted([mg.permute_packed(w.packed()) for w in weights], [k] * 3)
    grouped = (weights[0].replace(mosaic_tiles=tiles), *weights[1:])
    assert mosaic.group_refusal(x, grouped, down, lora_bs) is None
    assert mosaic.group_refusal(x, weights, down, lora_bs) == "no permuted group buffer"
    got = launch(grouped, False)
    for g, e, n in zip(got, expected, ns):
        assert g.shape == e.shape == (m, n)
        top = float(jnp.abs(e).max())
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=0, atol=2.0 ** -7 * top)
    prepared = mosaic.with_group_lora_operand(grouped, lora_bs, scales)
    assert prepared is not grouped[0] and prepared.mosaic_lora_operand.shape == (512, 48)  # N_pad: 128s
    again = launch((prepared, *grouped[1:]), False)
    assert all(jnp.array_equal(a_, g) for a_, g in zip(again, got))
    # q's grouped buffer is not its own: the single-weight path and its operand refuse it
    assert "grouped" in mosaic.refusal(x, grouped[0], None)
    assert mosaic.with_lora_operand(grouped[0], lora_bs[0], 0.5) is grouped[0]
    # ranks whose sum the kernel cannot take; a stale group (k given its own buffer)
    assert mosaic.with_group_lora_operand(grouped, [jnp.zeros((24, n)) for n in ns],
                                          scales) is grouped[0]
    own = weights[1].replace(mosaic_tiles=mg.permute_packed(weights[1].packed()))
    assert mosaic.group_refusal(x, (grouped[0], own, weights[2]), down,
                                lora_bs) == "no permuted group buffer"


def test_l2_prefetch_plans_and_lowering():
    """l2_prefetch_for: the next launch's grid and the tiles per program (at most its fewest
    steps); bad plans are refused; a launch with a plan lowers for CUDA (each mode)."""
    permuted = jnp.zeros((16 * 7 * mg.TILE_LINES, 128), jnp.uint8)  # N 1024, 7 K tiles
    plan = mg.l2_prefetch_for(permuted, k=1792)
    assert (plan.row_tiles, plan.k_tiles, plan.splits) == (16, 7, mg.default_splits(16, 7))
    assert mg.l2_prefetch_for(permuted, k=1792, splits=7, ahead=3).ahead == 1  # 1 step each
    assert mg.l2_prefetch_for(permuted, k=1792, splits=2, ahead=3).ahead == 3
    with pytest.raises(ValueError, match="ahead=4"):
        mg.l2_prefetch_for(permuted, k=1792, ahead=4)
    with pytest.raises(ValueError, match="contiguous_lines"):
        mg.l2_prefetch_for(permuted, k=1792, contiguous_lines=permuted.shape[0] + 1)
    n, k, m = 384, 1792, 8
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n // 64 * 7 * mg.TILE_LINES, 128), jnp.uint8),
            jax.ShapeDtypeStruct(permuted.shape, jnp.uint8),
            jax.ShapeDtypeStruct((m, 32), jnp.bfloat16), jax.ShapeDtypeStruct((n, 32),
                                                                              jnp.bfloat16))
    extra = jnp.zeros((600, 96), jnp.bfloat16)  # a LoRA A: 3 boxes of up to 256 rows
    assert mg.extra_prefetchable(extra) and not mg.extra_prefetchable(jnp.zeros((8, 3)))
    with pytest.raises(ValueError, match="extra"):
        mg.l2_prefetch_for(permuted, k=1792, extra=jnp.zeros((8, 300), jnp.bfloat16))
    for mode in (dict(ahead=1), dict(ahead=3, splits=2), dict(contiguous_lines=5000),
                 dict(ahead=1, extra=extra)):
        def f(x, p, q, d, o, mode=mode):
            return mg.matmul_unscaled(x, p, n=n, k=k, splits=3, lora_x_a=d, lora_bt=o,
                                      l2_prefetch=mg.l2_prefetch_for(q, k=k, **mode))
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text() and lowered.out_info.shape == (m, n)


def test_link_decode_prefetch_chains_the_decode_launches():
    """decode_fusion.link_decode_prefetch: in decode order each Mosaic launch's weight
    holds the next launch's permuted buffer (the same array, no copy) and its K: q|k|v -> o ->
    gate|up -> down -> the next layer's q|k|v; the last down none; and the LoRA A that the
    x @ A before that launch reads (o's A, the MLP's and next attention's stacked A, down's
    A: the same arrays), in the plan (KernelOptions.mosaic_prefetch_tiles K tiles; none with 0).
    The pytree round trip keeps the link."""
    from qerl_jax.lora import LoRAConfig, add_lora, cast_adapters_for_compute
    from qerl_jax.model_quant.kernels import enable_kernels
    from qerl_jax.model_quant.quantize import quantize_model
    from qerl_jax.models import decode_fusion
    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    model = init_model(tiny_qwen2(param_dtype="bfloat16", compute_dtype="bfloat16"), seed=0)
    quantize_model(model, "nvfp4")
    add_lora(model, LoRAConfig(rank=16), jax.random.key(1))
    enable_kernels(model, platform="cpu", interpret=True, tile_k=256)
    try:
        decode_fusion.add_decode_layouts(model)
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
                assert mosaic._prefetch_plan(weight, 1, 8) is None
                continue
            target, lora_a = following[0].weight.get_value(), following[1]
            assert weight.mosaic_prefetch is target.mosaic_tiles
            assert weight.mosaic_prefetch_lora_a is lora_a
            assert weight.mosaic_prefetch_k == target.shape[1]
            plan = mosaic._prefetch_plan(weight, 1, 8)
            assert plan.buffer is target.mosaic_tiles and plan.ahead == 1
            assert plan.extra is lora_a and mg.extra_prefetchable(lora_a)
            assert mosaic._prefetch_plan(weight, 0, 8) is None
            # the plan's grid is the following launch's, under each schedule, with that
            # launch's LoRA operand (the width of the x @ A it reads)
            row_tiles = target.mosaic_tiles.shape[0] // (
                mg.TILE_LINES * -(-target.shape[1] // mg.TILE_K))
            for schedule in ("split_k", "warp_specialized", "auto"):
                expected = mg.launch_splits(row_tiles, -(-target.shape[1] // mg.TILE_K),
                                            m=64, schedule=schedule, rank=lora_a.shape[1])
                got = mosaic._prefetch_plan(weight, 1, 64, schedule)
                assert (got.row_tiles, got.splits) == (row_tiles, expected), schedule
            leaves, treedef = jax.tree_util.tree_flatten(weight)
            again = jax.tree_util.tree_unflatten(treedef, leaves)
            assert again.mosaic_prefetch_k == weight.mosaic_prefetch_k
        up = layers[0].mlp.up_proj.weight.get_value()
        assert up.mosaic_prefetch is None  # the pair's launch is the gate view's
    finally:
        unregister_kernels("cpu")


def test_fused_swiglu_epilogue_plumbing(monkeypatch):
    """mgpu_nvfp4_swiglu with one split takes the fused epilogue (SwigluEpilogue: the divisors,
    next_lora_a padded to the row tiles' 32 rows each) and sums the row tiles' shares; with the
    kernel replaced by a jnp stand-in that computes what _swiglu_epilogue's docstring states,
    its outputs equal the XLA epilogue's (fused=False) within bf16 rounding. The epilogue's own
    numbers are checked on the GPU (test_mgpu_nvfp4_gpu.py: the 32B SwiGLU launch against
    Triton's, the sampler)."""
    n, k, m, rank = 96, 512, 5, 16  # out_n 96: the next A is padded from 96 to 128 rows
    keys = jax.random.split(jax.random.key(12), 6)
    gate, up = (kl.to_kernel_layout(nvfp4_quantize(jax.random.normal(keys[i], (n, k))),
                                    tile_k=256) for i in (0, 1))
    view = kl.pair_gate_up(gate, up)[0]
    tiles = mg.permute_packed(view.whole_pair())
    x = jax.random.normal(keys[2], (m, k)).astype(jnp.bfloat16)
    next_a = (jax.random.normal(keys[3], (n, rank)) * 0.1).astype(jnp.bfloat16)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs.get("swiglu"))
        return _reference_unscaled(*args, **kwargs)

    monkeypatch.setattr(mg, "matmul_unscaled", stand_in)
    common = dict(out_n=n, k=k, half_block=32, splits=1, next_lora_a=next_a)
    fused, fused_next = mg.mgpu_nvfp4_swiglu(x, tiles, gate.kernel_tensor_scale(),
                                             up.kernel_tensor_scale(), **common)
    assert calls[-1] is not None and calls[-1].next_lora_a.shape == (128, rank)
    plain, plain_next = mg.mgpu_nvfp4_swiglu(x, tiles, gate.kernel_tensor_scale(),
                                             up.kernel_tensor_scale(), fused=False, **common)
    assert calls[-1] is None
    assert fused.shape == plain.shape == (m, n) and fused.dtype == jnp.bfloat16
    assert jnp.array_equal(fused, plain)  # the same roundings in the same order
    assert fused_next.shape == plain_next.shape == (m, rank)
    top = float(jnp.abs(plain_next).max())
    np.testing.assert_allclose(np.asarray(fused_next), np.asarray(plain_next), rtol=0,
                               atol=1e-5 * top)
    # more than one split, or blocks of other than 32 rows: the XLA epilogue
    mg.mgpu_nvfp4_swiglu(x, tiles, gate.kernel_tensor_scale(), up.kernel_tensor_scale(), out_n=n, k=k,
                         half_block=32, splits=2)
    assert calls[-1] is None
    monkeypatch.undo()  # the kernel's own argument checks
    with pytest.raises(ValueError, match="one split"):
        mg.matmul_unscaled(x, tiles, n=256, k=k, splits=2,
                           swiglu=mg.SwigluEpilogue(gate.kernel_tensor_scale(), up.kernel_tensor_scale()))


def test_identical_launches_lower_to_one_kernel():
    """Launches with the same static configuration (a model's layers) call one cached jitted
    kernel (_split_k_kernel): a program with 8 of them holds one Mosaic GPU module, lowered
    once; another configuration (other splits) adds a second."""
    n, k, m = 384, 1792, 8
    permuted = jax.ShapeDtypeStruct((n // 64 * 7 * mg.TILE_LINES, 128), jnp.uint8)

    def program(x, weights, down, operand):
        y = x
        for i, w in enumerate(weights):
            splits = 3 if i < 7 else 7
            y = mg.matmul_unscaled(y, w, n=n, k=k, splits=splits, lora_x_a=down,
                                   lora_bt=operand)
            y = jnp.tile(y, (1, -(-k // n)))[:, :k].astype(jnp.bfloat16)
        return y

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), [permuted] * 8,
            jax.ShapeDtypeStruct((m, 32), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, 32), jnp.bfloat16))
    text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("kernel_hash") == 2  # splits 3 (7 launches) and splits 7 (1 launch)
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 2


@pytest.mark.parametrize("rank,ok", [(16, True), (12, False)])
def test_mosaic_option_and_lora_ranks(caplog, rank, ok):
    """KernelOptions.mosaic_nvfp4 ('auto', 'on' or 'off'; another value an error naming the
    field), and a LoRA rank the Mosaic GPU kernel does not take (enable_kernels' lora_rank, or
    an adapter the model has) keeps the Triton kernels for the whole model, with the reason
    logged (info for 'auto', a warning for 'on')."""
    import logging
    from qerl_jax.lora import LoRAConfig, add_lora
    from qerl_jax.model_quant.kernels import _lora_ranks
    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    from qerl_jax.quant import kernels
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
            original = mosaic.unavailable
            mosaic.unavailable = lambda: None  # as on a Hopper GPU
            try:
                assert kernels.mosaic_refusal(KernelOptions(mosaic_nvfp4="on"), interpret=False,
                                              lora_ranks={rank}) == refusal
            finally:
                mosaic.unavailable = original
        assert "keep the kernel layout and the Triton kernels" in caplog.text
        assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_launch_schedule_and_its_splits():
    """"auto": split-K programs below WARP_SPECIALIZED_MIN_M rows and wherever two fit an SM's
    shared memory with their LoRA tiles; warp-specialized otherwise, where the row tiles pair
    up (odd counts stay split-K, also when it is asked for): at M = 64 the grouped q|k|v (r 96)
    and gate|up pair (r 64) launches, not r 32 or none. The warp-specialized splits fill one
    program per SM (132) with pairs of row tiles, the split-K ones resident_programs per SM; the
    L2 prefetch plan of the next launch takes that launch's splits; the pipeline is 3 deep
    where its shared memory fits, else 2."""
    assert mg.WARP_SPECIALIZED_MIN_M == 33 and mg.WS_COMPUTE_WARPGROUPS == 2
    assert [mg.launch_schedule(64, 72, rank=r) for r in (None, 32, 64, 96)] == [
        "split_k", "split_k", "warp_specialized", "warp_specialized"]
    assert mg.split_k_smem_bytes(64, 64) == 2 * (64 * 512 + 9216) + 64 * 256 + 128 * 128
    assert mg.launch_schedule(32, 56, rank=192) == "split_k"
    assert mg.launch_schedule(48, 56, rank=96) == "split_k"
    assert mg.launch_schedule(48, 56, rank=192) == "warp_specialized"
    assert mg.launch_schedule(64, 55, rank=96) == "split_k"
    assert mg.launch_schedule(8, 56, "warp_specialized") == "warp_specialized"
    assert mg.launch_schedule(64, 7, "warp_specialized") == "split_k"
    assert mg.launch_schedule(64, 56, "split_k") == "split_k"
    with pytest.raises(ValueError, match="stream_k"):
        mg.launch_schedule(64, 56, "stream_k")
    # 7B launches at M = 64: gate|up pair, down, q|k|v, o
    assert [mg.launch_splits(r, t, m=64, schedule="warp_specialized")
            for r, t in ((592, 14), (56, 74), (72, 14), (56, 14))] == [1, 4, 3, 4]
    ws = dict(schedule="warp_specialized")
    assert mg.launch_splits(40, 14, m=40, **ws) == mg.default_splits(20, 14, 132) == 5
    assert mg.launch_splits(40, 14, m=40) == mg.default_splits(40, 14, m=40) == 7
    assert mg.launch_splits(40, 14, m=48, rank=192) == 5
    assert mg.launch_splits(56, 74, m=8) == mg.default_splits(56, 74) == 9
    permuted = jnp.zeros((40 * 14 * mg.TILE_LINES, 128), jnp.uint8)
    assert mg.l2_prefetch_for(permuted, k=3584, m=40, **ws).splits == 5
    assert mg.l2_prefetch_for(permuted, k=3584, m=40).splits == 7
    assert mg.l2_prefetch_for(permuted, k=3584, m=48, rank=192).splits == 5
    assert mg.ws_stages(64, 96) == mg.ws_stages(64, 64, swiglu=True) == 3
    assert mg.ws_stages(64, 192) == 2
    assert mg.ws_smem_bytes(64, 3, 96) == 3 * (2 * 9216 + 64 * 512) + 2 * 64 * 256 + 192 * 192


def test_warp_specialized_kernel_lowers_for_cuda():
    """The warp-specialized kernel lowers for CUDA with every operand the split-K kernel
    takes: no LoRA, LoRA widths 32-192 (the 192-wide operand at 2 stages), splits that do not
    divide the K tiles, M not a multiple of 8, an L2 prefetch plan with an extra array, and the
    fused SwiGLU epilogue with and without the next LoRA product."""
    n, k = 384, 1792  # 6 row tiles, 7 K tiles
    def calls():
        info = mg._warp_specialized_kernel.cache_info()
        return info.hits + info.misses
    calls_before = calls()
    for m, rank, splits in ((64, 0, None), (40, 96, None), (57, 48, 3), (64, 192, 2)):
        args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                jax.ShapeDtypeStruct((n // 64 * 7 * mg.TILE_LINES, 128), jnp.uint8)]
        if rank:
            args += [jax.ShapeDtypeStruct((m, rank), jnp.bfloat16),
                     jax.ShapeDtypeStruct((n, rank), jnp.bfloat16)]

        def f(x, p, *lora, splits=splits):
            lora = dict(lora_x_a=lora[0], lora_bt=lora[1]) if lora else {}
            return mg.matmul_unscaled(x, p, n=n, k=k, splits=splits,
                                      schedule="warp_specialized", **lora)

        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text() and lowered.out_info.shape == (m, n)
    m = 64
    following = jnp.zeros((16 * 7 * mg.TILE_LINES, 128), jnp.uint8)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n // 64 * 7 * mg.TILE_LINES, 128), jnp.uint8),
            jax.ShapeDtypeStruct(following.shape, jnp.uint8),
            jax.ShapeDtypeStruct((m, 32), jnp.bfloat16), jax.ShapeDtypeStruct((n, 32),
                                                                              jnp.bfloat16))

    def prefetching(x, p, q, d, o):
        plan = mg.l2_prefetch_for(q, k=k, m=m, ahead=1, extra=jnp.zeros((600, 96), jnp.bfloat16))
        return mg.matmul_unscaled(x, p, n=n, k=k, lora_x_a=d, lora_bt=o, l2_prefetch=plan,
                                  schedule="warp_specialized")

    lowered = jax.jit(prefetching).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.out_info.shape == (m, n)
    n, k = 128, 512
    args = _swiglu_lowering_args(n, k, m)
    for with_next in (True, False):
        def fused(x, tiles, ts_g, ts_u, down, operand, next_a, with_next=with_next):
            return mg.mgpu_nvfp4_swiglu(x, tiles, ts_g, ts_u, out_n=n, k=k, half_block=32,
                                        lora_x_a=down, lora_bt=operand, splits=1,
                                        next_lora_a=next_a if with_next else None,
                                        schedule="warp_specialized")
        lowered = jax.jit(fused).trace(*args).lower(lowering_platforms=("cuda",))
        shapes = jax.tree.map(lambda o: o.shape, lowered.out_info)
        assert shapes == (((m, n), (m, 32)) if with_next else (m, n)), shapes
    assert calls() - calls_before == 7  # every launch above took the warp-specialized kernel
