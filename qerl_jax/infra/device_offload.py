"""Holding a pytree's device arrays in host memory for a while (e.g. while XLA compiles).

XLA's GPU autotuner allocates its scratch and test buffers from the device memory the run uses
while it compiles a program, the largest transient of a cold run (benchmarks/RESULTS.md). The
frozen base weights are most of what is in use; copied to host memory for the compile, they no
longer add to it.

Two ways to hold them:
  - "numpy" (the default, "auto"): host numpy arrays in pageable memory; each array comes back
    with its sharding and committed flag (jit caches its programs per committed / uncommitted
    argument).
  - "pinned_host": JAX arrays in the device's pinned host memory (jax.memory.Space.Host), copied
    by DMA; committed arrays only (an array put back from there is committed). Its transfers
    are faster, but the training phase after it was slower (docs/decisions.md), so it is not
    the default.

The same round trip compacts a model's weights (compact_module): the device allocator (XLA's
best-fit allocator) hands a request the whole of a free block smaller than twice its size, so
weights rebuilt one after another into new layouts (the Pallas kernels' repack) leave that
slack in use; put back in order into memory nothing else holds, each array gets its own size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from qerl_jax.registry import OFFLOAD_METHODS

METHODS = OFFLOAD_METHODS.names()


@dataclasses.dataclass
class HostCopy:
    """A pytree with its device arrays in host memory (offload_to_host's result).

    treedef: the tree's structure. leaves: the host copies (pinned-host JAX arrays or numpy
    arrays) of the offloaded arrays, the original leaf otherwise. shardings: each offloaded
    leaf's device sharding (None where the leaf was kept). committed: whether each offloaded
    array was committed to its device. nbytes: bytes offloaded. pinned: how many of the
    offloaded arrays are in pinned host memory (the rest are numpy). aliases: leaf index ->
    the index of the leaf holding the same array (one array in several places of the tree,
    e.g. an MLP's gate/up pair views): copied once, and restored as one array again.
    """

    treedef: Any
    leaves: list
    shardings: list
    committed: list
    nbytes: int
    pinned: int
    aliases: dict = dataclasses.field(default_factory=dict)


def _offloadable(leaf) -> bool:
    return (isinstance(leaf, jax.Array)
            and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _has_pinned_host(array: jax.Array) -> bool:
    return all("pinned_host" in {memory.kind for memory in device.addressable_memories()}
               for device in array.sharding.device_set)


def commit_to_devices(tree):
    """`tree` with every array committed to the device(s) it is on. The new arrays share the
    old ones' buffers (no copy). jit compiles a program per committed / uncommitted argument, so
    state that is committed from the start keeps one program per shape when arrays come back
    from pinned host memory (committed) or out of jitted programs. An array in several leaves
    stays one array (the same object in each)."""
    committed = {}

    def commit(leaf):
        if isinstance(leaf, jax.Array) and not leaf.committed:
            if id(leaf) not in committed:   # (the leaf is kept alive so that its id stays unique)
                committed[id(leaf)] = (leaf, jax.device_put(leaf, leaf.sharding))
            return committed[id(leaf)][1]
        return leaf
    return jax.tree_util.tree_map(commit, tree)


def offload_to_host(tree, method: str = "auto") -> HostCopy:
    """Copies every device array of `tree` to host memory and frees its device buffer.

    method: "numpy" (or "auto", the same) or "pinned_host" (committed arrays on a device with
    pinned host memory; ValueError otherwise).
    The arrays are deleted: every other reference to them is invalid afterwards (using one
    raises "Array has been deleted"), so pass a tree that nothing else uses meanwhile. PRNG key
    arrays and non-array leaves are kept as they are. An array that appears in several leaves
    is copied once (restore_to_device puts one array back in all of them).
    """
    if method not in METHODS:
        raise ValueError(f"offload method {method!r} not in {METHODS}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    first_index, aliases, indices = {}, {}, []
    for i, leaf in enumerate(leaves):
        if not _offloadable(leaf):
            continue
        if id(leaf) in first_index:
            aliases[i] = first_index[id(leaf)]
        else:
            first_index[id(leaf)] = i
            indices.append(i)
    pinned, pageable = [], []
    for index in indices:
        array = leaves[index]
        if method in ("auto", "numpy"):
            pageable.append(index)
        elif not array.committed:
            raise ValueError(f"offload method 'pinned_host' needs committed arrays; leaf "
                             f"{index} ({array.dtype}{list(array.shape)}) is not committed")
        elif not _has_pinned_host(array):
            raise ValueError(f"offload method 'pinned_host': the device of leaf {index} has no "
                             f"pinned host memory")
        else:
            pinned.append(index)
    copies = dict(zip(pinned, jax.device_put([leaves[i] for i in pinned],
                                             jax.memory.Space.Host)))
    copies.update(zip(pageable, jax.device_get([leaves[i] for i in pageable])))
    jax.block_until_ready([copies[i] for i in pinned])
    copied, shardings, committed = list(leaves), [None] * len(leaves), [None] * len(leaves)
    for index in indices:
        copied[index] = copies[index]
        shardings[index] = leaves[index].sharding
        committed[index] = leaves[index].committed
    nbytes = sum(leaves[i].nbytes for i in indices)
    for index in indices:
        leaves[index].delete()
    for index in aliases:
        copied[index] = None
    return HostCopy(treedef=treedef, leaves=copied, shardings=shardings, committed=committed,
                    nbytes=nbytes, pinned=len(pinned), aliases=aliases)


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
    for index, original in copy.aliases.items():
        leaves[index] = leaves[original]
    return jax.tree_util.tree_unflatten(copy.treedef, leaves)


def compact_module(module, method: str = "auto") -> int:
    """In place: every device array of an nnx Module copied to host memory, freed, and put back
    in order (the same values, shardings, committed flags; an array in several places stays
    one), so the device allocator holds them without the gaps that freeing and allocating them
    one after another left. Call it when the Module's arrays are most of what is on the device
    (right after building it). Returns the bytes moved (0, with nothing changed, when host
    memory cannot hold them)."""
    from flax import nnx
    state = nnx.state(module)
    try:
        host = offload_to_host(state, method)
    except MemoryError:
        return 0
    nnx.update(module, restore_to_device(host))
    return host.nbytes
