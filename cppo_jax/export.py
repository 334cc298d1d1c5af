"""`python -m cppo_jax.export`: a trained policy as a Hugging Face folder that transformers loads and vLLM
serves as it is (the library part is `cppo_jax.train.export`).

Every run ends with `<run>/export/` (the final policy); `best/` (validation) is written the same way.
Any checkpoint of a finished or stopped run can be exported later:

    python -m cppo_jax.export --run runs/tiny_cpu              # latest checkpoint -> runs/tiny_cpu/export
    python -m cppo_jax.export --run runs/tiny_cpu --step 20    # -> runs/tiny_cpu/export-step20

A LoRA run's checkpoint holds adapters: they are merged into the starting folder's weights for
`export/`, and written as a PEFT adapter folder beside it (`export-adapter/`).

The folder keeps the starting checkpoint's config.json fields (eos/bos ids, rope scaling, ...), its
dtype (a bfloat16 checkpoint is exported in bfloat16) and its generation_config.json, with the tokenizer
files copied; weights above 5 GB are sharded with an index, as `save_pretrained` does.
"""

from __future__ import annotations

import argparse
import sys

from cppo_jax.config.choices import ConfigError
from cppo_jax.train.checkpoint import CheckpointError
from cppo_jax.train.export import export_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cppo_jax.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--run", required=True, help="the run folder (runs/<run_name>)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--out", default=None, help="output folder (default: <run>/export)")
    parser.add_argument(
        "--source", default=None, help="the HF folder the run started from (default: its config's)"
    )
    args = parser.parse_args(argv)
    try:
        path = export_run(args.run, args.step, args.out, args.source)
    except (FileNotFoundError, CheckpointError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
