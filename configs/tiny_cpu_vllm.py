"""The tiny CPU demo (configs/tiny_cpu.py) with rollouts from an external vLLM server.

Start a server on the demo's warm-start checkpoint first (it must serve the same architecture), then train:

    launch/vllm_server.sh cppo_jax/assets/tiny_arith 8011
    python -m cppo_jax.launch --config configs/tiny_cpu_vllm.py

The server URL comes from the environment variable CPPO_VLLM_URL (default http://127.0.0.1:8011). Weights are
pushed after every update into <run>/weights (the server must see that folder at the same path).
"""

import dataclasses
import os
from pathlib import Path

from cppo_jax.config.files import load_config
from cppo_jax.config.schema import Config

HERE = Path(__file__).resolve().parent


def get_config() -> Config:
    base = load_config(HERE / "tiny_cpu.py")
    return dataclasses.replace(
        base,
        rollout=dataclasses.replace(
            base.rollout,
            backend="vllm",
            vllm_url=os.environ.get("CPPO_VLLM_URL", "http://127.0.0.1:8011"),
        ),
        trainer=dataclasses.replace(base.trainer, run_name="tiny_cpu_vllm"),
    )
