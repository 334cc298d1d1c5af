"""cppo_jax: CPPO (completion-pruning GRPO) in JAX and Flax NNX."""
