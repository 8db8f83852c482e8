"""The linear op on QuantizedWeights: forward equals the dense op on the dequantized weight,
the custom-VJP x-gradient equals jax.grad of that dense reference, the weight gets zero
cotangents, only the QuantizedWeight is saved for the backward pass, and the kernel dispatch
(qerl_jax/quant/dispatch.py) asks the backends of (format, platform) in order, falls through a
refusal to the next one and logs its choice and the refusals once.

Tolerances: the quantized path and the dense reference run the same dot on the same
compute-dtype operands, differing only in float32 accumulation order (the dense reference
contracts a pre-transposed [K, N] weight): |diff| <= 1e-5 * max|ref| before the final cast,
i.e. at most one ulp of the output dtype (bf16: 2^-8 relative, f32: 1e-5 relative).
"""

import logging
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.quant.backends.xla import XlaBackend, xla_backward, xla_forward
from qerl_jax.quant.dispatch import (register_backend, registered_backends, select_matmul_path,
                                     unregister_backend, unregister_backends)
from qerl_jax.quant.formats import get_format
from qerl_jax.quant.linear_op import linear, quantized_matmul

FORMATS = ["nvfp4", "mxfp4", "nf4"]
TOLERANCE = {jnp.bfloat16: 2.0 ** -8, jnp.float32: 1e-5}


def _problem(format_name, dtype=jnp.bfloat16, in_features=256, out_features=96):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    weight = jnp.asarray(rng.standard_normal((out_features, in_features)) * 0.05, dtype)
    x = jnp.asarray(rng.standard_normal((2, 5, in_features)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((out_features,)) * 0.1, dtype)
    quantized = get_format(format_name).quantize(weight, name="test.proj")
    return quantized, x, bias, seed


def _assert_close(actual, expected, compute_dtype, context):
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    scale = np.abs(expected).max()
    assert np.abs(actual - expected).max() <= TOLERANCE[compute_dtype] * scale, context


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float32])
def test_forward_and_gradient_equal_dense_reference(format_name, compute_dtype):
    quantized, x, bias, seed = _problem(format_name)
    dense_in_out = get_format(format_name).dequantize(quantized, jnp.float32).T  # [in, out]

    def quantized_loss(x):
        return jnp.sum(linear(x, quantized, bias, compute_dtype=compute_dtype)
                       .astype(jnp.float32) ** 2)

    def dense_loss(x):
        return jnp.sum(linear(x, dense_in_out, bias, compute_dtype=compute_dtype)
                       .astype(jnp.float32) ** 2)

    context = f"{format_name} {compute_dtype.__name__} seed {seed}"
    out = jax.jit(lambda x: linear(x, quantized, bias, compute_dtype=compute_dtype))(x)
    assert out.shape == (2, 5, 96) and out.dtype == compute_dtype
    _assert_close(out, linear(x, dense_in_out, bias, compute_dtype=compute_dtype),
                  compute_dtype, context)
    grad = jax.jit(jax.grad(quantized_loss))(x)
    assert grad.shape == x.shape and grad.dtype == x.dtype
    _assert_close(grad, jax.grad(dense_loss)(x), compute_dtype, context)


@pytest.mark.parametrize("format_name", FORMATS)
def test_weight_gets_zero_cotangents_and_only_it_is_saved(format_name):
    quantized, x, _, _ = _problem(format_name)
    grads = jax.grad(lambda q: jnp.sum(linear(x, q).astype(jnp.float32)), allow_int=True)(
        quantized)
    for leaf in jax.tree_util.tree_leaves(grads):
        assert leaf.dtype == jax.dtypes.float0 or not np.asarray(leaf, np.float32).any()
    # residuals of the VJP: exactly the QuantizedWeight's arrays (no dense copy of W, no x)
    _, vjp_fn = jax.vjp(lambda x: linear(x, quantized), x)
    saved = jax.tree_util.tree_leaves(vjp_fn)
    expected = jax.tree_util.tree_leaves(quantized)
    assert sorted((a.shape, str(a.dtype)) for a in saved) == sorted(
        (a.shape, str(a.dtype)) for a in expected)


