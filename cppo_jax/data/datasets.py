"""Reading question/answer data sets: shipped ones, local files and folders, the hub.

- `load_records(name_or_path, split)`: a shipped data set by name (`gsm8k` train/test, `math500`, `amc23`,
  `aime24`, all test), a local `.jsonl`, `.jsonl.gz`, `.json` (a list of objects), `.csv` or `.parquet`
  file, a folder holding `<split>.<one of those>`, a local Hugging Face dataset folder (what
  `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write: Arrow files, read with pyarrow), or, with
  network access and the `datasets` package, a hub name.
  Rows that are not valid UTF-8, not a JSON object, or lack a required field are skipped and listed in the
  result's `bad_rows` as `(line number, reason)`; with `strict=True` the first one raises ValueError.
- `load_examples(name_or_path, split, task)`: those rows as examples of `task`, in the one example format
  of `cppo_jax.data.example_format` (`to_example`).
"""

from __future__ import annotations

import csv
import gzip
import importlib.resources
import importlib.util
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence

from cppo_jax.data.example_format import TASKS, task_name, to_example

__all__ = ["SHIPPED", "Records", "load_examples", "load_records"]

# Shipped name -> (splits, required fields, task for to_example).
SHIPPED: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "gsm8k": (("train", "test"), ("question", "answer"), "gsm8k"),
    "math500": (("test",), ("problem", "solution", "answer"), "math"),
    "amc23": (("test",), ("problem", "answer"), "amc23"),
    "aime24": (("test",), ("problem", "answer"), "aime24"),
}
# Common hub names of the shipped sets, served from the shipped copies.
_ALIASES = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "huggingfaceh4/math-500": "math500",
    "math-500": "math500",
    "math500": "math500",
    "amc23": "amc23",
    "aime24": "aime24",
}
_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".csv", ".parquet")


class Records(list):
    """A list of row dicts, with `source` (where they came from) and `bad_rows` ((line number, reason) pairs)."""

    def __init__(self, rows: Iterable[dict] = (), source: str = "", bad_rows=None):
        super().__init__(rows)
        self.source = source
        self.bad_rows: list[tuple[int, str]] = list(bad_rows or [])


def load_records(
    name_or_path: str | os.PathLike,
    split: str | None = None,
    *,
    required: Sequence[str] | None = None,
    strict: bool = False,
) -> Records:
    """Rows of a shipped data set, a local file or folder, or a hub data set (see the module docstring).

    `required` names the fields every row must have (default: the shipped set's fields, else none).
    """
    text = os.fspath(name_or_path)
    shipped = _ALIASES.get(text.lower()) if isinstance(name_or_path, str) else None
    if (
        shipped is not None
    ):  # a shipped name wins over a local folder of that name; use "./name" for that
        splits, fields, _ = SHIPPED[shipped]
        split = _pick_split(shipped, split, splits)
        resource = importlib.resources.files("cppo_jax").joinpath(
            "assets", "datasets", shipped, f"{split}.jsonl.gz"
        )
        with resource.open("rb") as fh:
            data = fh.read()
        return _read_jsonl_bytes(
            _gunzip(data, f"{shipped}/{split}"),
            f"{shipped}/{split}",
            fields if required is None else required,
            strict,
        )
    required = tuple(required or ())
    if os.path.isdir(os.path.join(text, split or "train")) and os.path.isfile(
        os.path.join(text, "dataset_dict.json")
    ):  # DatasetDict.save_to_disk: one saved Dataset per split
        text = os.path.join(text, split or "train")
    if os.path.isfile(os.path.join(text, "state.json")):  # Dataset.save_to_disk
        return _from_rows(_arrow_rows(text), text, required, strict)
    if os.path.isdir(text):
        return _load_file(_split_file(text, split), required, strict)
    if os.path.isfile(text):
        return _load_file(text, required, strict)
    if text.endswith(_SUFFIXES) or (os.sep in text and not _looks_like_hub_name(text)):
        raise FileNotFoundError(f"data file {text!r} does not exist")
    return _load_hub(text, split, required, strict)


