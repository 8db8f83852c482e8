"""The device mesh of a run and the named shardings of everything placed on it.

Axes (config.mesh.*): "data" (rollout prompts, KV cache and training rows are split over it),
"fsdp" (parameters, optimizer state and 4-bit weights split over it; training rows too) and
"tensor" (attention heads, MLP columns and the vocabulary split over it). Every jitted program
runs under GSPMD: the shardings decide where arrays live and which collectives XLA inserts, never
the numbers a program computes (up to the order of float reductions).

Logical axis rules live in one place (LOGICAL_AXIS_RULES, PROJECTION_AXES): a parameter's path
names its role (a projection's weight, bias or LoRA factor, the embedding, a norm scale), the
role gives each dimension a logical axis, and the rules map logical axes to mesh axes. A
dimension stays unsplit where its size is not a multiple of the mesh axes' size. The arrays of a
4-bit QuantizedWeight (codes [N, K/2], block scales [N, K/block]) share one spec over their
logical (N, K) = (out, in) dimensions, so a block scale's rows and columns live with the codes
they scale; per-tensor scalars and flattened double-quantization scales are replicated. The
same path rules serve the optimizer state, whose moments mirror the parameter paths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qerl_jax.infra.errors import ConfigError
from qerl_jax.parallel.distributed import put_global, put_tree
from qerl_jax.quant.qarray import QuantizedWeight

MESH_AXES = ("data", "fsdp", "tensor")
# rows of the training batch and of the rollouts
BATCH_AXES = ("data", "fsdp")

# logical axis -> the mesh axes it is split over (None: replicated)
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "embed": ("fsdp",),        # the hidden size
    "heads": ("tensor",),      # q/k/v outputs and o_proj's input: heads * head_dim
    "mlp": ("tensor",),        # the intermediate size
    "vocab": ("tensor",),
    "rank": None,              # LoRA rank
    "norm": None,              # RMSNorm scales (small, read by every layer)
}

# module name -> logical axes of its weight's (out_features, in_features)
PROJECTION_AXES: dict[str, tuple[str, str]] = {
    "q_proj": ("heads", "embed"), "k_proj": ("heads", "embed"), "v_proj": ("heads", "embed"),
    "o_proj": ("embed", "heads"),
    "gate_proj": ("mlp", "embed"), "up_proj": ("mlp", "embed"), "down_proj": ("embed", "mlp"),
    "lm_head": ("vocab", "embed"),
}


# ------------------------------------------------------------------------------ the mesh
def mesh_shape(config) -> dict[str, int]:
    """{'data': ..., 'fsdp': ..., 'tensor': ...} of config.mesh."""
    return {axis: int(config.mesh[axis]) for axis in MESH_AXES}


def check_mesh_shape(shape: Mapping[str, int], device_count: int) -> None:
    """ConfigError naming config.mesh.* unless the axes' product is `device_count`."""
    product = math.prod(shape.values())
    if product != device_count:
        sizes = " x ".join(f"{axis}={size}" for axis, size in shape.items())
        raise ConfigError(f"config.mesh.data: {sizes} = {product} devices, but JAX sees "
                          f"{device_count}; the product of config.mesh.data, .fsdp and "
                          f".tensor must equal jax.device_count()")