def test_backward_dequantizes_again_instead_of_keeping_a_dense_copy():
    """A jitted forward+backward dequantizes twice (once per pass), the first behind an
    optimization barrier on (x, weight) (so it is not scheduled before its layer's input
    exists), the second behind one on (cotangent, weight), the mechanism jax.checkpoint uses
    against CSE. XLA:GPU expands barriers only after scheduling, so the two dequantizations stay apart
    there and no dense W lives from the forward to the backward pass; XLA:CPU expands them
    before a late CSE and may merge the two (checked here: the barrier is in the program)."""
    quantized, x, _, _ = _problem("nvfp4")
    calls = []
    original = get_format("nvfp4").dequantize

    def counting_dequantize(q, dtype=None):
        calls.append(dtype)
        return original(q, dtype)

    def loss(x, weight):
        return jnp.sum(linear(x, weight).astype(jnp.float32) ** 2)

    try:
        object.__setattr__(get_format("nvfp4"), "dequantize", counting_dequantize)
        lowered = jax.jit(jax.value_and_grad(loss)).lower(x, quantized)
    finally:
        object.__setattr__(get_format("nvfp4"), "dequantize", original)
    assert len(calls) == 2

    def barriers(function, *args):
        return jax.jit(function).lower(*args).as_text().count("optimization_barrier")

    in_dequantize = barriers(lambda q: q.dequantize(jnp.bfloat16), quantized)
    # the forward: the barrier on (x, weight) that keeps the dequantization after x exists
    assert barriers(loss, x, quantized) == in_dequantize + 1
    # forward + backward: each pass's dequantization, the forward's barrier on (x, weight) and
    # the backward's on (cotangent, weight)
    assert lowered.as_text().count("optimization_barrier") == 2 * in_dequantize + 2


def test_dispatch_defaults_to_xla_and_honours_registered_kernels(caplog, monkeypatch):
    from qerl_jax.quant import dispatch
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    quantized, x, _, _ = _problem("nvfp4")
    assert select_matmul_path("nvfp4", 1, "cpu") == "xla"
    assert select_matmul_path("nf4", 4096, "gpu") == "xla"
    kernel_calls = []

    class FakeSmallM(XlaBackend):
        name, max_m = "fake_small_m", 8

        def apply(self, x2d, weight, *, compute_dtype):
            kernel_calls.append(x2d.shape)
            return xla_forward(x2d, weight, compute_dtype=compute_dtype)

    register_backend("nvfp4", "cpu", FakeSmallM())
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_backend("nvfp4", "cpu", FakeSmallM())
        assert select_matmul_path("nvfp4", 8, "cpu") == "fake_small_m"
        assert select_matmul_path("nvfp4", 9, "cpu") == "xla"
        assert select_matmul_path("mxfp4", 8, "cpu") == "xla"
        with caplog.at_level(logging.INFO, logger="qerl_jax.quant.dispatch"):
            small = linear(x[:1, :4], quantized)  # M = 4: the kernel
            linear(x[:1, :4], quantized)
            large = linear(x, quantized)  # M = 10: XLA
            linear(x, get_format("mxfp4").quantize(jnp.ones((96, 256)), name="w"))
        assert kernel_calls == [(4, 256), (4, 256)]
        messages = [record.getMessage() for record in caplog.records]
        assert sum("fake_small_m path" in m for m in messages) == 1, messages  # logged once
        assert any("at M=10: xla path (dequantize then XLA dot); no kernel takes M=10 "
                   "(fake_small_m takes M in [1, 8])" in m for m in messages), messages
        assert any("mxfp4 matmul on cpu at M=10: xla path (dequantize then XLA dot); no "
                   "compiled 4-bit kernel for mxfp4 on cpu" in m for m in messages), messages
        np.testing.assert_array_equal(np.asarray(small, np.float32),
                                      np.asarray(large[:1, :4], np.float32))
    finally:
        unregister_backend("nvfp4", "cpu", "fake_small_m")
    assert select_matmul_path("nvfp4", 4, "cpu") == "xla"


