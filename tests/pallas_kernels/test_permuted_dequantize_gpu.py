"""The NVFP4 dequantize from the Mosaic GPU permuted layout, compiled on the GPU (`pytest -m
gpu`): bit for bit the compiled kernel-layout dequantize (blockwise_dequantize) of the same
weight at Qwen2.5-7B/14B shapes, for a group member at its line of the stacked q|k|v buffer and
for the two views of a gate/up pair. The same in interpret mode: test_permuted_dequantize.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import mgpu_nvfp4_layout as layout
from pallas_kernels import nvfp4_matmul
from pallas_kernels.permuted_dequantize import permuted_dequantize
from tests.pallas_kernels import kernel_checks as kc

pytestmark = pytest.mark.gpu


def _bits(w) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint16))


def _kernel_layout_dequantize(packed):
    return bw.blockwise_dequantize(packed, spec=nvfp4_matmul.NVFP4)


@pytest.mark.parametrize("n,k", [(3584, 3584), (3584, 18944), (7168, 5120)],
                         ids=["7b_q", "7b_down", "14b_qkv"])
def test_matches_the_kernel_layout_dequantize_bit_for_bit(n, k):
    _, packed = kc.nvfp4_packed(n, k, seed=n + k, zero_rows=n // 3)
    permuted = layout.permute_packed(packed)
    got = permuted_dequantize(permuted, packed.tensor_scale, n=n, k=k)
    want = _kernel_layout_dequantize(packed)
    assert got.shape == (n, k) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # the second member of a two-weight group buffer, read at its line
    stacked = jnp.concatenate([layout.permute_packed(kc.nvfp4_packed(n, k, seed=1)[1]), permuted])
    again = permuted_dequantize(stacked, packed.tensor_scale, n=n, k=k, line=permuted.shape[0])
    np.testing.assert_array_equal(_bits(again), _bits(want))


def test_gate_up_pair_views():
    """Each half of a 14B-size gate/up pair (27648 x 5120, blocks of 32 rows) read from the
    pair's permuted buffer, as the kernel-layout dequantize of the pair view."""
    n, k, half_block = 27648, 5120, 32
    gate, up = (kc.nvfp4_packed(n, k, seed=seed)[1] for seed in (3, 4))
    pair = bw.interleave_gate_up(gate, up, half_block)
    buffer = layout.permute_packed(pair)
    for half, weight in enumerate((gate, up)):
        view = bw.pair_view_of(pair, half, n=n, tensor_scale=weight.tensor_scale,
                               half_block=half_block)
        got = permuted_dequantize(buffer, weight.tensor_scale, n=n, k=k,
                                  pair_view=(half_block, half))
        np.testing.assert_array_equal(_bits(got), _bits(_kernel_layout_dequantize(view)))
