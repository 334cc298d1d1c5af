"""One example format for every task: a data set's row as `{"question", "solution", "answer"}` for the
rewards of its task.

`to_example(record, task, answer_format)`: GSM8K keeps its `#### N` solution; MATH keeps its `\\boxed{}`
solution; AMC23 and AIME24 get the solution `\\boxed{answer}` so that the MATH reward applies. A user's
file whose answer column holds the answer another way names it (`answer_format`: the last `\\boxed{}`,
the last number, or the whole text), and the solution becomes the task's form of that answer
(`#### N`, `\\boxed{N}`). `rename` maps a file's own column names onto the task's. Reading the rows is
`cppo_jax.data.datasets`. Host code: imports no JAX.
"""

from __future__ import annotations

import re

# Fields each task's to_example needs.
TASKS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("question", "answer"),
    "math": ("problem", "solution"),
    "amc23": ("problem", "answer"),
    "aime24": ("problem", "answer"),
    "arith": ("question", "solution", "answer"),
}
_TASK_ALIASES = {"math500": "math"}
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def rename(record: dict, fields: dict[str, str]) -> dict:
    """`record` with its columns renamed by `fields` (the file's name -> the task's name)."""
    return {fields.get(k, k): v for k, v in record.items()}


def to_example(record: dict, task: str, answer_format: str = "auto") -> dict:
    """`{"question", "solution", "answer"}` of one row for `task` (gsm8k, math, amc23, aime24, arith).

    `answer_format` other than "auto": the gold answer is the last `\\boxed{}` ("boxed"), the last number
    ("last_number") or the whole text ("whole") of the task's answer column (gsm8k: answer, math: solution),
    and the solution is written in the task's form around it."""
    task = task_name(task)
    missing = [k for k in TASKS[task] if record.get(k) is None]
    if missing:
        raise ValueError(f"{task} row lacks field(s) {missing}; it has {sorted(record)}")
    if answer_format != "auto" and task in ("gsm8k", "math"):
        question_key, answer_key = TASKS[task][:2]
        gold = _extract(str(record[answer_key]), answer_format)
        solution = f"#### {gold}" if task == "gsm8k" else f"\\boxed{{{gold}}}"
        return {"question": str(record[question_key]), "solution": solution, "answer": gold}
    if task == "gsm8k":
        solution = str(record["answer"])
        _, sep, tail = solution.rpartition("####")
        answer = (tail if sep else solution).strip().replace(",", "")
        return {"question": str(record["question"]), "solution": solution, "answer": answer}
    if task == "math":
        solution = str(record["solution"])
        answer = record.get("answer")
        if answer is None:
            answer = last_boxed(solution)
            if answer is None:
                raise ValueError(
                    f"math row has no `answer` and no \\boxed{{}} in its solution: {solution[:200]!r}"
                )
        return {"question": str(record["problem"]), "solution": solution, "answer": str(answer)}
    if task in ("amc23", "aime24"):
        answer = _render_answer(record["answer"])
        return {
            "question": str(record["problem"]),
            "solution": f"\\boxed{{{answer}}}",
            "answer": answer,
        }
    return {k: str(record[k]) for k in ("question", "solution", "answer")}  # arith


def _extract(text: str, answer_format: str) -> str:
    if answer_format == "whole":
        gold = text.strip()
    elif answer_format == "boxed":
        gold = last_boxed(text)
    elif answer_format == "last_number":
        numbers = _NUMBER.findall(text)
        gold = numbers[-1].replace(",", "") if numbers else None
    else:
        raise ValueError(f"unknown answer format {answer_format!r}")
    if not gold:
        raise ValueError(f"no answer ({answer_format}) in {text[:200]!r}")
    return gold


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def task_name(task: str) -> str:
    task = _TASK_ALIASES.get(task, task)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    return task


def _render_answer(value) -> str:
    """27.0 -> "27", "025" -> "25", 0.5 -> "0.5"; other strings stripped."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).strip()
    digits = text[1:] if text.startswith("-") else text
    if digits.isdigit() and digits.isascii():
        return str(int(text))
    return text
