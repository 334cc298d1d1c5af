"""Shipped data sets, local files, bad rows, and normalisation to examples."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest

from cppo_jax.data import datasets, example_format


@pytest.mark.parametrize(
    ("name", "split", "count", "fields"),
    [
        ("gsm8k", "train", 7473, ("question", "answer")),
        ("gsm8k", "test", 1319, ("question", "answer")),
        ("math500", None, 500, ("problem", "solution", "answer", "subject", "level", "unique_id")),
        ("amc23", "test", 40, ("problem", "answer")),
        ("aime24", None, 30, ("problem", "solution", "answer")),
    ],
)
def test_shipped_counts(name, split, count, fields):
    rows = datasets.load_records(name, split)
    assert len(rows) == count
    assert rows.bad_rows == []
    for field in fields:
        assert field in rows[0]


def test_shipped_split_errors_and_aliases():
    with pytest.raises(ValueError, match="train, test"):
        datasets.load_records("gsm8k")
    with pytest.raises(ValueError, match="no split 'train'"):
        datasets.load_records("math500", "train")
    assert len(datasets.load_records("openai/gsm8k", "test")) == 1319
    assert len(datasets.load_records("HuggingFaceH4/MATH-500", "test")) == 500


def test_to_example_per_task():
    ex = example_format.to_example(datasets.load_records("gsm8k", "test")[0], "gsm8k")
    assert set(ex) == {"question", "solution", "answer"}
    assert ex["solution"].endswith("#### 18") and ex["answer"] == "18"

    row = datasets.load_records("math500")[0]
    ex = example_format.to_example(row, "math")
    assert (
        ex["question"] == row["problem"]
        and ex["answer"] == row["answer"]
        and "\\boxed" in ex["solution"]
    )
    # The MATH training split has no `answer` field: it comes from the last \boxed{}.
    ex = example_format.to_example(
        {"problem": "p", "solution": "so $\\boxed{\\frac{1}{2}}$."}, "math"
    )
    assert ex["answer"] == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="boxed"):
        example_format.to_example({"problem": "p", "solution": "no answer"}, "math")

    amc = [example_format.to_example(r, "amc23") for r in datasets.load_records("amc23")]
    assert amc[0]["answer"] == "27" and amc[0]["solution"] == "\\boxed{27}"
    assert all(not a["answer"].endswith(".0") for a in amc)
    assert example_format.to_example({"problem": "p", "answer": 0.5}, "amc23")["answer"] == "0.5"
    aime = [example_format.to_example(r, "aime24") for r in datasets.load_records("aime24")]
    assert aime[0]["solution"] == f"\\boxed{{{aime[0]['answer']}}}"
    assert example_format.to_example({"problem": "p", "answer": "025"}, "aime24")["answer"] == "25"

    with pytest.raises(ValueError, match="unknown task"):
        example_format.to_example({}, "chess")
    with pytest.raises(ValueError, match="question"):
        example_format.to_example({"answer": "#### 1"}, "gsm8k")


def test_load_examples_defaults_to_the_shipped_task():
    examples = datasets.load_examples("amc23")
    assert len(examples) == 40 and examples[0]["solution"] == "\\boxed{27}"
    with pytest.raises(ValueError, match="task"):
        datasets.load_examples("some/unknown-set")


GOOD = [{"problem": f"p{i}", "solution": f"\\boxed{{{i}}}"} for i in range(3)]


def write_lines(path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_local_jsonl_gz_and_folder(tmp_path):
    lines = [json.dumps(r).encode() for r in GOOD]
    write_lines(tmp_path / "train.jsonl", lines)
    rows = datasets.load_records(tmp_path / "train.jsonl")
    assert list(rows) == GOOD and rows.bad_rows == []
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "test.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines)))
    assert list(datasets.load_records(str(tmp_path / "gz" / "test.jsonl.gz"))) == GOOD
    assert list(datasets.load_records(str(tmp_path / "gz"), "test")) == GOOD
    examples = datasets.load_examples(tmp_path / "train.jsonl", task="math")
    assert [e["answer"] for e in examples] == ["0", "1", "2"]


def test_bad_rows_skipped_with_line_numbers(tmp_path):
    lines = [
        json.dumps(GOOD[0]).encode(),  # 1
        b"{not json",  # 2
        b"",  # 3: blank, ignored
        b'{"problem": "caf\xe9", "solution": "x"}',  # 4: Latin-1, not UTF-8
        json.dumps({"problem": "p"}).encode(),  # 5: no solution
        b"[1, 2]",  # 6: not an object
        json.dumps({"problem": "p", "solution": None}).encode(),  # 7: null solution
        json.dumps(GOOD[1]).encode(),  # 8
    ]
    path = tmp_path / "data.jsonl"
    write_lines(path, lines)
    rows = datasets.load_records(path, required=("problem", "solution"))
    assert list(rows) == GOOD[:2]
    assert [n for n, _ in rows.bad_rows] == [2, 4, 5, 6, 7]
    reasons = dict(rows.bad_rows)
    assert "JSON" in reasons[2] and "UTF-8" in reasons[4] and "solution" in reasons[5]
    # Without required fields, only rows that are not JSON objects are bad.
    assert [n for n, _ in datasets.load_records(path).bad_rows] == [2, 4, 6]
    with pytest.raises(ValueError, match=r"line 2\b"):
        datasets.load_records(path, strict=True)
    write_lines(path, [lines[0], lines[4]])
    with pytest.raises(ValueError, match=r"line 2: missing field\(s\) \['solution'\]"):
        datasets.load_records(path, required=("problem", "solution"), strict=True)


def test_missing_files_and_hub_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        datasets.load_records(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl"):
        datasets.load_records(tmp_path, "train")
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(FileNotFoundError, match="`datasets` package"):
            datasets.load_records("DigitalLearningGmbH/MATH-lighteval", "train")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="gzip"):
        datasets.load_records(tmp_path / "broken.jsonl.gz")


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            datasets.load_records(path)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([*GOOD, {"problem": "q", "solution": None}]), path)
    rows = datasets.load_records(path, required=("problem", "solution"))
    assert list(rows) == GOOD and [n for n, _ in rows.bad_rows] == [4]


def test_csv_json_and_saved_hugging_face_folders(tmp_path):
    """The same rows from a .csv, a .json list, a Dataset.save_to_disk folder (Arrow stream files listed
    in state.json) and a DatasetDict folder of splits, with the bad row counted in each."""
    import csv

    import pyarrow as pa

    rows = [{"q": "What is 2+2?", "a": "It is 4."}, {"q": "3+4?", "a": "7"}, {"q": "no answer"}]
    want = [{"q": "What is 2+2?", "a": "It is 4."}, {"q": "3+4?", "a": "7"}]
    with open(tmp_path / "train.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["q", "a"])
        writer.writeheader()
        writer.writerows(rows)
    (tmp_path / "train.json").write_text(json.dumps(rows))

    def save_to_disk(folder):  # the layout `datasets` writes, without needing the library here
        folder.mkdir(parents=True)
        table = pa.Table.from_pylist(rows)
        path = str(folder / "data-00000-of-00001.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        (folder / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
        )
        (folder / "dataset_info.json").write_text("{}")

    save_to_disk(tmp_path / "saved")
    save_to_disk(tmp_path / "dict" / "train")
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    for source in ("train.csv", "train.json", "saved", "dict"):
        got = datasets.load_records(tmp_path / source, "train", required=("q", "a"))
        assert [dict(r) for r in got] == want, source
        assert [n for n, _ in got.bad_rows] == [3], source
    (tmp_path / "obj.json").write_text('{"q": 1}')
    with pytest.raises(ValueError, match="expected a JSON list of objects, got a dict"):
        datasets.load_records(tmp_path / "obj.json")


def test_answer_formats_and_renamed_columns():
    row = example_format.rename(
        {"q": "Sum 2 and 3.", "a": "We add: 2 + 3 = 5, so 5."}, {"q": "question", "a": "answer"}
    )
    assert row == {"question": "Sum 2 and 3.", "answer": "We add: 2 + 3 = 5, so 5."}
    ex = example_format.to_example(row, "gsm8k", "last_number")
    assert ex == {"question": "Sum 2 and 3.", "solution": "#### 5", "answer": "5"}
    ex = example_format.to_example(
        {"problem": "p", "solution": "so $x=\\boxed{\\frac12}$ and 3"}, "math", "boxed"
    )
    assert ex["answer"] == "\\frac12" and ex["solution"] == "\\boxed{\\frac12}"
    ex = example_format.to_example({"problem": "p", "solution": " 1,234 "}, "math", "whole")
    assert ex["answer"] == "1,234"
    ex = example_format.to_example(
        {"question": "q", "answer": "Total: 1,234.5 apples"}, "gsm8k", "last_number"
    )
    assert ex["answer"] == "1234.5"
    with pytest.raises(ValueError, match=r"no answer \(boxed\)"):
        example_format.to_example({"problem": "p", "solution": "5"}, "math", "boxed")
