"""The kernel backends of the quantized linear op (qerl_jax/quant/kernel_registry.py,
backends/) on CPU with the Pallas kernels in interpret mode; the kernels on a whole model:
tests/model_quant/test_kernel_setup.py.

Reference: the XLA path on the same QuantizedWeight in the checkpoint layout (dequantize to
bf16 with the format's jnp code, then one dot), i.e. what runs without kernels.

Tolerances (bf16 compute, float32 accumulation in both paths): the kernels decode each weight
exactly in bf16 and apply NVFP4's tensor scale to the float32 sums, while the XLA path rounds
every w / tensor_scale to bf16 (one bf16 rounding per weight, <= 2^-9 relative), and the sums
run in another order; the outputs are then rounded to bf16 (twice on the kernel path: inside the
kernel and after the bias). Bound: max|y - y_ref| <= 2^-6 * max|y_ref| (about two bf16 ulps of
the largest output), for y = x @ W^T and for dx = dy @ W alike.
"""

import dataclasses
import functools
import logging
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from qerl_jax.quant.backends import kernel_layout
from qerl_jax.quant.backends.kernel_layout import KernelLayoutWeight, to_kernel_layout
from qerl_jax.quant.backends.mosaic import MosaicBackend
from qerl_jax.quant.backends.triton import kernel_names
from qerl_jax.quant.dispatch import registered_backends, select_matmul_path
from qerl_jax.quant.formats import get_format
from qerl_jax.quant.kernel_options import KernelOptions
from qerl_jax.quant.kernel_registry import register_kernels, unregister_kernels
from qerl_jax.quant.linear_op import linear
from qerl_jax.quant.qarray import QuantizedWeight
from tests.conftest import leaves_bitwise_equal

FORMATS = ["nvfp4", "mxfp4", "nf4"]
TOLERANCE = 2.0 ** -6
# Neither K nor N is a multiple of the kernel tiles (tile_k 256, N padded to 128, block_n 64).
N, K = 200, 320


# every test sees the once-per-reason path log messages again
pytestmark = pytest.mark.usefixtures("fresh_path_log")


def _weight(format_name, rng, n=N, k=K, **kwargs):
    dense = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    return get_format(format_name).quantize(dense, name="test.proj", **kwargs)


def _assert_close(actual, expected, tolerance, context):
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert np.all(np.isfinite(actual)), context
    error = np.abs(actual - expected).max()
    assert error <= tolerance * np.abs(expected).max(), (context, error,
                                                         np.abs(expected).max())


def _outputs_and_grads(fn, fn_ref, primals, cotangent):
    """(fn's outputs, its VJP of `cotangent`, the same two of fn_ref) at `primals`."""
    out, vjp = jax.vjp(fn, *primals)
    out_ref, vjp_ref = jax.vjp(fn_ref, *primals)
    return out, vjp(cotangent), out_ref, vjp_ref(cotangent)


def _assert_lora_grads_close(grads, grads_ref, count, with_lora, context):
    """grads = (dx, (dA_i), (dB_i)) of `count` adapters against the reference's, within twice
    the module's tolerance (dx only without LoRA)."""
    _assert_close(grads[0], grads_ref[0], 2 * TOLERANCE, f"{context} dx")
    if with_lora:
        for i in range(count):
            _assert_close(grads[1][i], grads_ref[1][i], 2 * TOLERANCE, f"{context} dA{i}")
            _assert_close(grads[2][i], grads_ref[2][i], 2 * TOLERANCE, f"{context} dB{i}")


def _forward_and_dx(x, weight, bias, dy):
    y, vjp = jax.vjp(lambda x: linear(x, weight, bias, compute_dtype=jnp.bfloat16), x)
    return y, vjp(dy)[0]


_forward_and_dx_jit = jax.jit(_forward_and_dx)


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_kernel_paths_match_xla_forward_and_dx(format_name, m, interpret_kernels, caplog):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    quantized = _weight(format_name, rng)
    prepared = to_kernel_layout(quantized)
    assert isinstance(prepared, KernelLayoutWeight)
    x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, N)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((N,)) * 0.1, jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger="qerl_jax.quant.dispatch"):
        y, dx = _forward_and_dx_jit(x, prepared, bias, dy)
        y_ref, dx_ref = _forward_and_dx_jit(x, quantized, bias, dy)
    fused, dequantize = kernel_names(format_name)
    expected_path = fused if m <= 64 else dequantize
    assert select_matmul_path(format_name, m, "cpu") == expected_path
    assert f"{expected_path} path" in caplog.text
    context = f"{format_name} M={m} seed {seed}"
    _assert_close(y, y_ref, TOLERANCE, context + " forward")
    _assert_close(dx, dx_ref, TOLERANCE, context + " dx")


