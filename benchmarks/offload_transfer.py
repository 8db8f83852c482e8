"""How long qerl_jax.infra.device_offload takes to hold weights in host memory and put them back.

The trainer offloads its frozen weights while each sampler program compiles
(config.rollout.offload_weights_for_compile). This measures, per total size and method
(pinned host memory by DMA, or numpy arrays in pageable memory): the seconds to offload and to
restore a tree of bf16 arrays of --array-mib each, the device memory in use before, while offloaded
and after (the offload must free it), and that the values come back bit for bit (a checksum per
array). The arrays are made uncommitted and then committed with jax.device_put, as the trainer
does with its state.

    python benchmarks/offload_transfer.py --sizes-gib 5.5,14.2 --out $OUT
"""

from __future__ import annotations

import argparse
import time

import _harness as harness


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gib", default="5.5,14.2",
                        help="total sizes in GiB (e.g. a model's NVFP4 and bf16 weights)")
    parser.add_argument("--methods", default="pinned_host,numpy")
    parser.add_argument("--array-mib", type=float, default=128.0, help="size of each array")
    parser.add_argument("--out", default="benchmarks/results/offload_transfer")
    return parser.parse_args(argv)


def _in_use_gib() -> float | None:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats["bytes_in_use"] / 2**30 if "bytes_in_use" in stats else None


def measure(size_gib: float, method: str, array_mib: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from qerl_jax.infra.device_offload import offload_to_host, restore_to_device

    count = max(1, round(size_gib * 1024 / array_mib))
    elements = int(array_mib * 2**20 / 2)
    make = jax.jit(lambda seed: jax.random.normal(jax.random.key(seed), (elements,),
                                                  jnp.bfloat16))
    checksum = jax.jit(lambda a: jnp.sum(a.view(jnp.uint16).astype(jnp.uint32)))
    arrays = [make(i) for i in range(count)]
    tree = jax.device_put(arrays, jax.devices()[0])   # committed, as the trainer's state
    del arrays
    sums = [int(checksum(a)) for a in tree]
    row = {"size_GiB": count * array_mib / 1024, "arrays": count, "method": method,
           "in_use_before_GiB": _in_use_gib()}
    started = time.perf_counter()
    host = offload_to_host(tree, method=method)
    row["offload_s"] = time.perf_counter() - started
    del tree
    row["in_use_offloaded_GiB"] = _in_use_gib()
    row["pinned_arrays"] = host.pinned
    started = time.perf_counter()
    restored = jax.block_until_ready(restore_to_device(host))
    row["restore_s"] = time.perf_counter() - started
    del host
    row["in_use_after_GiB"] = _in_use_gib()
    row["GB_per_s_each_way"] = (row["size_GiB"] * 2**30 / 1e9
                                / ((row["offload_s"] + row["restore_s"]) / 2))
    row["bitwise_equal"] = [int(checksum(a)) for a in restored] == sums
    row["committed"] = all(a.committed for a in restored)
    del restored
    np.asarray(0)
    return row


COLUMNS = [("size_GiB", "GiB"), ("arrays", "arrays"), ("method", "method"),
           ("pinned_arrays", "pinned arrays"), ("offload_s", "offload s"),
           ("restore_s", "restore s"), ("GB_per_s_each_way", "GB/s (mean of both ways)"),
           ("in_use_before_GiB", "in use before GiB"),
           ("in_use_offloaded_GiB", "in use offloaded GiB"),
           ("in_use_after_GiB", "in use after GiB"), ("bitwise_equal", "same bits"),
           ("committed", "committed")]


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    for size in [float(s) for s in harness.split_list(args.sizes_gib)]:
        for method in harness.split_list(args.methods):
            row = {**measure(size, method, args.array_mib), **harness.device_info()}
            print({key: row.get(key) for key, _ in COLUMNS}, flush=True)
            rows.append(row)
    text = (harness.header_line("Offload to host memory and back", rows) + "\n\n"
            + harness.markdown_table(rows, COLUMNS))
    print(text)
    harness.write_outputs(args.out, "offload_transfer", text, {"rows": rows})


if __name__ == "__main__":
    main()
