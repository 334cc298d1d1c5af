"""The documentation stays in step with the code: the generated config reference, links, figures."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cppo_jax.config.schema import Config
from cppo_jax.train.sft import SFTConfig
from tools import docs_gen

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = (
    "README.md",
    "concepts.md",
    "configuration.md",
    "running.md",
    "metrics.md",
    "reproducing.md",
    "troubleshooting.md",
    "lora.md",
)


def _leaf_keys(instance, prefix: str) -> list[str]:
    keys = []
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value) and prefix != "sft.":
            keys += _leaf_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_configuration_md_is_up_to_date(capsys):
    code = docs_gen.main(["--check"])
    assert code == 0, capsys.readouterr().err


def test_every_config_key_is_documented():
    text = (DOCS / "configuration.md").read_text()
    keys = _leaf_keys(Config(), "") + _leaf_keys(SFTConfig(), "sft.")
    assert len(keys) > 80
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, f"not in docs/configuration.md: {missing}"
    assert sorted(keys) == sorted(docs_gen.all_keys())
    # Every row has a meaning (the last cell is not empty).
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert all(not line.rstrip().endswith("|  |") for line in rows)


def test_check_fails_on_drift_and_generation_names_the_problem(tmp_path, monkeypatch, capsys):
    drifted = tmp_path / "configuration.md"
    drifted.write_text((DOCS / "configuration.md").read_text().replace("`cppo.beta`", "`cppo.b`"))
    assert docs_gen.main(["--check", "--out", str(drifted)]) == 1
    assert "out of date" in capsys.readouterr().err

    monkeypatch.setitem(docs_gen.MEANINGS, "cppo.no_such_key", "stale")
    with pytest.raises(ValueError, match=r"no longer exist: cppo\.no_such_key"):
        docs_gen.render()
    monkeypatch.delitem(docs_gen.MEANINGS, "cppo.no_such_key")
    monkeypatch.delitem(docs_gen.MEANINGS, "cppo.beta")
    monkeypatch.setattr(docs_gen, "field_comments", lambda cls: {})
    with pytest.raises(ValueError, match=r"no meaning for config key\(s\) .*cppo\.beta"):
        docs_gen.render()


def test_source_is_read_for_comments_and_rules():
    from cppo_jax.config.run import MeshConfig
    from cppo_jax.config.schema import CPPOConfig, DataConfig

    assert "held out of train" in docs_gen.field_comments(DataConfig)["val_size"]
    rules = docs_gen.validation_rules(CPPOConfig)
    assert rules["cppo.pruning_rate"] == ["in [0, 1)"]
    assert rules["cppo.metric"] == [
        "one of `smallest`, `largest`, `random`, `max_variance`, `proportional`, `dppo`"
    ]
    assert "mesh.fsdp" in docs_gen.validation_rules(
        MeshConfig
    )  # keys built in a loop over zip(...)


def test_pages_exist_and_relative_links_resolve():
    broken = []
    for name in PAGES:
        page = DOCS / name
        assert page.is_file(), name
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{name} -> {target}")
    assert not broken, broken
    index = (DOCS / "README.md").read_text()
    for name in PAGES[1:]:
        assert f"]({name})" in index, f"docs/README.md does not link {name}"


def test_readme_starts_with_the_two_commands_and_holds_no_lab_notes_on_its_first_screen():
    """The two commands first; no timing, commit hash or load average in the first 25 lines (those
    go to CONTRIBUTING.md and benchmarks/results/README.md); every relative link resolves."""
    text = (ROOT / "README.md").read_text()
    first = "\n".join(text.splitlines()[:25])
    assert first.index("make demo") < first.index("make test") < first.index("**Status:**")
    lab = {
        "a timing": r"\b\d+(\.\d+)? ?(min|s)\b",
        "a commit hash": r"\b[0-9a-f]{7,40}\b",
        "a load average": r"load average|\bload \d",
    }
    found = {what: m.group(0) for what, rx in lab.items() if (m := re.search(rx, first))}
    assert not found, f"README's first screen holds {found}"
    for page in (
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "benchmarks/results/README.md",
    ):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            assert (page.parent / target.split("#")[0]).exists(), f"{page.name} -> {target}"


def test_figure_is_committed():
    png = DOCS / "figures" / "pruning.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "figures/pruning.png" in (DOCS / "concepts.md").read_text()
