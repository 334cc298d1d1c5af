"""Repository tooling (not shipped in the cppo_jax package): run from the repository root as
`python -m tools.<name>`."""
