"""The NVFP4 dequantize from the Mosaic GPU kernel's permuted layout
(pallas_kernels/permuted_dequantize.py, interpret mode): bit for bit the kernel-layout
dequantize (blockwise_dequantize) of the same weight, and within float32 rounding of a float64
reference from the checkpoint arrays; for group members at their lines and for gate/up pair
views; and it lowers to a Triton kernel for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import mgpu_nvfp4_layout as layout
from pallas_kernels import nvfp4_matmul
from pallas_kernels.permuted_dequantize import permuted_dequantize
from tests.pallas_kernels import kernel_checks as kc


def _bits(w) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint16))


@pytest.mark.parametrize("n,k", [(200, 608), (64, 256), (96, 320)])
def test_matches_the_kernel_layout_dequantize_bit_for_bit(n, k):
    q, packed = kc.nvfp4_packed(n, k, n + k, zero_rows=n // 3)
    permuted = layout.permute_packed(packed)
    got = permuted_dequantize(permuted, packed.tensor_scale, n=n, k=k, interpret=True)
    want = bw.blockwise_dequantize(packed, spec=nvfp4_matmul.NVFP4, interpret=True)
    assert got.shape == (n, k) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # and the values: float32 products (exact) times 1 / tensor scale, one bf16 rounding
    np.testing.assert_allclose(np.asarray(got, np.float64), kc.nvfp4_float64_weights(q),
                               rtol=2.0 ** -8, atol=0)
    # a group member at its line of the group's buffer
    stacked = jnp.concatenate([permuted, permuted])
    again = permuted_dequantize(stacked, packed.tensor_scale, n=n, k=k, line=permuted.shape[0],
                                interpret=True)
    np.testing.assert_array_equal(_bits(again), _bits(want))


def test_pair_views_read_their_half_of_each_block():
    """A gate/up pair view (pair_view (32, half) of the interleaved pair's buffer) gives its
    own weight, as the kernel-layout dequantize of the view does."""
    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    from qerl_jax.model_quant.kernel_setup import enable_kernels
    from qerl_jax.quant.kernel_registry import unregister_kernels
    from qerl_jax.model_quant.quantize import quantize_model
    model = init_model(tiny_qwen2(param_dtype="bfloat16", compute_dtype="bfloat16",
                                  num_hidden_layers=1), seed=0)   # the views of one layer
    quantize_model(model, "nvfp4")
    try:
        enable_kernels(model, platform="cpu", interpret=True, tile_k=256)
        mlp = model.layers[0].mlp
        for proj in (mlp.gate_proj, mlp.up_proj):
            view = proj.weight.get_value()
            assert view.pair_view is not None
            buffer = layout.permute_packed(view.whole_pair())
            got = permuted_dequantize(buffer, view.kernel_tensor_scale(), n=view.shape[0],
                                      k=view.shape[1], pair_view=view.pair_view,
                                      interpret=True)
            want = bw.blockwise_dequantize(view.packed(), spec=view.spec, interpret=True)
            np.testing.assert_array_equal(_bits(got), _bits(want))
    finally:
        unregister_kernels("cpu")


def test_bad_input_names_the_argument():
    _, packed = kc.nvfp4_packed(64, 256, 1)
    permuted = layout.permute_packed(packed)
    with pytest.raises(ValueError, match="uint8"):
        permuted_dequantize(permuted.astype(jnp.int32), packed.tensor_scale, n=64, k=256)
    with pytest.raises(ValueError, match="lines"):
        permuted_dequantize(permuted, packed.tensor_scale, n=64, k=256, line=73)
    with pytest.raises(ValueError, match="pair_view"):
        permuted_dequantize(permuted, packed.tensor_scale, n=32, k=256, pair_view=(16, 0))


def test_lowers_for_cuda():
    """Lowered for CUDA on this CPU machine: one Triton custom call (compiled and checked
    against the kernel-layout dequantize on the GPU: test_permuted_dequantize_gpu.py)."""
    _, packed = kc.nvfp4_packed(128, 512, 2)
    permuted = layout.permute_packed(packed)
    lowered = jax.jit(lambda p, s: permuted_dequantize(p, s, n=128, k=512)).trace(
        permuted, packed.tensor_scale).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()
