"""Holding a pytree's device arrays in host memory and putting them back (device_offload)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.infra.device_offload import commit_to_devices, offload_to_host, restore_to_device


def _tree():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(4, 6)), jnp.bfloat16),
            "scales": jnp.asarray(rng.normal(size=(3,)), jnp.float8_e4m3fn),
            "codes": jnp.asarray(rng.integers(0, 256, (5, 2)), jnp.uint8),
            "norm": [jnp.asarray(rng.normal(size=(7,)), jnp.float32)],
            "placed": jax.device_put(np.arange(4, dtype=np.int32), jax.devices()[0]),
            "key": jax.random.key(1), "step": 3}


@pytest.mark.parametrize("method, committed_first", [("auto", False), ("numpy", False),
                                                     ("auto", True), ("pinned_host", True)])
def test_offload_to_host_and_back_is_bitwise_and_frees_the_device_arrays(method,
                                                                         committed_first):
    """Every array (bf16, float8, uint8, float32, int32) comes back with the same bits, shape,
    dtype, sharding and committed flag, through numpy ('auto') or pinned host memory (this CPU
    has one); the device arrays are deleted meanwhile; PRNG keys and non-array leaves are kept
    as they are."""
    tree = _tree()
    if committed_first:
        tree = commit_to_devices(tree)
    arrays = ("w", "scales", "codes", "placed")
    expected = {name: np.asarray(tree[name]) for name in arrays}
    expected["norm"] = np.asarray(tree["norm"][0])
    flags = {name: tree[name].committed for name in arrays}
    assert flags["placed"] and flags["w"] == committed_first
    originals = [tree[name] for name in arrays] + [tree["norm"][0]]
    host = offload_to_host(tree, method=method)
    assert host.nbytes == sum(array.nbytes for array in originals)
    assert host.pinned == (5 if method == "pinned_host" else 0)
    assert all(array.is_deleted() for array in originals)
    assert not tree["key"].is_deleted()
    restored = restore_to_device(host)
    assert restored["key"] is tree["key"] and restored["step"] == 3
    for name in arrays:
        assert restored[name].dtype == expected[name].dtype
        assert restored[name].sharding == originals[0].sharding
        # jit caches programs per committed flag: a change would compile them again
        assert restored[name].committed == flags[name]
        np.testing.assert_array_equal(np.asarray(restored[name]).view(np.uint8),
                                      expected[name].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(restored["norm"][0]), expected["norm"])


def test_pinned_host_needs_committed_arrays_and_methods_are_checked():
    with pytest.raises(ValueError, match="needs committed arrays; leaf 0"):
        offload_to_host([jnp.ones(3)], method="pinned_host")
    with pytest.raises(ValueError, match="offload method 'disk'"):
        offload_to_host([jnp.ones(3)], method="disk")


def test_commit_to_devices_shares_the_buffers():
    array = jnp.arange(6.0)
    (committed,) = commit_to_devices([array])
    assert committed.committed and not array.committed
    assert committed.unsafe_buffer_pointer() == array.unsafe_buffer_pointer()


@pytest.mark.parametrize("method", ["auto", "pinned_host"])
def test_an_array_in_several_leaves_stays_one_array(method):
    """One array in two leaves (an MLP's gate/up pair views hold the same interleaved arrays)
    is committed once, offloaded once (counted once) and comes back as one array in both
    leaves: the round trip does not double its memory."""
    shared = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    other = jnp.ones((5,), jnp.bfloat16)
    expected = np.asarray(shared), np.asarray(other)
    tree = commit_to_devices({"gate": [shared, other], "up": [shared]})
    assert tree["gate"][0] is tree["up"][0] and tree["gate"][0].committed
    host = offload_to_host(tree, method=method)
    assert host.nbytes == shared.nbytes + other.nbytes and host.aliases
    assert host.pinned == (2 if method == "pinned_host" else 0)
    restored = restore_to_device(host)
    assert restored["gate"][0] is restored["up"][0]
    np.testing.assert_array_equal(np.asarray(restored["up"][0]), expected[0])
    np.testing.assert_array_equal(np.asarray(restored["gate"][1]), expected[1])


def test_compact_module_puts_a_repacked_model_back_bit_for_bit_with_its_shared_arrays():
    """compact_module on a tiny NVFP4 model in the kernels' layout (interpreted on the CPU;
    each MLP's gate/up pair views share one array): every array is a new one
    with the same bits, dtype and sharding, the old ones are freed, an array shared by several
    weights is still one array, each counted once, and the logits do not change."""
    from flax import nnx

    from qerl_jax.infra.device_offload import compact_module
    from qerl_jax.model_quant.kernel_setup import disable_decode_attention, enable_kernels
    from qerl_jax.model_quant.quantize import quantize_model
    from qerl_jax.models.config import tiny_qwen2
    from qerl_jax.models.transformer import init_model
    from qerl_jax.quant.kernel_registry import unregister_kernels
    model = init_model(tiny_qwen2(param_dtype="bfloat16", compute_dtype="bfloat16"), seed=0)
    quantize_model(model, "nvfp4")
    enable_kernels(model, platform="cpu", interpret=True, tile_k=256)
    try:
        tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, model.config.vocab_size)

        def forward():
            graphdef, state = nnx.split(model)
            return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))

        def arrays():
            return [leaf for leaf in jax.tree_util.tree_leaves(nnx.state(model))
                    if isinstance(leaf, jax.Array)]

        before = arrays()
        logits = forward()
        first = {}   # id(array) -> the first leaf index holding it
        owners = {i: first.setdefault(id(leaf), i) for i, leaf in enumerate(before)}
        assert any(owners[i] != i for i in owners)   # the pair views' arrays are shared
        expected = [np.asarray(leaf) for leaf in before]
        unique = {id(leaf): leaf for leaf in before}
        moved = compact_module(model)
        assert moved == sum(leaf.nbytes for leaf in unique.values())
        assert all(leaf.is_deleted() for leaf in unique.values())
        after = arrays()
        assert len(after) == len(before)
        for i, (leaf, old, values) in enumerate(zip(after, before, expected)):
            assert after[owners[i]] is leaf   # shared as before, and only as before
            assert leaf.dtype == values.dtype and leaf.sharding == old.sharding
            np.testing.assert_array_equal(np.asarray(leaf).reshape(-1).view(np.uint8),
                                          values.reshape(-1).view(np.uint8))
        assert len({id(leaf) for leaf in after}) == len(unique)
        np.testing.assert_array_equal(forward(), logits)
    finally:
        unregister_kernels("cpu")
        disable_decode_attention("cpu")   # enable_kernels registered it too
