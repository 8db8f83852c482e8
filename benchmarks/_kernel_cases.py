"""The cases of the kernel benchmarks (benchmarks/kernels.py, profile/) and of the Triton kernels'
GPU test (tests/pallas_kernels/test_blockwise_matmul_gpu.py): the layer shapes, random
checkpoint-layout weights of each 4-bit format, their kernel-layout repacks, the jnp references
and the error check of a measured launch against them."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import mxfp4_matmul, nf4_matmul, nvfp4_matmul  # noqa: E402

# (name, N, K) per model; y[M, N] = x[M, K] @ W^T.
SHAPES = {
    "7b": [("q", 3584, 3584), ("k/v", 512, 3584), ("o", 3584, 3584), ("gate/up", 18944, 3584),
           ("down", 3584, 18944), ("qkv", 4608, 3584), ("gate|up", 37888, 3584)],
    "32b": [("q/o", 5120, 5120), ("k/v", 1024, 5120), ("gate/up", 27648, 5120),
            ("down", 5120, 27648), ("qkv", 7168, 5120), ("gate|up", 55296, 5120)],
}
FORMATS = ("nvfp4", "mxfp4", "nf4")
MODULES = {"nvfp4": nvfp4_matmul, "mxfp4": mxfp4_matmul, "nf4": nf4_matmul}
SPECS = {"nvfp4": nvfp4_matmul.NVFP4, "mxfp4": mxfp4_matmul.MXFP4, "nf4": nf4_matmul.NF4}


# ----------------------------------------------------------------------------------------------
# Random checkpoint-layout weights (never zeros: real-looking codes and scales)


def random_checkpoint(fmt, n, k, key):
    kc, ks, kt = jax.random.split(key, 3)
    codes = jax.random.bits(kc, (n, k // 2), jnp.uint8)
    if fmt == "nvfp4":
        # the whole e4m3 range in use (subnormals below 2^-6 included) and ~1/64 zero scales
        ks, kz = jax.random.split(ks)
        scales = 2.0 ** jax.random.uniform(ks, (n, k // 16), minval=-9, maxval=8)
        scales = jnp.where(jax.random.bernoulli(kz, 1 / 64, scales.shape), 0.0, scales)
        scales = scales.astype(jnp.float8_e4m3fn)
        return codes, scales, jax.random.uniform(kt, (), minval=50, maxval=500)
    if fmt == "mxfp4":
        return codes, jax.random.randint(ks, (n, k // 32), 112, 132).astype(jnp.uint8)
    return codes, jax.random.uniform(ks, (n, k // 64), minval=0.01, maxval=0.5)


def repack(fmt, ckpt, tile_k=256):
    if fmt == "nvfp4":
        return nvfp4_matmul.repack_nvfp4(*ckpt, tile_k=tile_k)
    if fmt == "mxfp4":
        return mxfp4_matmul.repack_mxfp4(*ckpt, tile_k=tile_k)
    return nf4_matmul.repack_nf4(*ckpt, tile_k=tile_k)


def reference(fmt, x, ckpt):
    return getattr(MODULES[fmt], f"{fmt}_matmul_reference")(x, *ckpt)


def reference_transposed(fmt, dy, ckpt):
    return getattr(MODULES[fmt], f"{fmt}_matmul_transposed_reference")(dy, *ckpt)


def naive_nvfp4_matmul(x, codes, scales, tensor_scale):
    """The plain XLA path: dequantize NVFP4 with jnp to bf16, then an XLA dot."""
    w = nvfp4_matmul.nvfp4_dequantize_reference(codes, scales, tensor_scale).astype(jnp.bfloat16)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def packed_bytes(n, k, fmt):
    return n * k // 2 + n * k // {"nvfp4": 16, "mxfp4": 32, "nf4": 16}[fmt]  # nf4: f32 per 64


def copies(tree, count):
    """`count` copies of a weight tree in distinct buffers (a timing loop over them reads each
    from memory, not from L2)."""
    return [tree] + [jax.tree.map(lambda a: a.copy(), tree) for _ in range(count - 1)]


# ----------------------------------------------------------------------------------------------
# Errors of a sweep's best tiling against the jnp reference (the compiled kernels' correctness
# checks are tests: tests/pallas_kernels/test_blockwise_matmul_gpu.py, pytest -m gpu)


def rel_errors(y, ref):
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref, np.float32)
    scale = float(np.abs(ref).max()) or 1.0
    return (float(np.abs(y - ref).max()) / scale,
            float(np.linalg.norm(y - ref) / (np.linalg.norm(ref) or 1.0)),
            bool(np.isfinite(y).all()))


def error_verdict(errs) -> str:
    """'<max err / max> ok|BAD' for rel_errors' result: ok when <= 1e-2 and all finite."""
    return f"{errs[0]:.1e} {'ok' if errs[0] <= 1e-2 and errs[2] else 'BAD'}"
