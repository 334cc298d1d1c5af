"""Questions in, fixed-shape prompt batches out: shipped and local data sets (`datasets`), one
example format for every task (`example_format`), chat-template prompts padded to one shape and the
order questions are drawn in (`prompt_batches`), and GRESO's pre-rollout skipping (`skipping`).
Host code: imports no JAX.

May import: rewards, tasks, config.
"""
