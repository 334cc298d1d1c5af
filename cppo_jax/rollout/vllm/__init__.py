"""An external vLLM server as the rollout engine: JSON over HTTP (`transport`, `client`: host code,
no JAX), completions as static-shape samples (`samples`, `backend`), weight pushes by file or by
vLLM's weight-transfer protocol (`push`, `routes`, `weight_transfer`, `device_patch`, `lora`), the
probe that checks each push (`probe`), and a local server started from Python (`server`).

May import: rollout.embedded, models, config, observe.
"""
