"""Everything that makes completions (the trainer asks `backend.make_backend` for one backend).

- `draw`: steps 1-2 of a CPPO step, the step's questions (and their seeds) and their completions;
- `backend`: the `RolloutBackend` protocol, the embedded backend and the factory `make_backend`;
- `embedded/`: the embedded JAX sampler (token choice, cache segments, prefill and decode);
- `vllm/`: an external vLLM server (HTTP client, backend, weight pushes, probe, local server);
- `vllm_server.sh` (package data, `launch/vllm_server.sh` links to it) and `vllm_plugin/` (runs
  inside the server): the server side;
- `multiprocess`: several trainer processes, one server (process 0 talks to it, all get the result);
- `overlap`: `rollout.overlap = 1`, the next step's rollout produced while this step trains.

Nothing is imported here, so that the host-only modules (the HTTP client, the server launcher) stay
importable without JAX.

May import: rollout.vllm, rollout.embedded, models, data, parallel, config.
"""
