"""Running one model over many devices and hosts: the device mesh and the named shardings of
params, 4-bit weights, optimizer state and batches (mesh.py); jax.distributed and per-host data
(distributed.py)."""