def load_examples(
    name_or_path: str | os.PathLike,
    split: str | None = None,
    task: str | None = None,
    *,
    strict: bool = False,
) -> list[dict]:
    """`to_example` of every good row of `load_records(name_or_path, split)`; `task` defaults to the shipped one."""
    if task is None:
        shipped = _ALIASES.get(os.fspath(name_or_path).lower())
        if shipped is None:
            raise ValueError(
                f"give the task of {os.fspath(name_or_path)!r}: one of {', '.join(TASKS)}"
            )
        task = SHIPPED[shipped][2]
    task = task_name(task)
    return [
        to_example(r, task)
        for r in load_records(name_or_path, split, required=TASKS[task], strict=strict)
    ]


# ----- helpers -----


def _pick_split(name: str, split: str | None, splits: tuple[str, ...]) -> str:
    if split is None:
        if len(splits) == 1:
            return splits[0]
        raise ValueError(f"data set {name!r} has several splits; choose one of {', '.join(splits)}")
    if split not in splits:
        raise ValueError(f"data set {name!r} has no split {split!r}; it has {', '.join(splits)}")
    return split


def _split_file(folder: str, split: str | None) -> str:
    candidates = [os.path.join(folder, f"{split or 'train'}{s}") for s in _SUFFIXES]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"folder {folder!r} has none of {', '.join(os.path.basename(p) for p in candidates)}"
    )