def test_dispatch_falls_through_a_refusal_to_the_next_backend(caplog, monkeypatch):
    """The first backend that refuses the weight hands the launch to the next one registered
    (not to XLA); the log names the path taken and the refusal in words, once; with every
    backend refusing, XLA runs. registered_backends lists them in the order asked;
    unregister_backends removes a format's backends."""
    from qerl_jax.quant import dispatch
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    quantized, x, _, _ = _problem("nvfp4")
    calls = []

    class Refusing(XlaBackend):
        name, description = "first_choice", "a kernel that wants another layout"

        def refusal(self, weight, compute_dtype):
            return "the weight is not in its layout"

        def apply(self, x2d, weight, *, compute_dtype):
            raise AssertionError("a refusing backend ran")

    class Second(XlaBackend):
        name, description, refuse = "second_choice", "a second kernel", False

        def launch_refusal(self, weight, lora_rank):
            return "it is switched off" if Second.refuse else None

        def apply(self, x2d, weight, *, compute_dtype):
            calls.append(self.name)
            return xla_forward(x2d, weight, compute_dtype=compute_dtype)

    register_backend("nvfp4", "cpu", Refusing())
    register_backend("nvfp4", "cpu", Second())
    try:
        assert registered_backends("nvfp4", "cpu") == [("nvfp4", "cpu", "first_choice"),
                                                       ("nvfp4", "cpu", "second_choice")]
        assert select_matmul_path("nvfp4", 3, "cpu") == "first_choice"  # asked first
        with caplog.at_level(logging.INFO, logger="qerl_jax.quant.dispatch"):
            y = linear(x[:1, :3], quantized)
            linear(x[:1, :3], quantized)
            Second.refuse = True
            y_xla = linear(x[:1, :3], quantized)
        assert calls == ["second_choice", "second_choice"]
        messages = [record.getMessage() for record in caplog.records]
        assert messages.count("nvfp4 matmul on cpu at M=3: second_choice path (a second "
                              "kernel); first_choice refused: the weight is not in its "
                              "layout") == 1, messages
        assert any("xla path" in m and "second_choice refused: it is switched off" in m
                   for m in messages), messages
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_xla, np.float32))
    finally:
        assert sorted(unregister_backends("nvfp4", "cpu")) == ["first_choice/cpu",
                                                              "second_choice/cpu"]
    assert registered_backends("nvfp4", "cpu") == []


def test_registered_backward_kernel_is_used():
    quantized, x, _, _ = _problem("mxfp4")
    used = []

    class FakeWithGrad(XlaBackend):
        name = "fake_with_grad"

        def apply_backward(self, grad_output, weight, *, compute_dtype):
            used.append(grad_output.shape)
            return xla_backward(grad_output, weight, compute_dtype=compute_dtype)

    register_backend("mxfp4", "cpu", FakeWithGrad())
    try:
        grad = jax.grad(lambda x: jnp.sum(linear(x, quantized).astype(jnp.float32)))(x)
    finally:
        unregister_backend("mxfp4", "cpu", "fake_with_grad")
    assert used == [(10, 96)] and grad.shape == x.shape


def test_shape_mismatch_and_dense_path_unchanged():
    quantized, x, _, _ = _problem("nf4")
    with pytest.raises(ValueError, match=r"x has 128 features.*nf4 weight is \[out=96, in=256\]"):
        quantized_matmul(x[..., :128], quantized)
    dense = jnp.asarray(np.random.default_rng(0).standard_normal((256, 96)), jnp.float32)
    expected = jnp.dot(x.astype(jnp.bfloat16), dense.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(linear(x, dense), np.float32),
                                  np.asarray(expected, np.float32))