@pytest.mark.parametrize("format_name,kwargs", [("nvfp4", {}), ("mxfp4", {}),
                                                ("nf4", {"double_quant": True}),
                                                ("nf4", {"double_quant": False})])
def test_kernel_layout_is_lossless(format_name, kwargs):
    rng = np.random.default_rng(secrets.randbits(32))
    quantized = _weight(format_name, rng, n=136, k=192, **kwargs)
    prepared = to_kernel_layout(quantized)
    assert isinstance(prepared, QuantizedWeight) and prepared.shape == quantized.shape
    leaves_bitwise_equal(prepared.to_checkpoint(), quantized)
    for name in ("codes", "block_scales", "tensor_scale", "double_quant_scales"):
        leaves_bitwise_equal(getattr(prepared, name), getattr(quantized, name))
    np.testing.assert_array_equal(np.asarray(prepared.dequantize(jnp.float32)),
                                  np.asarray(quantized.dequantize(jnp.float32)))
    np.testing.assert_array_equal(
        np.asarray(get_format(format_name).dequantize(prepared, jnp.float32)),
        np.asarray(quantized.dequantize(jnp.float32)))
    # a pytree: flatten/unflatten and jit keep it a KernelLayoutWeight
    rebuilt = jax.jit(lambda w: w)(prepared)
    assert isinstance(rebuilt, KernelLayoutWeight) and rebuilt.tile_k == prepared.tile_k
    leaves_bitwise_equal(rebuilt, prepared)


def test_jit_runs_no_repack_and_weight_gets_zero_cotangents(interpret_kernels, monkeypatch):
    rng = np.random.default_rng(secrets.randbits(32))
    quantized = _weight("nvfp4", rng, n=192)  # N: a multiple of 64, not of 128
    prepared = to_kernel_layout(quantized)
    calls = []

    def counting(original):
        def wrapped(*args, **kwargs):
            calls.append(original.__name__)
            return original(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(bw, "to_plane_layout", counting(bw.to_plane_layout))
    monkeypatch.setattr(bw, "from_plane_layout", counting(bw.from_plane_layout))

    def loss(x, weight):
        return jnp.sum(linear(x, weight, compute_dtype=jnp.bfloat16).astype(jnp.float32) ** 2)

    for m in (3, 300):
        x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1), allow_int=True))(x, prepared))
        assert "pallas_call" in jaxpr
        grad_x, grad_weight = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(
            x, prepared)
        assert np.all(np.isfinite(np.asarray(grad_x, np.float32)))
        assert isinstance(grad_weight, KernelLayoutWeight)
        grad_x_ref = jax.jit(jax.grad(loss))(x, quantized)
        _assert_close(grad_x, grad_x_ref, 4 * TOLERANCE, f"grad x, M={m}")  # through y**2
        for leaf in jax.tree_util.tree_leaves(grad_weight):
            if leaf.dtype != jax.dtypes.float0:
                assert not np.any(np.asarray(leaf, np.float32))
    assert calls == [], f"repack/unpack ran while tracing the kernel path: {calls}"


def test_path_selection_by_m():
    """Per format the backends in the order dispatch asks them: on a GPU NVFP4's Mosaic GPU
    backend ahead of the Triton decode backend (none with mosaic_nvfp4 'off'), then the
    dequantize + XLA backend above the fused kernels' 64 rows."""
    assert select_matmul_path("nvfp4", 8, "cpu") == "xla"  # nothing registered for cpu
    for options in (KernelOptions(), KernelOptions(mosaic_nvfp4="off")):
        register_kernels("gpu", options)
        try:
            for format_name in FORMATS:
                fused, dequantize = kernel_names(format_name)
                first = (MosaicBackend.name if format_name == "nvfp4" and options.mosaic
                         else fused)
                assert [name for *_, name in registered_backends(format_name, "gpu")] == (
                    [first, fused, dequantize] if first != fused else [fused, dequantize])
                for m in (1, 16, 64):
                    assert select_matmul_path(format_name, m, "gpu") == first
                for m in (65, 256, 2048):
                    assert select_matmul_path(format_name, m, "gpu") == dequantize
            assert select_matmul_path("nvfp4", 8, "cpu") == "xla"
        finally:
            unregister_kernels("gpu")
    assert select_matmul_path("nvfp4", 8, "gpu") == "xla"
    with pytest.raises(ValueError, match="interpret=True"):
        register_kernels("cpu")


