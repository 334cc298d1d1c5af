"""Whether a run fits, and how fast it can go, before it runs: the memory plan of a step and the
mesh choice (`memory`), the plan's figure per compiled program (`compiled_memory`), the run's
programs compiled for TPU or GPU targets without their devices (`aot`, `gpu_targets`), the search
for what fits (`fit`), its text (`report`) and the rooflines (`roofline`). The command line is
`cppo_jax/plan.py`. The programs it compiles are `train.programs`', the trainer's own.

May import: train, packing, rollout.embedded, algo, models, parallel, config.
"""
