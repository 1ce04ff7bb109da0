"""Pallas TPU kernels, one folder each: kernel, jitted wrapper, plain-jnp reference, input validation."""