def test_fallbacks_take_the_xla_path_and_say_why(interpret_kernels, caplog):
    rng = np.random.default_rng(secrets.randbits(32))
    quantized = _weight("mxfp4", rng)
    prepared = to_kernel_layout(quantized)
    x = jnp.asarray(rng.standard_normal((4, K)), jnp.float32)
    with caplog.at_level(logging.INFO, logger="qerl_jax.quant.dispatch"):
        y32 = linear(x, prepared, compute_dtype=jnp.float32)
        linear(x, quantized, compute_dtype=jnp.bfloat16)
    assert "compute dtype float32" in caplog.text
    assert "checkpoint layout" in caplog.text
    np.testing.assert_array_equal(np.asarray(y32),
                                  np.asarray(linear(x, quantized, compute_dtype=jnp.float32)))


def test_fused_lora_epilogue_takes_a_given_lora_x_a(interpret_kernels):
    """linear(..., lora_x_a=x @ A) on a kernel-layout NVFP4 weight at decode M (the fused
    kernel's LoRA epilogue) gives linear(...)'s output bit for bit when the given x @ A is the
    one linear computes (bf16 dot, float32 accumulation)."""
    from qerl_jax.quant.linear_op import LoRAProduct
    rng = np.random.default_rng(secrets.randbits(32))
    prepared = to_kernel_layout(_weight("nvfp4", rng))
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.bfloat16)
    lora = LoRAProduct(jnp.asarray(rng.standard_normal((K, 16)) * 0.1, jnp.float32),
                       jnp.asarray(rng.standard_normal((16, N)) * 0.1, jnp.float32), 2.0)
    down = jnp.dot(x, lora.a.astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(linear(x, prepared, lora=lora, lora_x_a=down), np.float32),
        np.asarray(linear(x, prepared, lora=lora), np.float32))


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("m,rank", [(3, 8), (40, 32), (300, 16)])
def test_lora_epilogue_matches_separate_lora_dots(interpret_kernels, format_name, m, rank):
    """linear(..., lora=...) on a kernel-layout weight adds (x @ A) @ B in the fused kernel's
    epilogue for M <= 64 (and separately above): output and gradients w.r.t. x, A and B equal
    the XLA path's (checkpoint layout, separate LoRA dots) within the module's tolerance."""
    from qerl_jax.quant.linear_op import LoRAProduct
    rng = np.random.default_rng(secrets.randbits(32))
    quantized = _weight(format_name, rng)
    prepared = to_kernel_layout(quantized)
    x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(N) * 0.1, jnp.float32)
    a = jnp.asarray(rng.standard_normal((K, rank)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.standard_normal((rank, N)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, N)), jnp.bfloat16)

    def forward(x, a, b, weight):
        return linear(x, weight, bias, compute_dtype=jnp.bfloat16,
                      lora=LoRAProduct(a, b, 2.0))

    results = {}
    for name, weight in (("kernel", prepared), ("xla", quantized)):
        y, vjp = jax.vjp(functools.partial(forward, weight=weight), x, a, b)
        results[name] = (y, *vjp(dy))
    jaxpr = str(jax.make_jaxpr(functools.partial(forward, weight=prepared))(x, a, b))
    assert (f"{format_name}_matmul_lora" in jaxpr) == (m <= 64)  # the epilogue kernel
    for label, got, want in zip(("y", "dx", "dA", "dB"), results["kernel"], results["xla"]):
        _assert_close(got, want, 2 * TOLERANCE, f"{format_name} M={m} r={rank} {label}")



