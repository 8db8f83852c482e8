"""One run over several processes (one per host): jax.distributed.initialize from config or from
the cluster's own environment, moving host data onto the global mesh and back, and process 0 as
the only writer of metrics, run records, plots and logs.

How the data flows with several processes: every process reads the same prompt list in the same
seeded order (a few kilobytes of text per step); each process transfers to its own devices only
the rows its devices hold (`put_global`: prompts, training micro-batches, parameters); outputs
come back to every process whole (`to_host`: rollout tokens and log-probs), so rewards, advantages
and metrics are the same on every process without further collectives.

Environment variables are the platform's: SLURM's (srun; read by JAX's own cluster detection)
and Open MPI's (mpirun). The choice itself is config.distributed.*.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import jax
import numpy as np

# what JAX's SLURM detection reads (jax._src.clusters.slurm_cluster), and the task count
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                   "SLURM_LOCALID")
OPEN_MPI_VARIABLES = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


def cluster_launch(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """(cluster, process count) when `environ` is one process of a multi-process launch that JAX
    detects by itself (srun with more than one task, mpirun with more than one rank), else
    None (a single task: a plain sbatch script or an interactive shell runs one process)."""
    if all(name in environ for name in SLURM_VARIABLES):
        tasks = int(environ["SLURM_NTASKS"])
        return ("slurm", tasks) if tasks > 1 else None
    if all(name in environ for name in OPEN_MPI_VARIABLES):
        ranks = int(environ["OMPI_COMM_WORLD_SIZE"])
        return ("openmpi", ranks) if ranks > 1 else None
    return None


def initialize_arguments(distributed, environ: Mapping[str, str]) -> dict | None:
    """The keyword arguments of jax.distributed.initialize for config.distributed in
    `environ`, or None for a single-process run.

    'off': None. An explicit coordinator_address: it, num_processes and process_id. Otherwise
    'on', or 'auto' inside a multi-process launch (cluster_launch): {} (JAX reads the cluster's
    environment itself)."""
    if distributed.initialize == "off":
        return None
    if distributed.coordinator_address:
        return {"coordinator_address": distributed.coordinator_address,
                "num_processes": int(distributed.num_processes),
                "process_id": int(distributed.process_id)}
    if distributed.initialize == "on" or cluster_launch(environ) is not None:
        return {}
    return None


def initialize_distributed(config, environ: Mapping[str, str] | None = None) -> bool:
    """jax.distributed.initialize as config.distributed says (before any other JAX work);
    on every process but the first, qerl_jax's log lines below WARNING are dropped. Returns
    whether the run is multi-process."""
    arguments = initialize_arguments(config.distributed,
                                      os.environ if environ is None else environ)
    if arguments is None:
        return False
    if not getattr(jax.distributed, "is_initialized", lambda: False)():
        jax.distributed.initialize(**arguments)
    if jax.process_index() != 0:
        logging.getLogger("qerl_jax").setLevel(logging.WARNING)
    logging.getLogger(__name__).info(
        "process %d of %d, %d of %d devices local", jax.process_index(), jax.process_count(),
        jax.local_device_count(), jax.device_count())
    return True


def is_primary() -> bool:
    """Whether this process writes the run's metrics, records and plots (process 0)."""
    return jax.process_index() == 0


def put_global(array, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host (or single-device) array as a global jax.Array on `sharding`. One process (or an
    array already spanning processes): jax.device_put. Several: each process copies only the
    shards its own devices hold from its (identical) copy of the whole array."""
    if jax.process_count() == 1 or (isinstance(array, jax.Array)
                                    and not array.is_fully_addressable):
        return jax.device_put(array, sharding)   # already global: a reshard
    dtype = getattr(array, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = put_global(jax.random.key_data(array), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(array))
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put_tree(tree: Any, shardings: Any) -> Any:
    """put_global over a pytree of arrays and a matching tree of shardings."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    return jax.tree_util.tree_map(put_global, tree, shardings)


def to_host(tree: Any) -> Any:
    """A pytree of (possibly global) arrays as whole numpy arrays on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)
