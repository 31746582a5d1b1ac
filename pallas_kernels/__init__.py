"""Hot ops of M3, one folder each: a plain-jnp reference (the definition), and later a Pallas kernel with a
shape-aware dispatch. `pallas_kernels.ops` is the one place that picks an implementation."""
