"""The wheel (`make dist`'s `pip wheel`) carries configs/ as cppo_jax/configs: installed from it (the
wheel unpacked on a path, as pip lays it out), `--config gsm8k_1p5b` and `--config tiny_cpu` resolve
to the installed copies from any folder, and tiny_cpu's model and warm-start paths exist there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from pathlib import Path
from cppo_jax.config import files as config_io
import cppo_jax
out = {"package": str(Path(cppo_jax.__file__).parent), "known": config_io.known_configs()}
for name in ("gsm8k_1p5b", "tiny_cpu.py", "math7b"):
    out[name] = str(config_io.resolve_config_path(name))
cfg = config_io.load_config("tiny_cpu")
out["tiny_cpu_model"] = cfg.model.init_checkpoint
out["tiny_cpu_warm_start"] = cfg.model.warm_start
out["model_exists"] = Path(cfg.model.init_checkpoint, "config.json").is_file()
out["warm_start_exists"] = Path(cfg.model.warm_start).is_file()
config_io.load_config("gsm8k_1p5b", ["model.path=/nonexistent/ok-for-validation"])
print(json.dumps(out))
"""


def test_the_wheel_ships_the_configs_and_an_install_resolves_them_by_name(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = dist.glob("cppo_jax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.py"))
    assert shipped and all(f"cppo_jax/configs/{n}" in names for n in shipped), shipped
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"  # no configs/ here: only the installed copies can answer
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    ran = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    package = Path(got["package"])
    assert package == site / "cppo_jax"  # the installed package, not this source tree
    for name in ("gsm8k_1p5b", "tiny_cpu.py", "math7b"):
        assert Path(got[name]).parent == package / "configs", (name, got[name])
    assert set(got["known"]) >= {Path(n).stem for n in shipped}
    assert got["model_exists"] and got["warm_start_exists"], got
    assert Path(got["tiny_cpu_model"]).is_relative_to(package)
