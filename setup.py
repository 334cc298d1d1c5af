"""The one packaging fact pyproject.toml cannot state: `configs/` (at the repository root, where the
docs and commands name `configs/<name>.py`) ships inside the package as `cppo_jax/configs/`, so an
installed wheel resolves `--config gsm8k_1p5b` to its own copy (`config_io.resolve_config_path`).
Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["cppo_jax*"]), "cppo_jax.configs"],
    package_dir={"cppo_jax.configs": "configs"},
)
