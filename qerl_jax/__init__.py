"""qerl-jax: QeRL (arXiv 2510.11696) in JAX/Flax/Pallas."""

__version__ = "0.1.0"
