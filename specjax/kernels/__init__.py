"""specjax's kernels, one folder each: Pallas TPU kernels (kernel, jitted wrapper, plain-jnp reference, input
validation) and the CPU product kernels compiled on first use (``cpu_dense``)."""
