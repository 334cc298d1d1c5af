"""Evaluation on the paper's benchmarks: their data, decoding and scoring (`benchmarks`), the policy
an evaluation scores (`policy`: a Hugging Face folder or a run folder), and the rows and summaries
it writes (`report`). The command line is `cppo_jax/evaluate.py`.

May import: train, rollout.embedded, models, data, rewards, config, tasks.
"""
