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
    committed: whether each offloaded array was committed to its device (jit caches its programs
    per committed / uncommitted argument: a changed flag would compile them again).
    """

    treedef: Any
    leaves: list
    shardings: list
    committed: list
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
    copied, shardings, committed, nbytes = [], [], [], 0
    for leaf in leaves:
        if _offloadable(leaf):
            copied.append(next(host))
            shardings.append(leaf.sharding)
            committed.append(leaf.committed)
            nbytes += leaf.nbytes
        else:
            copied.append(leaf)
            shardings.append(None)
            committed.append(None)
    for array in arrays:
        array.delete()
    return HostCopy(treedef=treedef, leaves=copied, shardings=shardings, committed=committed,
                    nbytes=nbytes)


def restore_to_device(copy: HostCopy):
    """The tree offload_to_host copied, each array back where it was: same sharding, same
    committed flag, bitwise the same values, dtypes and shapes."""
    default = jax.device_put(0).sharding   # where uncommitted arrays are made
    to_sharding, to_default = [], []
    for index, (sharding, committed) in enumerate(zip(copy.shardings, copy.committed)):
        if sharding is None:
            continue
        if committed or not sharding.is_equivalent_to(default, 1):
            to_sharding.append(index)
        else:
            to_default.append(index)
    leaves = list(copy.leaves)
    placed = (jax.device_put([leaves[i] for i in to_sharding],
                             [copy.shardings[i] for i in to_sharding])
              + jax.device_put([leaves[i] for i in to_default]))
    for index, array in zip(to_sharding + to_default, placed):
        leaves[index] = array
    return jax.tree_util.tree_unflatten(copy.treedef, leaves)
