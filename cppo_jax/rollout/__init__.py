"""Everything that makes completions (the trainer asks `backend.make_backend` for one backend).

- `draw`: steps 1-2 of a CPPO step, the step's questions (and their seeds) and their completions;
- `backend`: the `RolloutBackend` protocol, the embedded backend and the factory `make_backend`;
- `sampling`: `SamplingParams`, `Samples` and choosing a token (greedy, top-k/top-p, inverse CDF);
- `segments`: the sampler's completion-cache segments (host arithmetic, shared with the memory plan);
- `sampler`: the embedded JAX sampler (shared prompt prefill, batched KV-cache decode);
- `vllm_http`, `vllm_client`: the HTTP client of a vLLM server (host code, no JAX);
- `vllm_backend`: the vLLM backend (completions as `Samples`, weight pushes checked by a probe);
- `vllm_server`, `vllm_server.sh`: start a local vLLM server (the script is `launch/vllm_server.sh` too);
- `multiprocess`: several trainer processes, one server (process 0 talks to it, all get the result);
- `overlap`: `rollout.overlap = 1`, the next step's rollout produced while this step trains.

Nothing is imported here, so that the host-only modules (the HTTP client, the server launcher) stay
importable without JAX.
"""
