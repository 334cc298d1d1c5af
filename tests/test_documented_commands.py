"""Every command the documentation shows is run, in dry-run form or shrunk by overrides.

Commands are read at test time (none is copied here; tests/documented.py) from README.md, docs/*.md (code
blocks and inline code), the module docstrings of configs/*.py, the `--help` of cppo_jax.launch / evaluate /
plan, and what each launch script prints with `--dry-run` (the commands it would start). Each is then run:

- `python -m cppo_jax.launch ...` in-process with `trainer.dry_run=true`, which passes exactly when the run
  would start (tests/test_launch.py), for the devices the command targets (`--devices N
  --device-memory-gb GB`: the trainer GPUs a launch script gives it, 80 GB GPUs for the paper's models) and
  shrunk (`trainer.eval_size=16`; the shipped 7473-question GSM8K train split replaced by its first 64
  rows, 256 generated arith problems instead of 20000) so that tokenizing stays fast; a supervised warm
  start config (it has no dry run) runs 2 steps into a temporary folder; `make demo` is its Makefile recipe, run the same way;
- `python -m cppo_jax.evaluate ...` with `--dry-run`; `python -m cppo_jax.plan ...` as written, its shown
  output (`$ ` blocks) checked line by line; `plan --compile-for TARGET` at a tiny shape, all of them in
  one process after the rest (libtpu and the CUDA plugin loaded once), two that differ only in naming
  the config by name or by path (the same file) run once; `python -m tools.docs_gen` as `--check`;
- launch scripts (and `sbatch SCRIPT`) with `--dry-run`, then every trainer command they print.
Placeholder paths that do not exist here are stood in for: a model folder named like a paper model gets
that model's config.json, a safetensors header at its real shapes (no data) and a tiny tokenizer; a
`data.train` file gets 48 MATH/GSM8K rows; a run folder `runs/NAME` is made as the documented command with
`trainer.run_name=NAME` would leave it (its config.json and an orbax checkpoint; the weights are not read).
Synopses (`[...]`, `CONFIG`, `...`) are listed, not run; so are commands that need the network or a
cloud (pip, huggingface-cli, gcloud) or that this suite is (`make test`). The list, with what happened to
each command, is printed in the terminal summary ("documented commands").
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cppo_jax import evaluate, launch, plan
from cppo_jax.config.files import load_config, resolve_config_path
from cppo_jax.config.schema import Config
from cppo_jax.eval import policy as eval_checkpoint
from cppo_jax.models import known
from cppo_jax.train.sft import SFTConfig
from tests.conftest import build_arith_model_dir
from tests.documented import (
    _ENV,
    NOT_RUN,
    Doc,
    _head,
    _synopsis,
    collect,
    run_in_process,
    run_plan_commands,
)
from tests.test_launch import model_folder
from tools import docs_gen

ROOT = Path(__file__).resolve().parents[1]
GPU_GB = 80  # the documented GPU (docs/reproducing.md, docs/scale_out.md, gpu_node.sh's default)
TPU_CHIPS = {"v4": (2, 32)}  # generation: (cores per chip in the slice name, GB per chip)


# ---- stand-ins for what the documentation assumes exists ------------------------------------------


class StandIns:
    def __init__(self, tmp: Path, docs: list[Doc]):
        self.tmp, self.docs, self.made = tmp, docs, {}

    def model(self, path: str) -> str:
        name = known.find_known_model(path)
        assert name, f"{path}: no such folder and not a model this test can stand in for"
        if name not in self.made:
            folder = model_folder(self.tmp / "models", name, known.KNOWN_MODELS[name])
            self.made[name] = str(folder)
        return self.made[name]

    def train_file(self, path: str) -> str:
        if path not in self.made:
            rows = [
                {
                    "problem": f"What is {i} + {i}?",
                    "solution": f"It is $\\boxed{{{2 * i}}}$.",
                    "question": f"Tom has {i} pens and buys {i} more. How many?",
                    "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
                }
                for i in range(48)
            ]
            out = self.tmp / "data" / f"train_{len(self.made)}.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(json.dumps(r) + "\n" for r in rows))
            self.made[path] = str(out)
        return self.made[path]

    def gsm8k_sample(self) -> str:
        if "gsm8k" not in self.made:
            src = ROOT / "cppo_jax" / "assets" / "datasets" / "gsm8k" / "train.jsonl.gz"
            with gzip.open(src, "rt") as f:
                rows = [next(f) for _ in range(64)]
            out = self.tmp / "data" / "gsm8k_first64.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(rows))
            self.made["gsm8k"] = str(out)
        return self.made["gsm8k"]

    def run_folder(self, path: str) -> str:
        """`runs/NAME[/best]` as the documented training command with run_name NAME leaves it."""
        import numpy as np

        from cppo_jax.config.files import save_config
        from cppo_jax.train.checkpoint import Checkpointer

        run = Path(path)
        best = run.name == "best"
        if best:
            run = run.parent
        if str(run) not in self.made:
            config, overrides = self._training_command(run.name)
            cfg = load_config(config, [*self.substitute(overrides), "trainer.dry_run=false"])
            folder = self.tmp / "runs" / run.name
            (folder / "checkpoints").mkdir(parents=True)
            save_config(cfg, folder / "config.json")
            ckpt = Checkpointer(folder / "checkpoints")
            ckpt.save(100, {"stand_in": np.zeros(1)}, {"step": 100})
            ckpt.close()
            self.made[str(run)] = str(folder)
        folder = Path(self.made[str(run)])
        if best:
            rcfg = eval_checkpoint.run_config(folder)
            return self.model(Path(rcfg.model.path).name if rcfg.model.path else str(folder))
        return str(folder)

    def _training_command(self, run_name: str) -> tuple[str, list[str]]:
        for d in self.docs:  # a training command, direct or through a launch script
            argv = shlex.split(d.text)
            if f"trainer.run_name={run_name}" in argv and "--config" in argv:
                config, overrides = _config_and_overrides(argv)
                if "--model" in argv:
                    overrides.insert(0, f"model.path={argv[argv.index('--model') + 1]}")
                return config, overrides
        for path in sorted((ROOT / "configs").glob("*.py")):
            with contextlib.suppress(Exception):
                if load_config(path).trainer.run_name == run_name:
                    return str(path), []
        raise AssertionError(f"no documented command makes the run folder runs/{run_name}")

    def substitute(self, argv: list[str]) -> list[str]:
        out = []
        flag = None
        for a in argv:
            key, eq, value = a.partition("=")
            if flag in ("--model",) and a.startswith("/") and not Path(a).exists():
                a = self.model(a)
            elif flag == "--checkpoint" and not Path(ROOT / a).exists():
                a = self.run_folder(a) if a.startswith("runs/") else self.model(a)
            elif eq and value.startswith("/") and not Path(value).exists():
                if key in ("model.path", "model.tokenizer", "model.init_checkpoint"):
                    a = f"{key}={self.model(value)}"
                elif key == "data.train":
                    a = f"{key}={self.train_file(value)}"
            out.append(a)
            flag = a if a.startswith("--") else None
        return out


def _config_and_overrides(argv: list[str]) -> tuple[str, list[str]]:
    i = argv.index("--config")
    return argv[i + 1], [a for a in argv if re.match(r"^[a-z_]+(\.[a-z_]+)*=", a)]


# ---- running ---------------------------------------------------------------------------------


def _call(fn, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    out = io.StringIO()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = fn(argv)
            except SystemExit as e:
                code = e.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return int(code or 0), out.getvalue()


@dataclasses.dataclass
class Compile:
    """A `plan --compile-for` command (as shown, and the overrides that shrink it), which
    `Runner.compile_all` runs with the others after the rest."""

    source: str
    argv: list[str]
    shrink: list[str]


def _mesh_product(overrides: list[str]) -> int | None:
    sizes = [int(a.split("=")[1]) for a in overrides if re.match(r"^mesh\.(data|fsdp|tensor)=", a)]
    return math.prod(sizes) if sizes and -1 not in sizes else None


class Runner:
    def __init__(self, stand_ins: StandIns):
        self.s = stand_ins

    def run(self, doc: Doc) -> tuple[str | Compile, list[Doc]]:
        """What happened ("ok: ..." or "not run: ..."; raises AssertionError when it fails), or the
        `plan --compile-for` command to run later (`compile_all`), and the commands a launch script
        printed (run next)."""
        text = doc.text
        head = _head(text)
        for prefix, why in NOT_RUN.items():
            if head.startswith(prefix) and head != "make demo":
                return f"not run: {why}", []
        if " -m pip " in head:
            return f"not run: {NOT_RUN['pip ']}", []
        if head.startswith("("):
            return "a note of the dry run, not a command", []
        if _synopsis(text):
            return "synopsis (placeholders): not a command", []
        env = dict(re.findall(r"([A-Z_][A-Z0-9_]*)=(\S*)", _ENV.match(text).group(1)))
        if head == "make demo":
            recipe = (ROOT / "Makefile").read_text().split("\ndemo:")[1].splitlines()[1]
            head = recipe.strip().replace("$(PY)", "python")
        argv = shlex.split(head, comments=True)
        argv[0] = argv[0].removeprefix(f"{ROOT}/")
        if "cppo_jax.launch" in argv:
            return self.launch(argv[argv.index("cppo_jax.launch") + 1 :], env), []
        m = re.match(r"^\S*python3? -m (?:cppo_jax|tools)\.(\w+)", head)
        if m:
            return self.module(m.group(1), argv[3:], doc), []
        if argv[0] == "sbatch":
            script = next(i for i, a in enumerate(argv) if a.startswith("launch/"))
            nodes = next((a.split("=")[1] for a in argv[:script] if a.startswith("--nodes=")), "2")
            env["SLURM_JOB_NODELIST"] = ",".join(f"node{i}" for i in range(int(nodes)))
            argv = argv[script:]
        if argv[0].startswith("launch/"):
            return self.script(argv, env, doc)
        raise AssertionError(f"no way to run {text!r}")

    def launch(self, argv: list[str], env: dict, devices: int | None = None, gb=None) -> str:
        drop = {"--coordinator", "--num-processes", "--process-id"}
        dropped = [a for a in argv if a in drop]
        if env.pop("CPPO_DISTRIBUTED", None):  # one process here: the cluster is not joined
            dropped.append("CPPO_DISTRIBUTED")
        argv = [a for i, a in enumerate(argv) if a not in drop and argv[i - 1] not in drop]
        argv = self.s.substitute(argv)
        config, overrides = _config_and_overrides(argv)
        cfg = load_config(config, overrides, expected=(Config, SFTConfig))
        if isinstance(cfg, SFTConfig):  # the warm start has no dry run: two steps, out of the repo
            out_dir = self.s.tmp / "sft_out"
            shrink = ["steps=2", "warmup=1", "batch=4", "eval_size=4", "data.num_train=64"]
            shrink.append(f"out={out_dir}")
            code, out = _call(launch.main, [*argv, *shrink], env)
            assert code == 0 and (out_dir / "config.json").is_file(), out[-3000:]
            return f"ok: shrunk ({' '.join(shrink[:-1])})"
        shrink = ["trainer.dry_run=true", "trainer.eval_size=16"]
        if cfg.data.train == "gsm8k":
            shrink.append(f"data.train={self.s.gsm8k_sample()}")
        if cfg.data.train == "arith":  # generated: 20000 problems by default
            shrink.append("data.num_train=256")
        paper_model = known.find_known_model(cfg.model.path)
        if devices is None and paper_model:
            devices, gb = _mesh_product(overrides) or 1, GPU_GB
        machine = ["--devices", str(devices), "--device-memory-gb", str(gb)] if devices else []
        code, out = _call(launch.main, [*argv, *shrink, *machine], env)
        assert code == 0 and "dry run: config, model files" in out, out[-3000:]
        where = f"{devices} x {gb} GB" if devices else "this machine"
        note = f" (multi-process flags {dropped} dropped)" if dropped else ""
        return f"ok: dry run for {where}{note}"

    def module(self, name: str, argv: list[str], doc: Doc) -> str | Compile:
        argv = self.s.substitute(argv)
        if name == "docs_gen":
            code, out = _call(docs_gen.main, ["--check"], {})
            assert code == 0, out
            return "ok: as --check"
        if name == "evaluate":
            code, out = _call(evaluate.main, [*argv, "--dry-run"], {})
            assert code == 0 and "dry run: would evaluate" in out, out[-3000:]
            return "ok: --dry-run"
        assert name == "plan", name
        if "--compile-for" in argv:
            return self.compile_for(argv, doc)
        code, out = _call(plan.main, argv, {})
        shown = [ln for ln in doc.output if ln != "..."]
        for line in shown:
            pattern = ".*".join(re.escape(p) for p in line.split("..."))
            assert re.search(pattern, out), f"shown output line not printed: {line}\n{out[-3000:]}"
        fits_no = any(ln.startswith("fits: no") for ln in shown)
        assert code == (1 if fits_no else 0), out[-3000:]
        return f"ok: exit {code}, {len(shown)} shown output lines matched"

    def compile_for(self, argv: list[str], doc: Doc) -> Compile:
        """`plan --compile-for TARGET` at a tiny shape: the config's model replaced by a 2-layer
        one, prompts of 16 and completions of 8 tokens, no search (a LoRA rank above the tiny
        model's narrowest projection, 16, cut to 8). The target's devices, the config's mesh rules
        and the report are real. Run later, with the others, by `compile_all`."""
        tiny = self.s.tmp / "compile_for_model"
        if not (tiny / "config.json").is_file():
            build_arith_model_dir(tiny, hidden=32, layers=2)
        shrink = [
            f"model.path={tiny}",
            "data.max_prompt_len=16",
            "rollout.max_new_tokens=8",
        ]
        config, overrides = _config_and_overrides(argv)
        lora = load_config(config, [*overrides, *shrink]).model.lora
        if lora.enabled and lora.rank > 8:
            shrink.append("model.lora.rank=8")
        shrink.append("--no-search")
        return Compile(doc.source, argv, shrink)

    def compile_all(self, compiles: list[Compile]) -> list[tuple[str, float, str | None]]:
        """Every `plan --compile-for` command, all in one process of their own (libtpu and the CUDA
        plugin are loaded only there, and once): per command its status, seconds and what failed
        (None). A command that differs from an earlier one only in how it names the config file
        (`gsm8k_1p5b` for `configs/gsm8k_1p5b.py`: the same file, as `resolve_config_path` finds
        it for `plan`) is that command's run, not another."""
        first: dict[tuple, int] = {}  # the command, its config resolved -> its index in `runs`
        runs: list[list[str]] = []
        of = []
        for c in compiles:
            i = c.argv.index("--config") + 1
            key = (str(resolve_config_path(c.argv[i])), *c.argv[:i], *c.argv[i + 1 :], *c.shrink)
            if key not in first:
                first[key] = len(runs)
                runs.append([*c.argv, *c.shrink])
            of.append(first[key])
        results = run_plan_commands(runs, dict(os.environ), timeout=600 * len(runs))
        out = []
        for n, (c, i) in enumerate(zip(compiles, of)):
            r, target = results[i], c.argv[c.argv.index("--compile-for") + 1]
            ok = (
                r["code"] == 0
                and f"compiled for {target}: " in r["out"]
                and "fits: yes" in r["out"]
            )
            if of.index(i) < n:  # an earlier command was this one's run
                status, seconds = f"as {compiles[of.index(i)].source} (the same config file)", 0.0
            else:
                status = f"compiled for {target} at a tiny shape ({' '.join(c.shrink[1:])})"
                seconds = r["seconds"]
            failure = None if ok else f"exit {r['code']}\n{r['out'][-3000:]}\n{r['err'][-3000:]}"
            out.append((f"ok: {status}" if ok else "FAILED", seconds, failure))
        return out

    def script(self, argv: list[str], env: dict, doc: Doc) -> tuple[str, list[Doc]]:
        argv = [argv[0], "--dry-run", *self.s.substitute(argv[1:])]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CPPO_"))}
        clean.pop("GPU_MEMORY_GB", None)
        out = subprocess.run(
            ["bash", *argv],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env={**clean, "PATH": "/usr/bin:/bin", **env},
        )
        assert out.returncode == 0, out.stdout + out.stderr
        children = []
        for line in out.stdout.splitlines():
            if line.startswith("+ "):
                child = Doc(f"{doc.source} -> {argv[0]} --dry-run", line[2:].split("   #")[0])
                children.append(child)
        return "ok: --dry-run", [self.child(c, argv) for c in children]

    def child(self, doc: Doc, parent: list[str]) -> Doc:
        """A trainer command a script printed, with the devices it would run on attached."""
        argv = shlex.split(doc.text)
        env = dict(a.split("=", 1) for a in argv if re.match(r"^[A-Z_][A-Z0-9_]*=", a))
        devices = None
        if "cppo_jax.launch" in argv and "CUDA_VISIBLE_DEVICES" in env:
            devices = len(env["CUDA_VISIBLE_DEVICES"].split(","))
        elif argv[0] == "srun":
            nproc = int(argv[argv.index("--num-processes") + 1])
            per_gpu = "SLURM_LOCALID" in " ".join(argv)
            devices = nproc if per_gpu else nproc * 8
        elif argv[0] == "gcloud":
            name = argv[argv.index("ssh") + 1]
            gen, cores = re.search(r"(v\d+)[a-z]*-(\d+)$", name).groups()
            per_chip, gb = TPU_CHIPS[gen]
            doc.text = argv[argv.index("--command") + 1].split("&&", 1)[1].strip()
            doc.devices = (int(cores) // per_chip, gb)
            return doc
        doc.devices = (devices, GPU_GB) if devices else None
        return doc


# ---- the test --------------------------------------------------------------------------------


def test_extraction_finds_the_commands_of_every_source():
    docs = collect()
    sources = {s.split(":")[0].split(" docstring")[0] for d in docs for s in [d.source, *d.also]}
    assert {"README.md", "docs/reproducing.md", "docs/scale_out.md", "docs/running.md"} <= sources
    assert "configs/gsm8k_1p5b.py" in sources and "configs/math7b.py" in sources
    texts = [d.text for d in docs]
    assert any(
        t.startswith("launch/gpu_node.sh --model /models/Qwen2.5-7B-Instruct") for t in texts
    )
    assert any(t.startswith("python -m cppo_jax.evaluate --checkpoint runs/") for t in texts)
    assert "make demo" in texts
    assert _synopsis("python -m cppo_jax.launch --config CONFIG.py [key.path=value ...]")
    assert not _synopsis("python -m cppo_jax.launch --config configs/tiny_cpu.py trainer.steps=20")
    shown = next(d for d in docs if d.text.startswith("python -m cppo_jax.plan") and d.output)
    assert any(line.startswith("fits: ") for line in shown.output)


def test_a_command_run_in_process_gives_its_status_and_everything_it_wrote():
    """What Python and C++ code write, through sys.stdout or straight to file descriptors 1 and 2,
    comes back in order of stream; the suite's own streams are as before afterwards."""

    def main(argv):
        print("python out", argv)
        sys.stderr.write("python err\n")
        sys.stdout.flush()
        os.write(1, b"fd out\n")
        os.write(2, b"fd err\n")
        return 3

    before = sys.stdout, sys.stderr, os.fstat(1).st_ino, os.fstat(2).st_ino
    code, out, err = run_in_process(main, ["x"])
    assert code == 3
    assert out == "python out ['x']\nfd out\n" and err == "python err\nfd err\n"
    assert (sys.stdout, sys.stderr, os.fstat(1).st_ino, os.fstat(2).st_ino) == before


@pytest.mark.parametrize(
    "exit_with, code, needle",
    [
        (SystemExit(2), 2, ""),  # argparse's error
        (SystemExit("error: no such config"), 1, "error: no such config"),  # as Python prints it
        (SystemExit(None), 0, ""),
        (ValueError("bad value"), 1, "ValueError: bad value"),  # the traceback, as python -m shows
    ],
)
def test_a_command_run_in_process_exits_as_python_m_would(exit_with, code, needle):
    def main(argv):
        raise exit_with

    got, out, err = run_in_process(main, [])
    assert got == code and out == ""
    assert needle in err and (("Traceback" in err) == isinstance(exit_with, ValueError))


@pytest.mark.slow
def test_every_documented_command_runs(tmp_path, monkeypatch, pytestconfig):
    monkeypatch.chdir(ROOT)
    docs = collect()
    runner = Runner(StandIns(tmp_path, docs))
    report, failures, compiles = [], [], []  # report: [status, seconds, where, command]
    queue = list(docs)
    while queue:
        doc = queue.pop(0)
        start = time.perf_counter()
        try:
            devices = doc.devices
            if devices and "cppo_jax.launch" in doc.text:
                argv = shlex.split(doc.text)
                env = dict(a.split("=", 1) for a in argv if re.match(r"^[A-Z_]+[A-Z0-9_]*=", a))
                status = runner.launch(argv[argv.index("cppo_jax.launch") + 1 :], env, *devices)
                children = []
            else:
                status, children = runner.run(doc)
        except Exception as e:
            status, children = "FAILED", []
            failures.append(f"{doc.source}: {doc.text}\n{type(e).__name__}: {e}")
        where = doc.source + (f" (+{len(doc.also)} more)" if doc.also else "")
        if isinstance(status, Compile):
            compiles.append((len(report), doc, status))
        report.append([status, time.perf_counter() - start, where, doc.text])
        queue = children + queue
    compiled = runner.compile_all([c for _, _, c in compiles]) if compiles else []
    for (i, doc, _), (status, seconds, failure) in zip(compiles, compiled):
        report[i][:2] = status, seconds
        if failure:
            failures.append(f"{doc.source}: {doc.text}\n{failure}")
    report = [
        f"{status:<60} {seconds:5.1f} s  {where}: {text}" for status, seconds, where, text in report
    ]
    ran = sum(line.startswith("ok") for line in report)
    lines = [f"{len(report)} documented commands, {ran} run, {len(failures)} failed:", *report]
    pytestconfig.documented_commands = lines
    print("\n".join(lines))
    assert not failures, "\n\n".join(failures) + "\n\n" + "\n".join(lines)
    assert ran >= 15  # the docs show that many runnable commands at least
