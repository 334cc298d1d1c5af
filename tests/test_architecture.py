"""The package's shape: folders by role in layers (each imports only from the layers below it, as
`cppo_jax/__init__.py` draws them, and only the folders its own docstring names), no import cycle
between modules, imports inside functions included, and the modules with a size limit of their own
(`LIMITS`) within it. There is no cap for the others: a module's size follows its concern
(docs/conventions.md).

The graph is built from the source with `ast` (nothing is imported): an edge m -> n for every
`import n` / `from n import x` in m, at any depth (a function-level import is an import too). Importing a
submodule of one's own package (`from cppo_jax.rewards import registry`) is an edge to that submodule,
not to the package. A cycle is reported as the modules on it, in order.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cppo_jax"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package upwards
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = here[: len(here) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            else:
                continue
            for target in targets:
                # `import a.b.c` needs a.b.c; `from a.b import c` (c not a module) needs a.b.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [m0, m1, ..., m0], or None (depth-first search with colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 new, 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        colour[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if colour[n] == 1:
                return [*path[path.index(n) :], n]
            if colour[n] == 0 and (found := visit(n)):
                return found
        path.pop()
        colour[m] = 2
        return None

    for m in sorted(graph):
        if colour[m] == 0 and (found := visit(m)):
            return found
    return None


def unit_of(module: str) -> str:
    """The folder (or entry point) a module belongs to: `cppo_jax.train.trainer` -> `train`,
    `cppo_jax.rollout.vllm.client` -> `rollout.vllm`, `cppo_jax.launch` -> `launch`."""
    parts = module.split(".")[1:]
    if parts[:1] == ["rollout"] and len(parts) > 1 and (PACKAGE / "rollout" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0] if parts else ""


# The vLLM server's plugin: a top-level module on the server's PYTHONPATH, in the server's environment
# (torch and vLLM, not the trainer's packages): it imports nothing of cppo_jax and stands in no layer.
SERVER_SIDE = "rollout.vllm_plugin"


def layers(package: Path = PACKAGE) -> list[list[str]]:
    """The layers of the package's docstring, top first: its indented lines of comma-separated names."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""
    return [
        [n.strip() for n in line.split(",")]
        for line in doc.splitlines()
        if line.startswith("    ") and line.strip()
    ]


def upward_imports(graph: dict[str, set[str]], order: list[list[str]]) -> list[str]:
    """Every import from a module to one in its own layer's other folders or in a layer above."""
    rank = {unit: i for i, layer in enumerate(order) for unit in layer}
    bad = []
    for mod, targets in sorted(graph.items()):
        a = unit_of(mod)
        for t in sorted(targets):
            b = unit_of(t)
            if a and b and a != b and SERVER_SIDE not in (a, b) and rank[b] <= rank[a]:
                bad.append(f"{mod} -> {t} ({a} may not import {b})")
    return bad


def declared_imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each folder's 'May import:' line of its docstring, as a set ('nothing of the package': empty)."""
    out = {}
    for init in sorted(package.rglob("__init__.py")):
        unit = unit_of(module_name(init, package.parent))
        if not unit or init.parent.name == "vllm_plugin":
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        text = " ".join(doc.split())
        _, found, rest = text.partition("May import: ")
        assert found, f"{init}: its docstring names no 'May import:' folders"
        names = rest.rstrip(".").split(". ")[0]
        out[unit] = set() if names.startswith("nothing") else {n.strip() for n in names.split(",")}
    return out


def test_folders_import_only_the_layers_below_them():
    order = layers()
    graph = import_graph()
    assert not any(graph[m] for m in graph if unit_of(m) == SERVER_SIDE)
    units = {unit_of(m) for m in graph} - {"", SERVER_SIDE}
    listed = [u for layer in order for u in layer]
    assert sorted(listed) == sorted(units), "every folder and entry point is in one layer"
    assert upward_imports(graph, order) == []


