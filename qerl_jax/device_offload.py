"""Holding a pytree's device arrays in host memory for a while (e.g. while XLA compiles).

XLA's GPU autotuner allocates its scratch and test buffers from the device memory the run uses
while it compiles a program: at Qwen2.5-7B, +3.1 GiB over what is in use while the sampler
compiles, the largest transient of a cold run (benchmarks/RESULTS.md, sessions 4 and 8). The
frozen base weights are most of what is in use; copied to host memory for the compile, they no
longer add to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass
class HostCopy:
    """A pytree with its device arrays in host memory (offload_to_host's result).

    treedef: the tree's structure. leaves: numpy arrays for the offloaded arrays, the original
    leaf otherwise. shardings: each offloaded leaf's sharding (None where the leaf was kept).
    """

    treedef: Any
    leaves: list
    shardings: list
    nbytes: int


def _offloadable(leaf) -> bool:
    return (isinstance(leaf, jax.Array)
            and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def offload_to_host(tree) -> HostCopy:
    """Copies every device array of `tree` to host memory and frees its device buffer.

    The arrays are deleted: every other reference to them is invalid afterwards (using one
    raises "Array has been deleted"), so pass a tree that nothing else uses meanwhile. PRNG key
    arrays and non-array leaves are kept as they are.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [leaf for leaf in leaves if _offloadable(leaf)]
    host = iter(jax.device_get(arrays))   # all copies started before any is waited for
    copied, shardings, nbytes = [], [], 0
    for leaf in leaves:
        if _offloadable(leaf):
            copied.append(next(host))
            shardings.append(leaf.sharding)
            nbytes += leaf.nbytes
        else:
            copied.append(leaf)
            shardings.append(None)
    for array in arrays:
        array.delete()
    return HostCopy(treedef=treedef, leaves=copied, shardings=shardings, nbytes=nbytes)


def restore_to_device(copy: HostCopy):
    """The tree offload_to_host copied, each array back on its original sharding (bitwise the
    same values, dtypes and shapes)."""
    indices = [i for i, sharding in enumerate(copy.shardings) if sharding is not None]
    placed = jax.device_put([copy.leaves[i] for i in indices],
                            [copy.shardings[i] for i in indices])
    leaves = list(copy.leaves)
    for index, array in zip(indices, placed):
        leaves[index] = array
    return jax.tree_util.tree_unflatten(copy.treedef, leaves)
