"""A Pallas backend's launches on a device mesh: each device runs the kernel on its own rows.

A pallas_call is a per-device program; under GSPMD, XLA cannot split it and would run it whole
(every row) on every device. RowShardedBackend wraps another backend so that each of its
launches runs under jax.shard_map: the activation-like operands (x, the LoRA product x @ A, the
output cotangent) are split by rows over the mesh's batch axes as
batch_spec (mesh.py) splits any row-major array (the sampler's and the trainer's
rows already are), and the weights and LoRA B factors enter whole. It is made for meshes whose
weights are replicated (fsdp = tensor = 1: data parallelism); on other meshes the weight
operands would be all-gathered at every launch (correct, but the XLA path's sharded dot moves
far less), so qerl_jax.model_setup keeps the XLA path there. qerl_jax.model_quant.kernel_setup
wraps every registered kernel backend with it (PerDeviceRows) when the model runs on a mesh.

Kernel selection sees the rows one device holds: a decode step of 64 sequences on data=4 runs
the M <= 64 fused kernel at M = 16 per device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
from jax.sharding import PartitionSpec

from qerl_jax.parallel.mesh import batch_spec
from qerl_jax.quant.backends.base import MatmulBackend


def row_spec(mesh, m: int) -> PartitionSpec:
    """The spec of an [m, ...] row-major array on `mesh` (mesh.batch_spec's rule)."""
    return batch_spec((m,), dict(mesh.shape))


def row_shards(mesh, m: int) -> int:
    """How many devices' row blocks an [m, ...] array is split into."""
    spec = row_spec(mesh, m)
    if not spec:
        return 1
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return math.prod(mesh.shape[axis] for axis in axes)


def per_device_rows(mesh, m: int, fn: Callable, rows: Sequence, whole: Sequence):
    """fn(*rows, *whole) with each array of `rows` ([m, ...], None allowed) split by rows over
    the mesh's batch axes and `whole` (pytrees, None allowed) replicated; every output array is
    rows-split the same way (fn's outputs are [m_local, ...] arrays or tuples of them)."""
    spec = row_spec(mesh, m)
    present_rows = tuple(value for value in rows if value is not None)
    present_whole = tuple(value for value in whole if value is not None)

    def body(local_rows, local_whole):
        row_iter, whole_iter = iter(local_rows), iter(local_whole)
        args = [None if value is None else next(row_iter) for value in rows]
        args += [None if value is None else next(whole_iter) for value in whole]
        return fn(*args)

    # check_vma off: a pallas_call's outputs carry no varying-axis types to check
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=spec,
                         check_vma=False)(present_rows, present_whole)


class RowShardedBackend(MatmulBackend):
    """`inner`'s launches run per device on its rows of a mesh (see the module docstring)."""

    def __init__(self, inner: MatmulBackend, mesh):
        self.inner = inner
        self.mesh = mesh
        self.name = inner.name
        self.description = f"{inner.description}, per device on its rows"
        self.min_m = inner.min_m
        self.max_m = inner.max_m
        self.lora_epilogue = inner.lora_epilogue

    def accepts(self, m: int) -> bool:
        return self.inner.accepts(m // row_shards(self.mesh, m))

    def m_range(self) -> str:
        return f"{self.inner.m_range()} rows per device"

    def refusal(self, weight, compute_dtype):
        return self.inner.refusal(weight, compute_dtype)

    def launch_refusal(self, weight, lora_rank):
        return self.inner.launch_refusal(weight, lora_rank)

    def repack(self, weights, *, tile_k=None, donate=False):
        return self.inner.repack(weights, tile_k=tile_k, donate=donate)

    def group_refusal(self, weights, lora_ranks):
        return self.inner.group_refusal(weights, lora_ranks)

    def swiglu_refusal(self, m, weights, lora_ranks, lora_scales):
        return self.inner.swiglu_refusal(m // row_shards(self.mesh, m), weights, lora_ranks,
                                         lora_scales)

    def swiglu_lora_b(self, weights, lora_bs):
        return self.inner.swiglu_lora_b(weights, lora_bs)

    def dense(self, weight, *, compute_dtype):
        # the weights on the meshes this backend serves are replicated: the dense weight is
        # made whole, as the inner backend's apply would make it on every device
        return self.inner.dense(weight, compute_dtype=compute_dtype)

    def apply(self, x, weight, *, compute_dtype):
        return per_device_rows(
            self.mesh, x.shape[0],
            lambda x, weight: self.inner.apply(x, weight, compute_dtype=compute_dtype),
            (x,), (weight,))

    def apply_backward(self, grad_output, weight, *, compute_dtype):
        return per_device_rows(
            self.mesh, grad_output.shape[0],
            lambda grad, weight: self.inner.apply_backward(grad, weight,
                                                           compute_dtype=compute_dtype),
            (grad_output,), (weight,))

    def apply_lora(self, x, weight, lora_x_a, lora_b, lora_scale, *, compute_dtype):
        return per_device_rows(
            self.mesh, x.shape[0],
            lambda x, lora_x_a, weight, lora_b: self.inner.apply_lora(
                x, weight, lora_x_a, lora_b, lora_scale, compute_dtype=compute_dtype),
            (x, lora_x_a), (weight, lora_b))

    def apply_grouped(self, x, weights, lora_x_a, lora_bs, lora_scales, *, compute_dtype):
        return per_device_rows(
            self.mesh, x.shape[0],
            lambda x, lora_x_a, weights, lora_bs: self.inner.apply_grouped(
                x, weights, lora_x_a, lora_bs, lora_scales, compute_dtype=compute_dtype),
            (x, lora_x_a), (tuple(weights), lora_bs))

    def apply_swiglu(self, x, weights, lora_x_a, lora_bs, lora_scales, pair_lora_b,
                     next_lora_a=None, *, compute_dtype):
        return per_device_rows(
            self.mesh, x.shape[0],
            lambda x, lora_x_a, weights, lora_bs, pair_lora_b, next_lora_a:
                self.inner.apply_swiglu(x, weights, lora_x_a, lora_bs, lora_scales,
                                        pair_lora_b, next_lora_a, compute_dtype=compute_dtype),
            (x, lora_x_a), (tuple(weights), lora_bs, pair_lora_b, next_lora_a))


def on_mesh(backend: MatmulBackend, mesh) -> MatmulBackend:
    """`backend` as it runs on `mesh`: per device on its rows (RowShardedBackend) where the
    mesh has more than one device, else as it is."""
    if mesh is None or mesh.size == 1:
        return backend
    return RowShardedBackend(backend, mesh)


@dataclasses.dataclass(frozen=True)
class PerDeviceRows:
    """The `wrap` of qerl_jax.quant.kernel_registry.register_kernels for a model on `mesh`:
    each backend's launches run per device on its rows (on_mesh); equal for equal meshes."""

    mesh: Any

    def __call__(self, backend: MatmulBackend) -> MatmulBackend:
        return on_mesh(backend, self.mesh)

    def __str__(self) -> str:
        return "one device" if self.mesh is None else f"per device on mesh {dict(self.mesh.shape)}"
