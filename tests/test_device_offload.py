"""Holding a pytree's device arrays in host memory and putting them back (device_offload)."""

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.device_offload import offload_to_host, restore_to_device


def test_offload_to_host_and_back_is_bitwise_and_frees_the_device_arrays():
    """device_offload: every array (bf16, float8, uint8, float32, int32) comes back with the same
    bits, shape, dtype, sharding and committed flag; the device arrays are deleted meanwhile;
    PRNG keys and non-array leaves are kept as they are."""
    rng = np.random.default_rng(0)
    tree = {"w": jnp.asarray(rng.normal(size=(4, 6)), jnp.bfloat16),
            "scales": jnp.asarray(rng.normal(size=(3,)), jnp.float8_e4m3fn),
            "codes": jnp.asarray(rng.integers(0, 256, (5, 2)), jnp.uint8),
            "norm": [jnp.asarray(rng.normal(size=(7,)), jnp.float32)],
            "placed": jax.device_put(np.arange(4, dtype=np.int32), jax.devices()[0]),
            "key": jax.random.key(1), "step": 3}
    expected = {name: np.asarray(value) for name, value in
                [("w", tree["w"]), ("scales", tree["scales"]), ("codes", tree["codes"]),
                 ("norm", tree["norm"][0])]}
    originals = [tree["w"], tree["scales"], tree["codes"], tree["norm"][0], tree["placed"]]
    assert tree["placed"].committed and not tree["w"].committed
    host = offload_to_host(tree)
    assert host.nbytes == sum(array.nbytes for array in originals)
    assert all(array.is_deleted() for array in originals)
    assert not tree["key"].is_deleted()
    restored = restore_to_device(host)
    assert restored["key"] is tree["key"] and restored["step"] == 3
    for name in ("w", "scales", "codes"):
        assert restored[name].dtype == expected[name].dtype
        assert restored[name].sharding == originals[0].sharding
        np.testing.assert_array_equal(np.asarray(restored[name]).view(np.uint8),
                                      expected[name].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(restored["norm"][0]), expected["norm"])
    # the committed flag is kept: jit caches programs per flag (a change would recompile)
    assert restored["placed"].committed and not restored["w"].committed
    np.testing.assert_array_equal(np.asarray(restored["placed"]), np.arange(4))