def test_each_folder_says_its_role_and_what_it_imports():
    graph, order = import_graph(), layers()
    rank = {unit: i for i, layer in enumerate(order) for unit in layer}
    declared = declared_imports()
    folders = {unit_of(m) for m in graph if (PACKAGE / Path(*m.split(".")[1:])).is_dir()} - {""}
    assert folders <= set(declared), folders - set(declared)
    for unit, names in declared.items():
        assert all(rank[n] > rank[unit] for n in names), (
            f"{unit} declares an upward import: {names}"
        )
        used = {unit_of(t) for m, ts in graph.items() if unit_of(m) == unit for t in ts} - {unit}
        assert used <= names, f"{unit} imports {sorted(used - names)} without saying so"
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init}: say what the folder owns"


def test_the_layer_check_finds_an_upward_import(tmp_path):
    pkg = tmp_path / "cppo_jax"
    for d in ("low", "high"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text('"""Layers:\n\n    high\n    low\n"""\n')
    (pkg / "high" / "a.py").write_text("from cppo_jax.low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from cppo_jax.high import a\n")
    graph = import_graph(pkg)
    assert layers(pkg) == [["high"], ["low"]]
    assert upward_imports(graph, layers(pkg)) == [
        "cppo_jax.low.b -> cppo_jax.high.a (low may not import high)"
    ]
    assert unit_of("cppo_jax.rollout.vllm.client") == "rollout.vllm"
    assert unit_of("cppo_jax.rollout.draw") == "rollout"


def test_no_flat_module_families_are_left():
    """Modules that share a prefix (`config_*`, `trainer_*`, `aot_*`) belong in a folder of their own."""
    flat = [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
    prefixes = {}
    for stem in flat:
        prefixes.setdefault(stem.split("_")[0], []).append(stem)
    assert {k: v for k, v in prefixes.items() if len(v) > 1} == {}
    assert sorted(flat) == ["evaluate", "export", "launch", "plan"]  # the entry points


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert len(graph) > 20 and graph["cppo_jax.train.trainer"]  # the graph was really built
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_function_level_cycle(tmp_path):
    pkg = tmp_path / "cppo_jax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from cppo_jax.sub import b\n")
    (pkg / "a.py").write_text("def f():\n    from cppo_jax.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("import cppo_jax.c\n")
    (pkg / "c.py").write_text("def h():\n    from . import a\n")
    graph = import_graph(pkg)
    assert graph["cppo_jax.a"] == {"cppo_jax.sub.b"}
    assert graph["cppo_jax.sub"] == {"cppo_jax.sub.b"}
    assert find_cycle(graph) == ["cppo_jax.a", "cppo_jax.sub.b", "cppo_jax.c", "cppo_jax.a"]


# The modules held to a size of their own: the trainer reads as the paper's step over its roles (issue
# #35: under 300 lines). No other module has a cap: size follows concern (docs/conventions.md).
LIMITS = {"cppo_jax/train/trainer.py": 300}


def module_lines(package: Path = PACKAGE) -> dict[str, int]:
    return {
        str(p.relative_to(package.parent)): len(p.read_text().splitlines())
        for p in sorted(package.rglob("*.py"))
    }


def over_limit(lines: dict[str, int], limits: dict[str, int] = LIMITS) -> dict[str, int]:
    """The modules over their own entry in `limits` (the others have none)."""
    return {m: n for m, n in lines.items() if m in limits and n > limits[m]}


def test_the_modules_with_a_limit_are_within_it():
    lines = module_lines()
    assert (
        len(lines) > 20 and lines["cppo_jax/config/schema.py"] > 0
    )  # the modules were really counted
    assert all(m in lines for m in LIMITS), LIMITS  # a renamed module is not silently unlimited
    over = over_limit(lines)
    assert not over, f"over their LIMITS entry (split by concern): {over}"


def test_the_line_count_sees_a_module_grow(tmp_path):
    pkg = tmp_path / "cppo_jax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "small.py").write_text("x = 1\n" * 300)
    (pkg / "sub" / "big.py").write_text("x = 1\n" * 301)
    lines = module_lines(pkg)
    assert lines == {"cppo_jax/small.py": 300, "cppo_jax/sub/big.py": 301}
    assert over_limit(lines, {}) == {}  # no limit of its own: any size
    limits = {"cppo_jax/small.py": 300, "cppo_jax/sub/big.py": 300}
    assert over_limit(lines, limits) == {"cppo_jax/sub/big.py": 301}