@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("m,with_lora", [(3, True), (16, False), (300, True)])
def test_linear_group_matches_single_linears(interpret_kernels, format_name, m, with_lora):
    """linear_group on q/k/v-like kernel-layout weights (different N, one K) runs them in one
    fused launch at M <= 64 (one by one above): outputs and gradients w.r.t. x, A and B equal
    the single XLA-path linears' (checkpoint layout) within the module's tolerance."""
    from qerl_jax.quant.linear_op import LoRAProduct, linear_group
    rng = np.random.default_rng(secrets.randbits(32))
    sizes = (N, 72, 72)
    quantized = [_weight(format_name, rng, n=n) for n in sizes]
    prepared = [to_kernel_layout(w) for w in quantized]
    x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
    biases = [jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32) for n in sizes]
    a = [jnp.asarray(rng.standard_normal((K, 8)) * 0.1, jnp.float32) for _ in sizes]
    b = [jnp.asarray(rng.standard_normal((8, n)) * 0.1, jnp.float32) for n in sizes]
    dys = [jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16) for n in sizes]

    def grouped(x, a, b, weights):
        loras = [LoRAProduct(ai, bi, 2.0) for ai, bi in zip(a, b)] if with_lora else None
        return linear_group(x, weights, biases, compute_dtype=jnp.bfloat16, loras=loras)

    def single(x, a, b, weights):
        return [linear(x, w, bias, compute_dtype=jnp.bfloat16,
                       lora=LoRAProduct(ai, bi, 2.0) if with_lora else None)
                for w, bias, ai, bi in zip(weights, biases, a, b)]

    ys, grads, ys_ref, grads_ref = _outputs_and_grads(
        functools.partial(grouped, weights=prepared),
        functools.partial(single, weights=quantized), (x, a, b), dys)
    jaxpr = str(jax.make_jaxpr(functools.partial(grouped, weights=prepared))(x, a, b))
    assert (f"{format_name}_matmul_group3" in jaxpr) == (m <= 64)
    context = f"{format_name} M={m} lora={with_lora}"
    for i in range(3):
        _assert_close(ys[i], ys_ref[i], 2 * TOLERANCE, f"{context} y{i}")
    _assert_lora_grads_close(grads, grads_ref, 3, with_lora, context)


@pytest.mark.parametrize("format_name,kwargs", [("nvfp4", {}), ("mxfp4", {}),
                                                ("nf4", {"double_quant": True})])
def test_gate_up_pair_views_share_one_copy_and_read_back_losslessly(format_name, kwargs):
    """pair_gate_up: the gate and up views hold the same two interleaved arrays (one copy of
    the pair, 2 N_pad rows) and each reads back, bit for bit, the weight it replaces
    (checkpoint view, dequantize, to_checkpoint; also through jit); what cannot pair says
    why."""
    rng = np.random.default_rng(secrets.randbits(32))
    quantized = [_weight(format_name, rng, n=136, k=192, **kwargs) for _ in range(2)]
    plain = [to_kernel_layout(w) for w in quantized]
    gate, up = kernel_layout.pair_gate_up(*plain)
    assert gate.kernel_codes is up.kernel_codes and gate.kernel_scales is up.kernel_scales
    assert gate.kernel_codes.shape[0] == 2 * plain[0].kernel_codes.shape[0]
    assert (gate.pair_view, up.pair_view) == ((32, 0), (32, 1))
    for view, original in zip((gate, up), quantized):
        leaves_bitwise_equal(view.to_checkpoint(), original)
        np.testing.assert_array_equal(np.asarray(view.dequantize(jnp.float32)),
                                      np.asarray(original.dequantize(jnp.float32)))
        rebuilt = jax.jit(lambda w: w)(view)
        assert isinstance(rebuilt, KernelLayoutWeight) and rebuilt.pair_view == view.pair_view
        leaves_bitwise_equal(rebuilt.to_checkpoint(), original)
    assert "pair_view=(32, 1)" in repr(up)
    assert "pair views already" in kernel_layout.pair_refusal(gate, up)
    assert "kernel layout" in kernel_layout.pair_refusal(quantized[0], plain[1])
    other = to_kernel_layout(_weight(format_name, rng, n=72, k=192, **kwargs))
    with pytest.raises(ValueError, match="differ in format, shape or layout"):
        kernel_layout.pair_gate_up(plain[0], other)


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("m,with_lora", [(3, True), (16, False), (64, True), (300, True)])
def test_fused_swiglu_of_pair_views_matches_the_unfused_mlp(interpret_kernels, format_name, m,
                                                             with_lora, caplog):
    """linear_swiglu on gate/up pair views: at M <= 64 one launch over the pair with the SwiGLU
    in its epilogue, above it each view through the dequantize path, then the SwiGLU. Output
    and gradients w.r.t. x, A and B against the unfused SwiGLU of the single XLA-path linears
    (checkpoint layout), within twice the module's tolerance (a product of two products)."""
    from qerl_jax.models.layers import swiglu
    from qerl_jax.quant.linear_op import LoRAProduct
    from qerl_jax.quant.linear_swiglu import linear_swiglu
    rng = np.random.default_rng(secrets.randbits(32))
    quantized = [_weight(format_name, rng) for _ in range(2)]
    views = kernel_layout.pair_gate_up(*(to_kernel_layout(w) for w in quantized))
    x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
    a = [jnp.asarray(rng.standard_normal((K, 8)) * 0.1, jnp.float32) for _ in range(2)]
    b = [jnp.asarray(rng.standard_normal((8, N)) * 0.1, jnp.float32) for _ in range(2)]
    dy = jnp.asarray(rng.standard_normal((m, N)), jnp.bfloat16)

    def fused(x, a, b, weights):
        loras = [LoRAProduct(ai, bi, 2.0) for ai, bi in zip(a, b)] if with_lora else None
        return linear_swiglu(x, weights, (None, None), activation=swiglu,
                             compute_dtype=jnp.bfloat16, loras=loras)

    def unfused(x, a, b, weights):
        return swiglu(*(linear(x, w, compute_dtype=jnp.bfloat16,
                               lora=LoRAProduct(ai, bi, 2.0) if with_lora else None)
                        for w, ai, bi in zip(weights, a, b)))

    with caplog.at_level(logging.INFO, logger="qerl_jax.quant.dispatch"):
        y, grads, y_ref, grads_ref = _outputs_and_grads(
            functools.partial(fused, weights=views),
            functools.partial(unfused, weights=quantized), (x, a, b), dy)
    jaxpr = str(jax.make_jaxpr(functools.partial(fused, weights=views))(x, a, b))
    assert (f"{format_name}_matmul_swiglu" in jaxpr) == (m <= 64)
    assert (f"{format_name}_fused fused SwiGLU path" in caplog.text) == (m <= 64)
    context = f"{format_name} M={m} lora={with_lora}"
    _assert_close(y, y_ref, 2 * TOLERANCE, f"{context} y")
    _assert_lora_grads_close(grads, grads_ref, 2, with_lora, context)


