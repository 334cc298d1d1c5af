"""Commands shown by the documentation, read at test time (tests/test_documented_commands.py runs them).

Sources: README.md and docs/*.md (fenced code blocks, with `$ ` prompts and the output shown after them,
and inline code), the module docstrings of configs/*.py (indented lines and inline code) and the `--help`
of cppo_jax.launch / evaluate / plan. A program named in prose without arguments is not a command; a
synopsis (`[...]`, `...`, an upper-case placeholder such as CONFIG) is kept and reported, not run.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest

from cppo_jax import evaluate, launch, plan

ROOT = Path(__file__).resolve().parents[1]

ENTRY_POINTS = {"launch": launch.main, "evaluate": evaluate.main, "plan": plan.main}
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
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        ENTRY_POINTS[name](["--help"])
    return out.getvalue()


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
