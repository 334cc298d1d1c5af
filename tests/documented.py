"""Commands shown by the documentation, read at test time (tests/test_documented_commands.py runs them).

Sources: README.md and docs/*.md (fenced code blocks, with `$ ` prompts and the output shown after them,
and inline code), the module docstrings of configs/*.py (indented lines and inline code) and the `--help`
of cppo_jax.launch / evaluate / plan. A program named in prose without arguments is not a command; a
synopsis (`[...]`, `...`, an upper-case placeholder such as CONFIG) is kept and reported, not run.

Also how the tests run `python -m cppo_jax.plan` commands in a process of their own without starting
one per command (libtpu, the CUDA plugin and JAX loaded once): `run_in_process` runs a command line's
`main` with what it writes captured at the file descriptors, and `python -m tests.documented ARGVS`
runs a JSON list of plan command lines that way, one after the other, printing a `RESULT` line for
each. Nothing here imports JAX before a command does.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENTRY_POINTS = ("launch", "evaluate", "plan")  # python -m cppo_jax.NAME
NOT_RUN = {
    "pip ": "installs packages (network)",
    "python -m cppo_jax.planning.aot --install-": "installs a compiler (network; make test runs it)",
    "huggingface-cli ": "downloads a model (network)",
    "python -m cppo_jax.data.datasets ": "downloads a data set (network; tests/test_math_train_recipe.py runs it)",
    "gcloud ": "needs a Google Cloud project",
    "make ": "sets up or is this test suite",
    ".venv/bin/ruff ": "lint: make test runs it",
    "kill ": "stops the server a launch script started",
    "mkdir ": "a step of a launch script",
    "rm ": "a step of a launch script",
    "touch ": "a step of a launch script",
    "ln ": "a step of a launch script",
    "python3 -m venv ": "installs the vLLM environment (network)",
    "setsid ": "starts the vLLM server (tests/test_vllm.py starts a real one)",
    "echo ": "a step of a launch script",
}
_ENV = re.compile(r"^(?:env\s+)?((?:[A-Z_][A-Z0-9_]*=\S*\s+)*)")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")


@dataclasses.dataclass
class Doc:
    source: str
    text: str
    output: list[str] = dataclasses.field(default_factory=list)
    also: list[str] = dataclasses.field(default_factory=list)  # other places showing it
    devices: tuple[int, int] | None = None  # (count, GB each) a launch script runs it on


# ---- extraction ------------------------------------------------------------------------------


def _head(text: str) -> str:
    """The command without leading environment assignments (and `env`)."""
    return text[_ENV.match(text).end() :]


def _is_command(text: str) -> bool:
    head = _head(text)
    if head.startswith(("python -m cppo_jax.", "launch/", "sbatch ", "make ")):
        return True
    if re.match(r"^\S*python3? -m cppo_jax\.", head):
        return True
    return head.startswith(tuple(NOT_RUN)) and len(head.split()) > 1


def _is_name(text: str) -> bool:
    """A program named in prose (`launch/gpu_node.sh`, `python -m cppo_jax.plan`): no arguments."""
    argv = _head(text).split()
    return len(argv) == 1 or (len(argv) == 3 and argv[1] == "-m")


def _synopsis(text: str) -> bool:
    if "[" in text or "..." in text or "|" in text or "<" in text or "{" in text:
        return True
    for token in _head(text).split():
        for piece in re.split(r"[=:,/]", token):
            if _PLACEHOLDER.match(piece.removesuffix(".py")):
                return True
    return False


def _join_continued(lines: list[str]) -> list[tuple[int, str]]:
    out, buf, start = [], "", 0
    for i, line in enumerate(lines):
        if not buf:
            start = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1].strip() + " "
            continue
        out.append((start, (buf + line.strip()).strip()))
        buf = ""
    return out


def _from_text(text: str, source: str, fenced: bool) -> list[Doc]:
    """Commands of a Markdown text (fenced code blocks) or a docstring (indented lines)."""
    docs: list[Doc] = []
    lines = text.splitlines()
    if fenced:
        blocks, inside, block, first = [], False, [], 0
        for i, line in enumerate(lines):
            if line.strip().startswith("```"):
                if inside:
                    blocks.append((first, block))
                inside, block, first = not inside, [], i + 1
            elif inside:
                block.append(line)
    else:
        blocks = [(0, [ln if ln.startswith("    ") else "" for ln in lines])]
    for first, block in blocks:
        prompt = any(ln.startswith("$ ") for ln in block)
        current = None
        for i, line in _join_continued(block):
            if prompt and not line.startswith("$ "):
                if current is not None and line.strip():
                    current.output.append(line.strip())
                continue
            cmd = re.sub(r"\s+#(\s.*)?$", "", line.removeprefix("$ ")).strip()
            if cmd and _is_command(cmd):
                current = Doc(f"{source}:{first + i + 1}", cmd)
                docs.append(current)
    # Inline code spans in the prose (outside fenced blocks).
    prose = re.sub(r"```.*?```", "", text, flags=re.S) if fenced else text
    for m in re.finditer(r"`([^`]+)`", prose):
        cmd = " ".join(m.group(1).split())
        if _is_command(cmd) and not _is_name(cmd):
            line = text[: m.start()].count("\n") + 1 if fenced else 0
            docs.append(Doc(f"{source}:{line}" if fenced else source, cmd))
    return docs


def _help(name: str) -> str:
    code, out, err = run_in_process(importlib.import_module(f"cppo_jax.{name}").main, ["--help"])
    assert code == 0, err
    return out


def collect() -> list[Doc]:
    docs: list[Doc] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        docs += _from_text(path.read_text(), str(path.relative_to(ROOT)), fenced=True)
    for path in sorted((ROOT / "configs").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        docs += _from_text(doc, f"{path.relative_to(ROOT)} docstring", fenced=False)
    for name in ENTRY_POINTS:
        text = _help(name)
        usage = " ".join(text.split("\n\n")[0].split()).removeprefix("usage: ")
        docs.append(Doc(f"python -m cppo_jax.{name} --help (usage)", usage))
        docs += _from_text(text, f"python -m cppo_jax.{name} --help", fenced=False)
    unique: dict[str, Doc] = {}
    for d in docs:  # one run per command; every place that shows it is kept
        if d.text in unique:
            unique[d.text].also.append(d.source)
        else:
            unique[d.text] = d
    return list(unique.values())


# ---- running a command line in this process ---------------------------------------------------


def run_in_process(main, argv: list[str]) -> tuple[int, str, str]:
    """`main(argv)` as `python -m` runs it: its exit status (1 and the traceback on stderr for an
    exception), and what it wrote to stdout and stderr, through Python's streams or straight to file
    descriptors 1 and 2 (libtpu's and the CUDA plugin's C++ logging), which are redirected for the
    call."""
    py_out, py_err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile() as fd_out, tempfile.TemporaryFile() as fd_err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(fd_out.fileno(), 1)
        os.dup2(fd_err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(py_out), contextlib.redirect_stderr(py_err):
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code
                except Exception:
                    traceback.print_exc()
                    code = 1
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        written = []
        for f in (fd_out, fd_err):
            f.seek(0)
            written.append(f.read().decode(errors="replace"))
    if code is not None and not isinstance(code, int):  # SystemExit("message"), as Python prints it
        py_err.write(f"{code}\n")
        code = 1
    return code or 0, py_out.getvalue() + written[0], py_err.getvalue() + written[1]


def run_plan_commands(argvs: list[list[str]], env: dict[str, str], timeout: int) -> list[dict]:
    """`python -m cppo_jax.plan ARGV` for each of `argvs`, all in one new process (`env`, in the
    repository): per command its exit status, stdout, stderr and seconds. Raises AssertionError with
    the process's stderr when it dies before the last."""
    res = subprocess.run(
        [sys.executable, "-m", "tests.documented", json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=timeout,
    )
    results = [json.loads(x[7:]) for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(results) == len(argvs), res.stdout[-3000:] + res.stderr[-3000:]
    return results


if __name__ == "__main__":
    from cppo_jax import plan

    for argv in json.loads(sys.argv[1]):
        start = time.perf_counter()
        code, out, err = run_in_process(plan.main, argv)
        seconds = time.perf_counter() - start
        print("RESULT " + json.dumps({"code": code, "out": out, "err": err, "seconds": seconds}))
        sys.stdout.flush()