@pytest.mark.parametrize("format_name", ["nvfp4", "nf4"])
def test_fused_swiglu_also_computes_the_next_lora_x_a(interpret_kernels, format_name):
    """linear_swiglu(next_lora_a=A_down) at decode M: the same output bit for bit, and
    output @ A_down from the launch (within one bf16 rounding of the float32 product of the
    bf16 output and A); gradients (x, A, B of gate/up, A_down) against the same fused SwiGLU
    followed by an XLA dot, within twice the module's tolerance. Above the fused M the product
    is None (the caller computes it)."""
    from qerl_jax.models.layers import swiglu
    from qerl_jax.quant.linear_op import LoRAProduct
    from qerl_jax.quant.linear_swiglu import linear_swiglu
    rng = np.random.default_rng(secrets.randbits(32))
    views = kernel_layout.pair_gate_up(*(to_kernel_layout(_weight(format_name, rng))
                                           for _ in range(2)))
    m = 3
    x = jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16)
    a = [jnp.asarray(rng.standard_normal((K, 8)) * 0.1, jnp.float32) for _ in range(2)]
    b = [jnp.asarray(rng.standard_normal((8, N)) * 0.1, jnp.float32) for _ in range(2)]
    a_next = jnp.asarray(rng.standard_normal((N, 8)) * 0.1, jnp.float32)

    def run(x, a, b, a_next, next_lora=True):
        loras = [LoRAProduct(ai, bi, 2.0) for ai, bi in zip(a, b)]
        return linear_swiglu(x, views, (None, None), activation=swiglu,
                             compute_dtype=jnp.bfloat16, loras=loras,
                             next_lora_a=a_next if next_lora else None)

    def reference(x, a, b, a_next):
        y = run(x, a, b, a_next, next_lora=False)
        return y, jnp.dot(y, a_next.astype(jnp.bfloat16), preferred_element_type=jnp.float32
                          ).astype(jnp.bfloat16)

    cotangents = (jnp.asarray(rng.standard_normal((m, N)), jnp.bfloat16),
                  jnp.asarray(rng.standard_normal((m, 8)), jnp.bfloat16))
    (y, next_down), grads, (y_ref, next_ref), grads_ref = _outputs_and_grads(
        run, reference, (x, a, b, a_next), cotangents)
    assert "matmul_swiglu_lora_next" in str(jax.make_jaxpr(run)(x, a, b, a_next))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    assert next_down.shape == (m, 8) and next_down.dtype == jnp.bfloat16
    _assert_close(next_down, next_ref, 2.0 ** -7, f"{format_name} next_down")
    context = f"{format_name} next_lora_a"
    _assert_lora_grads_close(grads, grads_ref, 2, True, context)
    _assert_close(grads[3], grads_ref[3], 2 * TOLERANCE, f"{context} dA_next")
    x_large = jnp.asarray(rng.standard_normal((300, K)), jnp.bfloat16)
    y_large, none = run(x_large, a, b, a_next)
    assert none is None
    np.testing.assert_array_equal(np.asarray(y_large, np.float32),
                                  np.asarray(run(x_large, a, b, a_next, next_lora=False),
                                             np.float32))