def make_mesh(shape: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
    """A Mesh with axes MESH_AXES of the given sizes over `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(int(shape.get(axis, 1)) for axis in MESH_AXES)
    check_mesh_shape(dict(zip(MESH_AXES, sizes)), len(devices))
    # Auto axes: GSPMD places what the shardings leave open (Explicit axes would make every
    # jnp op's output sharding part of its type)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(sizes, MESH_AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES, axis_types=auto)


def mesh_from_config(config) -> Mesh | None:
    """config.mesh's Mesh over all devices, or None for a 1 x 1 x 1 mesh on one device (the
    single-device path: no shardings anywhere). ConfigError when the sizes' product is not
    jax.device_count()."""
    shape = mesh_shape(config)
    check_mesh_shape(shape, jax.device_count())
    return None if math.prod(shape.values()) == 1 else make_mesh(shape)


# ------------------------------------------------------------------------------ specs
def _axis_sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def logical_spec(logical: Sequence[str | None], shapes: Sequence[Sequence[int]],
                 axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """PartitionSpec of arrays whose leading dims carry the `logical` axes: each dimension
    is split over its rule's mesh axes (size-1 axes dropped), less the rule's last axes until
    every array in `shapes` has a multiple of their size there (none: left whole); a mesh axis
    splits one dimension at most."""
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical):
        rule = LOGICAL_AXIS_RULES.get(name) or () if name is not None else ()
        axes = [axis for axis in rule if axis_sizes.get(axis, 1) > 1 and axis not in used]
        while axes and any(len(shape) <= dim or shape[dim] % math.prod(
                axis_sizes[axis] for axis in axes) for shape in shapes):
            axes.pop()   # the last axes of the rule go first (rows: data before fsdp)
        if not axes:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def path_names(path) -> list[str]:
    """The names along a pytree path (dict keys, attribute names, sequence indices), as
    strings."""
    names = []
    for entry in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(entry, attribute):
                names.append(str(getattr(entry, attribute)))
                break
    return names


def _logical_axes(names: Sequence[str], ndim: int) -> tuple[str | None, ...]:
    """The logical axes of a parameter-shaped array from its path's names (a parameter, or the
    optimizer moment / gradient of one): a projection's dense weight [in, out], bias [out],
    LoRA A [in, r] and B [r, out]; the embedding [vocab, embed]; anything else replicated."""
    module = next((name for name in reversed(names) if name in PROJECTION_AXES), None)
    if module is not None:
        out_axis, in_axis = PROJECTION_AXES[module]
        for name in reversed(names):
            if name == "weight" and ndim == 2:
                return (in_axis, out_axis)
            if name == "bias" and ndim == 1:
                return (out_axis,)
            if name == "lora_a" and ndim == 2:
                return (in_axis, "rank")
            if name == "lora_b" and ndim == 2:
                return ("rank", out_axis)
    if "embed_tokens" in names and ndim == 2:
        return ("vocab", "embed")
    return (None,) * ndim


def _quantized_spec(names: Sequence[str], weight: QuantizedWeight,
                    axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """The one spec of a QuantizedWeight's 2-D arrays over its logical (N, K) = (out, in): a
    dimension is split only where codes and block scales (and any other 2-D array it holds,
    e.g. a kernel layout's) all divide by the mesh axes' size."""
    module = next((name for name in reversed(names) if name in PROJECTION_AXES), None)
    logical = PROJECTION_AXES[module] if module is not None else (None, None)
    shapes = [np.shape(leaf) for leaf in jax.tree_util.tree_leaves(weight)
              if len(np.shape(leaf)) == 2]
    return logical_spec(logical, shapes, axis_sizes) if shapes else PartitionSpec()


def _is_quantized(leaf) -> bool:
    return isinstance(leaf, QuantizedWeight)


def tree_specs(tree: Any, axis_sizes: Mapping[str, int]) -> Any:
    """A PartitionSpec for every array leaf of a parameter / optimizer-state pytree (the same
    structure; QuantizedWeights get a spec per array: the shared one for 2-D arrays, P() for
    scalars and 1-D scales)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _leaf_spec(path_names(path), leaf, axis_sizes), tree,
        is_leaf=_is_quantized)


def _leaf_spec(names: Sequence[str], leaf, axis_sizes: Mapping[str, int]) -> Any:
    """The spec (a QuantizedWeight: a tree of specs) of the parameter-shaped leaf at `names`."""
    if _is_quantized(leaf):
        shared = _quantized_spec(names, leaf, axis_sizes)
        return jax.tree_util.tree_map(
            lambda array: shared if len(np.shape(array)) == 2 else PartitionSpec(), leaf)
    ndim = len(np.shape(leaf))
    if ndim == 0 or (hasattr(leaf, "dtype")
                     and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)):
        return PartitionSpec()
    return logical_spec(_logical_axes(names, ndim), [np.shape(leaf)], axis_sizes)


def place_parameter(path: Sequence[Any], value: Any, mesh: Mesh) -> Any:
    """One parameter (an array or a QuantizedWeight) at the model path `path` (e.g. ('layers',
    0, 'mlp', 'gate_proj', 'weight')) on the sharding Placement.states gives it on `mesh`: for
    building a model tensor by tensor straight onto the mesh, so the whole model never sits on
    one device."""
    spec = _leaf_spec([str(part) for part in path], value, _axis_sizes(mesh))
    shardings = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), spec,
                                       is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.tree_util.tree_map(put_global, value, shardings)


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """tree_specs as NamedShardings on `mesh`."""
    specs = tree_specs(tree, _axis_sizes(mesh))
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_spec(shape: Sequence[int], axis_sizes: Mapping[str, int],
               axes: Sequence[str] = BATCH_AXES) -> PartitionSpec:
    """Rows (dim 0) split over `axes` (size-1 axes dropped; the last axes dropped until the row
    count divides), the other dims whole."""
    axes = [axis for axis in axes if axis_sizes.get(axis, 1) > 1]
    while axes and shape[0] % math.prod(axis_sizes[axis] for axis in axes):
        axes.pop()
    if not axes:
        return PartitionSpec()
    return PartitionSpec(axes[0] if len(axes) == 1 else tuple(axes))


