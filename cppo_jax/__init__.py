"""cppo_jax: CPPO (completion-pruning GRPO) in JAX and Flax NNX.

Entry points (`python -m cppo_jax.<name>`): `launch` (the main job: train, or the SFT warm start),
`evaluate` (a checkpoint on the paper's benchmarks), `plan` (a run's plan, and its programs compiled
for a target) and `export` (a run's checkpoint as a Hugging Face folder). One CPPO step reads from
four files: `train/trainer.py` (the step in the paper's order), `rollout/draw.py` (steps 1-2),
`train/scoring.py` (step 3) and `train/after_rewards.py` (steps 4-7, one compiled program).

The folders and entry points in layers, from the top; each may import only from layers below its
own (tests/test_architecture.py holds the code to it, and each folder's docstring names what it
imports):

    launch, evaluate
    plan, export, eval
    planning
    train
    packing, rollout
    rollout.vllm
    rollout.embedded, algo
    models, data
    parallel, rewards
    config, tasks, observe
"""