def test_fused_swiglu_needs_one_pair_and_falls_back_otherwise(interpret_kernels, caplog):
    """Separate weights, views of two different pairs and different LoRA scales take the
    unfused path (saying why); with the prepared pair B (prepare_swiglu_lora_b) the fused
    launch gives bit for bit what it gives when it builds B itself."""
    from qerl_jax.models.layers import swiglu
    from qerl_jax.quant.linear_op import LoRAProduct
    from qerl_jax.quant.linear_swiglu import linear_swiglu, prepare_swiglu_lora_b
    rng = np.random.default_rng(secrets.randbits(32))
    plain = [to_kernel_layout(_weight("nvfp4", rng)) for _ in range(4)]
    first, second = (kernel_layout.pair_gate_up(*plain[i:i + 2]) for i in (0, 2))
    x = jnp.asarray(rng.standard_normal((2, K)), jnp.bfloat16)
    loras = [LoRAProduct(jnp.asarray(rng.standard_normal((K, 4)) * 0.1, jnp.float32),
                         jnp.asarray(rng.standard_normal((4, N)) * 0.1, jnp.float32), s)
             for s in (2.0, 2.0)]

    def run(weights, loras=None, pair_lora_b=None):
        return linear_swiglu(x, weights, (None, None), activation=swiglu,
                             compute_dtype=jnp.bfloat16, loras=loras, pair_lora_b=pair_lora_b)

    with caplog.at_level(logging.INFO, logger="qerl_jax.quant.dispatch"):
        run(plain[:2])
        run((first[0], second[1]))
        run(first, [loras[0], dataclasses.replace(loras[1], scale=1.0)])
    assert "separate weights" in caplog.text
    assert "two different pairs" in caplog.text
    assert "different LoRA scales" in caplog.text
    prepared = prepare_swiglu_lora_b(first, loras)
    assert prepared is not None and prepared.shape == (32, 2 * 256)
    assert prepare_swiglu_lora_b(plain[:2], loras) is None
    np.testing.assert_array_equal(np.asarray(run(first, loras, prepared), np.float32),
                                  np.asarray(run(first, loras), np.float32))


def test_linear_group_runs_one_by_one_where_it_cannot_group(interpret_kernels, caplog):
    """Dense weights (bit for bit the single linears), mixed formats and mixed LoRA fall back to
    one linear per weight, and the log says why."""
    from qerl_jax.quant.linear_op import LoRAProduct, linear_group
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, K)), jnp.float32)
    dense = [jnp.asarray(rng.standard_normal((K, n)) * 0.05, jnp.float32) for n in (N, 72)]
    got = linear_group(x, dense, (None, None), compute_dtype=jnp.float32)
    for g, w in zip(got, dense):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(linear(x, w, None,
                                                                        compute_dtype=jnp.float32)))
    mixed = [to_kernel_layout(_weight("nvfp4", rng)), to_kernel_layout(_weight("nf4", rng, n=72))]
    with caplog.at_level(logging.INFO, logger="qerl_jax.quant.dispatch"):
        jax.make_jaxpr(lambda x: linear_group(x, mixed, (None, None)))(x)
        one_lora = (LoRAProduct(jnp.zeros((K, 4)), jnp.zeros((4, N)), 1.0), None)
        same = [to_kernel_layout(_weight("nvfp4", rng)), to_kernel_layout(_weight("nvfp4", rng))]
        jax.make_jaxpr(lambda x: linear_group(x, same, (None, None), loras=one_lora))(x)
    assert "mixed formats" in caplog.text and "LoRA on some weights only" in caplog.text
    with pytest.raises(ValueError, match="must match"):
        linear_group(x, dense, (None,))