def _looks_like_hub_name(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def _gunzip(data: bytes, source: str) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{source}: not a valid gzip file ({e})") from e


def _load_file(path: str, required: tuple[str, ...], strict: bool) -> Records:
    if path.endswith(".parquet"):
        _need_pyarrow(path)
        import pyarrow.parquet as pq

        return _from_rows(pq.read_table(path).to_pylist(), path, required, strict)
    if path.endswith(".csv"):
        with open(path, newline="", encoding="utf-8") as fh:
            rows = [{k: v if v != "" else None for k, v in r.items()} for r in csv.DictReader(fh)]
        return _from_rows(rows, path, required, strict)  # an empty cell is a missing value
    if path.endswith(".json"):
        return _from_rows(_json_rows(path), path, required, strict)
    with open(path, "rb") as fh:
        data = fh.read()
    if path.endswith(".gz"):
        data = _gunzip(data, path)
    elif not path.endswith(".jsonl"):
        raise ValueError(f"{path!r}: expected one of {', '.join(_SUFFIXES)}")
    return _read_jsonl_bytes(data, path, required, strict)


def _json_rows(path: str) -> list:
    """A .json file's rows: a list of objects (a file of JSON lines is read as such)."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        rows = json.loads(data)
    except json.JSONDecodeError:
        return [row for _, row in _parse_lines(data.split(b"\n"))]
    if not isinstance(rows, list):
        raise ValueError(f"{path!r}: expected a JSON list of objects, got a {type(rows).__name__}")
    return rows


def _arrow_rows(folder: str) -> list[dict]:
    """The rows of a `Dataset.save_to_disk` folder (its Arrow stream files, in state.json's order)."""
    _need_pyarrow(folder)
    import pyarrow as pa

    with open(os.path.join(folder, "state.json"), encoding="utf-8") as fh:
        files = [f["filename"] for f in json.load(fh).get("_data_files", [])]
    if not files:
        raise ValueError(f"{folder!r}: state.json lists no data files")
    rows: list[dict] = []
    for name in files:
        with pa.memory_map(os.path.join(folder, name)) as source:
            rows += pa.ipc.open_stream(source).read_all().to_pylist()
    return rows


def _need_pyarrow(path: str) -> None:
    if importlib.util.find_spec("pyarrow") is None:
        raise ImportError(f"reading {path!r} needs pyarrow: pip install pyarrow")


def _read_jsonl_bytes(data: bytes, source: str, required: Sequence[str], strict: bool) -> Records:
    records = Records(source=source)
    for lineno, row in _parse_lines(data.split(b"\n")):
        if isinstance(row, str):
            if strict:
                raise ValueError(f"{source}, line {lineno}: {row}")
            records.bad_rows.append((lineno, row))
        else:
            problem = _check_fields(row, required)
            if problem:
                if strict:
                    raise ValueError(f"{source}, line {lineno}: {problem}")
                records.bad_rows.append((lineno, problem))
            else:
                records.append(row)
    return records


def _parse_lines(lines: list[bytes]) -> Iterator[tuple[int, dict | str]]:
    """(1-based line number, row dict or the reason it is bad); blank lines are skipped."""
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield lineno, f"invalid UTF-8 ({e.reason} at byte {e.start})"
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield lineno, f"invalid JSON ({e.msg} at column {e.colno})"
            continue
        if not isinstance(row, dict):
            yield lineno, f"a JSON {type(row).__name__}, not an object"
            continue
        yield lineno, row


def _check_fields(row: dict, required: Sequence[str]) -> str | None:
    missing = [k for k in required if row.get(k) is None]
    return f"missing field(s) {missing}" if missing else None


def _from_rows(rows: Iterable, source: str, required: Sequence[str], strict: bool) -> Records:
    """Rows (1-based numbers) checked for the required fields, as `Records`."""
    records = Records(source=source)
    for rowno, row in enumerate(rows, start=1):
        problem = (
            _check_fields(row, required)
            if isinstance(row, dict)
            else (row if isinstance(row, str) else f"a JSON {type(row).__name__}, not an object")
        )
        if problem:
            if strict:
                raise ValueError(f"{source}, row {rowno}: {problem}")
            records.bad_rows.append((rowno, problem))
        else:
            records.append(dict(row))
    return records


def _load_hub(name: str, split: str | None, required: tuple[str, ...], strict: bool) -> Records:
    known = ", ".join(SHIPPED)
    if importlib.util.find_spec("datasets") is None:
        raise FileNotFoundError(
            f"{name!r} is neither a shipped data set ({known}) nor an existing file; "
            "loading a data set from the Hugging Face hub needs network access and the `datasets` "
            "package (pip install datasets)"
        )
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:
        raise FileNotFoundError(
            f"{name!r} is neither a shipped data set ({known}) nor an existing file, and the hub "
            f"could not provide it: {type(e).__name__}: {e}"
        ) from e
    return _from_rows(ds, f"hub:{name}/{split or 'train'}", required, strict)


# ----- a local copy: `python -m cppo_jax.data.datasets --write OUT SOURCE` -----

MATH_TRAIN_HUB = "DigitalLearningGmbH/MATH-lighteval"  # the released code's MATH training split


def write_local(
    source: str, out: str | os.PathLike, split: str = "train", task: str = "math"
) -> dict:
    """Write the rows of `source` (a hub name, which needs `datasets` and a network, or any file or
    folder `load_records` reads) that make an example of `task` to the `.jsonl` file `out`, with the
    task's fields only (math: problem, solution), the file `data.train` takes. Returns the counts."""
    task = task_name(task)
    records = load_records(source, split, required=TASKS[task])
    kept, bad = [], list(records.bad_rows)
    for i, row in enumerate(records, 1):
        try:
            to_example(row, task)
        except ValueError as e:  # e.g. a MATH solution without \boxed{}: no gold answer
            bad.append((i, str(e)))
            continue
        kept.append({k: row[k] for k in TASKS[task]})
    if not kept:
        raise ValueError(f"{source!r} (split {split!r}) has no row that makes a {task} example")
    path = os.fspath(out)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {"rows": len(kept), "bad_rows": len(bad), "source": records.source, "out": path}


def main(argv: list[str] | None = None) -> int:
    """`python -m cppo_jax.data.datasets --write OUT [SOURCE] [--split S] [--task T]`: a local copy of a
    data set; without SOURCE the MATH training split (the file configs/math7b.py's data.train wants)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m cppo_jax.data.datasets", description=main.__doc__
    )
    parser.add_argument("--write", required=True, metavar="OUT", help="the .jsonl file to write")
    parser.add_argument(
        "source", nargs="?", default=MATH_TRAIN_HUB, help=f"default: {MATH_TRAIN_HUB} (hub)"
    )
    parser.add_argument("--split", default="train")
    parser.add_argument("--task", default="math", help=f"one of {', '.join(TASKS)}")
    args = parser.parse_args(argv)
    try:
        got = write_local(args.source, args.write, args.split, args.task)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {got['rows']} rows of {got['source']} to {got['out']} ({got['bad_rows']} bad rows "
        f"skipped); use data.train={got['out']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