def test_dense_bf16_backward_stays_in_bf16():
    """A dense bf16 weight's backward (narrow_matmul): dx equals the float64 product of the
    cotangent rounded to bf16 with the weight (tolerance 2 bf16 ulps of the output scale), and
    the gradient program holds no float32 copy of the weight (what autodiff alone makes:
    259 MiB per Qwen2.5-7B MLP projection). A float32 weight keeps the plain dot's autodiff,
    bit for bit."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((3, 5, 24)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((24, 40)) * 0.1, jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((3, 5, 40)), jnp.bfloat16)

    def loss(x, weight):
        return jnp.sum(linear(x, weight).astype(jnp.float32) * cotangent.astype(jnp.float32))

    grad_x = jax.grad(loss)(x, weight)
    expected = (np.asarray(cotangent.astype(jnp.float32), np.float64)
                @ np.asarray(weight.astype(jnp.float32), np.float64).T)
    np.testing.assert_allclose(np.asarray(grad_x.astype(jnp.float32), np.float64), expected,
                               rtol=0, atol=2 * 2.0 ** -8 * np.abs(expected).max())
    weight_f32 = "tensor<24x40xf32>"
    assert weight_f32 not in jax.jit(jax.grad(loss)).lower(x, weight).as_text()

    def plain_loss(x, weight):
        y = jnp.dot(x, weight, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

    assert weight_f32 in jax.jit(jax.grad(plain_loss)).lower(x, weight).as_text()  # the copy
    x32, w32 = x.astype(jnp.float32), weight.astype(jnp.float32)
    ours = jax.grad(lambda x: jnp.sum(linear(x, w32, compute_dtype=jnp.float32)))(x32)
    plain = jax.grad(lambda x: jnp.sum(jnp.dot(x, w32, preferred_element_type=jnp.float32)))(x32)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))


def test_linear_lora_matches_float64_and_names_bad_shapes():
    """linear(x, W, b, lora=LoRAProduct(A, B, s)) = x W + b + s (x A) B for a dense float32 W
    and for an NVFP4 W (XLA path, against its dequantized matrix), float64 numpy reference;
    float32 compute: rtol 1e-5, atol 1e-5. Mismatched adapter shapes name both shapes."""
    from qerl_jax.quant.linear_op import LoRAProduct
    rng = np.random.default_rng(secrets.randbits(32))
    x = rng.standard_normal((2, 3, 32))
    dense = rng.standard_normal((32, 48)) * 0.1
    bias = rng.standard_normal(48) * 0.1
    a, b = rng.standard_normal((32, 4)) * 0.1, rng.standard_normal((4, 48)) * 0.1
    lora = LoRAProduct(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 0.5)
    quantized = get_format("nvfp4").quantize(jnp.asarray(dense.T, jnp.float32), name="t.proj")
    for weight, matrix in ((jnp.asarray(dense, jnp.float32), dense),
                           (quantized, np.asarray(quantized.dequantize(jnp.float32),
                                                  np.float64).T)):
        y = linear(jnp.asarray(x, jnp.float32), weight, jnp.asarray(bias, jnp.float32),
                   compute_dtype=jnp.float32, lora=lora)
        expected = x @ matrix + bias + 0.5 * (x @ a) @ b
        np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
        # x @ A made elsewhere (the decode attention's combine kernel): the same result
        x_a = jnp.asarray(x @ a, jnp.float32)
        given = linear(jnp.asarray(x, jnp.float32), weight, jnp.asarray(bias, jnp.float32),
                       compute_dtype=jnp.float32, lora=lora, lora_x_a=x_a)
        np.testing.assert_allclose(np.asarray(given), expected, rtol=1e-5, atol=1e-5)
    bad = LoRAProduct(jnp.zeros((32, 4)), jnp.zeros((5, 48)), 1.0)
    with pytest.raises(ValueError, match=r"LoRA A \(32, 4\) and B \(5, 48\)"):
        linear(jnp.asarray(x, jnp.float32), jnp.asarray(dense, jnp.float32), lora=bad,
               compute_dtype=jnp.float32)
    for wrong in (dict(lora=None, lora_x_a=x_a), dict(lora=lora, lora_x_a=x_a[:, :2])):
        with pytest.raises(ValueError, match="lora_x_a"):
            linear(jnp.asarray(x, jnp.float32), jnp.asarray(dense, jnp.float32),
                   compute_dtype=jnp.float32, **wrong)


def test_dense_weights_of_the_backends():
    """MatmulBackend.dense: None for a backend that makes no dense weight (the default); the
    XLA backend's is the weight's dequantize; a RowShardedBackend's is its inner backend's
    (the weights on its meshes are replicated)."""
    from qerl_jax.quant.backends.base import MatmulBackend
    from qerl_jax.parallel.sharded_backend import RowShardedBackend
    from qerl_jax.quant.backends.xla import XLA
    from qerl_jax.quant.nvfp4 import nvfp4_quantize

    weight = nvfp4_quantize(jax.random.normal(jax.random.key(0), (32, 64)))
    assert MatmulBackend().dense(weight, compute_dtype=jnp.bfloat16) is None
    np.testing.assert_array_equal(np.asarray(XLA.dense(weight, compute_dtype=jnp.bfloat16)),
                                  np.asarray(weight.dequantize(jnp.bfloat16)))
    sharded = RowShardedBackend(XLA, mesh=None)
    np.testing.assert_array_equal(np.asarray(sharded.dense(weight, compute_dtype=jnp.bfloat16)),
                                  np.asarray(weight.dequantize(jnp.bfloat16)))
    assert RowShardedBackend(MatmulBackend(), mesh=None).dense(
        weight, compute_dtype=jnp.bfloat16) is None
