"""The training step and the run around it: the trainer (`trainer`, one CPPO step in the paper's
order), its roles built from the config (`roles`), the device programs (`programs`: the steps-4-7
program of `after_rewards`, the log-prob and update functions of `device_fns`), how the trainer
runs them (`update`), scoring (`scoring`, step 3), evaluations during training (`evaluation`), the
loop with resume, checkpoints and stops (`loop`, `checkpoint`, `stopping`), the optimizer, the export
of a policy (`export`) and the supervised warm start (`sft`).

May import: packing, rollout, rollout.vllm, rollout.embedded, algo, models, data, parallel, rewards,
config, tasks, observe.
"""
