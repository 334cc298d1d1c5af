"""Check a vLLM environment for cppo_jax's server: run with the server's Python (no cppo_jax there).

    VLLM_PYTHON launch/check_vllm.py PLUGIN_DIR

Loads vLLM's general plugins with PLUGIN_DIR (cppo_jax/rollout/vllm_plugin) on the path, as
launch/vllm_server.sh starts the server, and checks that the weight-transfer engine `cppo_shm` is
registered and that vLLM defines every route the trainer calls. Prints `vllm VERSION: ok` and exits 0,
or names what is missing and the fix and exits 1. Imports vLLM only: no model, no GPU needed.
"""

from __future__ import annotations

import importlib
import sys

# The routes the trainer's client calls (cppo_jax/rollout/vllm_*.py), by the module that defines them.
ROUTES = {
    "vllm.entrypoints.rl.online.api_router": (
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    ),
    "vllm.entrypoints.serve.dev.rpc.api_router": ("/collective_rpc",),
}
FIX = "make setup-gpu builds the pinned one (docs/running.md)"


def check(plugin_dir: str) -> list[str]:
    """What is wrong with this environment (empty: nothing)."""
    try:
        import vllm
    except ImportError as e:
        return [f"vLLM does not import ({e}); {FIX}"]
    problems = []
    sys.path.insert(0, plugin_dir)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        if "cppo_shm" not in WeightTransferEngineFactory._registry:
            problems.append(
                f"vLLM {vllm.__version__} loaded no 'cppo_shm' weight-transfer engine from "
                f"{plugin_dir} (its entry point or its register() failed); {FIX}"
            )
    except Exception as e:  # an API the plugin needs is gone or moved
        problems.append(f"vLLM {vllm.__version__} refuses the plugin in {plugin_dir}: {e!r}; {FIX}")
    for module, paths in ROUTES.items():
        try:
            router = importlib.import_module(module).router
        except Exception as e:
            problems.append(f"vLLM {vllm.__version__} has no {module} ({e!r}); {FIX}")
            continue
        have = {getattr(r, "path", None) for r in router.routes}
        missing = [p for p in paths if p not in have]
        if missing:
            problems.append(f"vLLM {vllm.__version__} lacks the routes {missing}; {FIX}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: VLLM_PYTHON launch/check_vllm.py PLUGIN_DIR", file=sys.stderr)
        return 2
    problems = check(argv[0])
    for p in problems:
        print(f"check_vllm: {p}", file=sys.stderr)
    if problems:
        return 1
    import vllm

    print(f"vllm {vllm.__version__}: ok (plugin cppo_shm, weight-transfer routes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