def constrain_rows(tree: Any, mesh: Mesh | None, axes: Sequence[str] = BATCH_AXES) -> Any:
    """Inside jit: every array of `tree` with rows split over `axes` (batch_spec), scalars
    replicated. A no-op without a mesh."""
    if mesh is None:
        return tree
    sizes = _axis_sizes(mesh)

    def constrain(leaf):
        spec = batch_spec(leaf.shape, sizes, axes) if leaf.ndim else PartitionSpec()
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
    return jax.tree_util.tree_map(constrain, tree)


def constrain_logical(tree: Any, mesh: Mesh | None, logical: Sequence[str | None]) -> Any:
    """Inside jit: every array of `tree` split as logical_spec(`logical`) gives (e.g. a KV
    cache's [B, S, kv_heads, head_dim] as ('batch', None, 'heads', None)). A no-op without a
    mesh."""
    if mesh is None:
        return tree
    sizes = _axis_sizes(mesh)
    return jax.tree_util.tree_map(
        lambda leaf: jax.lax.with_sharding_constraint(leaf, NamedSharding(
            mesh, logical_spec(logical, [leaf.shape], sizes))), tree)


def constrain_attention_inputs(q, keys, values, bias, mesh: Mesh | None):
    """Inside jit: cuDNN's fused attention inputs q [B, T, H, D], keys / values [B, S, KVH, D]
    and its bias [B, 1, T, S] placed the one way its partitioner accepts on `mesh`: q, keys and
    values under one spec (rows over data x fsdp, heads over tensor where both H and KVH divide),
    sequence and head dims whole, the bias's rows as q's. Without this GSPMD may carry the
    projections' fsdp split into the heads of q but not of keys, which the partitioner refuses.
    A no-op without a mesh."""
    if mesh is None:
        return q, keys, values, bias
    sizes = _axis_sizes(mesh)
    spec = logical_spec(("batch", None, "heads", None), [q.shape, keys.shape, values.shape],
                        sizes)
    rows = PartitionSpec(*spec[:1])
    q, keys, values = (jax.lax.with_sharding_constraint(array, NamedSharding(mesh, spec))
                       for array in (q, keys, values))
    return q, keys, values, jax.lax.with_sharding_constraint(bias, NamedSharding(mesh, rows))


# ------------------------------------------------------------------------------ placement
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's arrays live: `mesh` None places nothing (one device, arrays as they are).

    states(tree): params / optimizer state on their named shardings.
    shardings(tree): those shardings (None without a mesh).
    abstract(tree): shapes, dtypes and those shardings, for ahead-of-time compilation.
    rows(array): a host or device array with its rows split over BATCH_AXES (jnp.asarray
      without a mesh); with several processes each one passes the whole array and transfers
      the rows its devices hold.
    """

    mesh: Mesh | None = None

    @classmethod
    def from_config(cls, config) -> "Placement":
        return cls(mesh_from_config(config))

    def shardings(self, tree):
        return None if self.mesh is None else tree_shardings(tree, self.mesh)

    def states(self, tree):
        if self.mesh is None:
            return tree
        return put_tree(tree, self.shardings(tree))

    def abstract(self, tree):
        """jax.ShapeDtypeStructs of `tree` (arrays or abstract values) carrying the shardings
        states() gives them (no sharding without a mesh): what a program is compiled for
        ahead of time."""
        if self.mesh is None:
            return tree
        return jax.tree_util.tree_map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                        sharding=sharding),
            tree, self.shardings(tree))

    def rows(self, array, axes: Sequence[str] = BATCH_AXES):
        if self.mesh is None:
            return jnp.asarray(array)
        spec = batch_spec(np.shape(array), _axis_sizes(self.mesh), axes)
        return put_global(array, NamedSharding(self.mesh, spec))
