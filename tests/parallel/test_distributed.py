"""jax.distributed from the config or the cluster's environment (pure functions of the config
and the environment; the two-process run itself is in test_mesh.py)."""

from __future__ import annotations

import pytest

from qerl_jax.infra.errors import ConfigError
from qerl_jax.experiment_config import base_config, validate_config
from qerl_jax.parallel.distributed import cluster_launch, initialize_arguments, is_primary

SLURM = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
OPEN_MPI = {"OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:4000", "OMPI_COMM_WORLD_SIZE": "4"}


def _distributed(**fields):
    section = base_config().distributed
    for name, value in fields.items():
        section[name] = value
    return section


def test_a_multi_task_launch_is_detected_and_a_single_task_is_not():
    assert cluster_launch(SLURM) == ("slurm", 2)
    assert cluster_launch(OPEN_MPI) == ("openmpi", 4)
    assert cluster_launch({**SLURM, "SLURM_NTASKS": "1"}) is None   # sbatch without srun -n
    assert cluster_launch({"SLURM_JOB_ID": "42"}) is None           # a job's shell, no step
    assert cluster_launch({}) is None


def test_initialize_arguments_follow_the_config_then_the_environment():
    auto = _distributed()
    assert initialize_arguments(auto, {}) is None                  # one process
    assert initialize_arguments(auto, SLURM) == {}                 # JAX reads SLURM's variables
    assert initialize_arguments(auto, OPEN_MPI) == {}
    assert initialize_arguments(_distributed(initialize="off"), SLURM) is None
    assert initialize_arguments(_distributed(initialize="on"), {}) == {}
    explicit = _distributed(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)
    assert initialize_arguments(explicit, SLURM) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert is_primary()   # one process here


@pytest.mark.parametrize("fields, message", [
    (dict(coordinator_address="h:1"), "config.distributed.coordinator_address: set it with"),
    (dict(num_processes=2), "config.distributed.coordinator_address: set it with"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2),
     r"config.distributed.process_id: 2 must be < distributed.num_processes=2"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=0, initialize="off"),
     "config.distributed.initialize: 'off' leaves"),
    (dict(process_id=-2), "config.distributed.process_id: must be >= -1"),
    (dict(initialize="yes"), "config.distributed.initialize: unknown switch 'yes'"),
])
def test_bad_distributed_fields_name_the_field(fields, message):
    from tests.conftest import config_from_file

    config = config_from_file("tiny")
    for name, value in fields.items():
        config.distributed[name] = value
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_mesh_sizes_must_be_positive():
    from tests.conftest import config_from_file

    config = config_from_file("tiny")
    config.mesh.fsdp = 0
    with pytest.raises(ConfigError, match=r"^config.mesh.fsdp: must be > 0, got 0$"):
        validate_config(config)
