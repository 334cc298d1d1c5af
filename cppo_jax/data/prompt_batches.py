"""Questions in, fixed-shape prompt batches out (host code: imports no JAX).

Each example becomes the chat-template prompt of (system prompt, question), left-truncated or rejected
when longer than `data.max_prompt_len`, then left-padded to exactly that length so every compiled
function sees one shape. The order of questions is a grain `MapDataset` indexed by step: shuffled by
seed (a fresh permutation each epoch), repeated over epochs, batched to the global Q; the iterator position
is simply the step number, so a resumed run draws exactly the batches the uninterrupted run would have
drawn. With several processes, each takes its own contiguous slice of every global batch.

Validation: `split_validation` holds a seeded sample of the training questions out (never the test set);
`holdout_validation` applies `data.val_size` to a config's training examples (the arith task draws its own
validation split instead).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from cppo_jax.config.choices import PROMPT_FORMATS
from cppo_jax.config.schema import DataConfig
from cppo_jax.rewards.registry import TASK_EVAL
from cppo_jax.tasks.prompts import plain_prompt, resolve_system_prompt

if TYPE_CHECKING:  # imported where used: the memory plan needs this module, not grain
    import grain

# The accuracy reward of each task (the `strict` rule of rewards.registry.TASK_EVAL).
ACCURACY_REWARD = {task: rules["strict"] for task, rules in TASK_EVAL.items()}
# Sampling seeds: runs (or evaluations) with neighbouring seeds draw from disjoint seed ranges.
SEED_STRIDE = 1_000_003


@dataclasses.dataclass
class PromptSet:
    examples: list[dict]  # question, solution, answer
    ids_nP: np.ndarray  # int32, left-padded
    valid_nP: np.ndarray  # bool
    truncated: int  # prompts cut from the left to fit

    def __len__(self) -> int:
        return len(self.examples)

    def take(self, idx) -> PromptSet:
        idx = np.asarray(idx)
        return PromptSet(
            [self.examples[i] for i in idx], self.ids_nP[idx], self.valid_nP[idx], self.truncated
        )


def load_examples(cfg: DataConfig, split: str) -> tuple[list[dict], dict]:
    """Examples of the train or test side of the config; returns (examples, stats)."""
    source = cfg.train if split == "train" else cfg.test
    ds_split = cfg.split_train if split == "train" else cfg.split_test
    if source == "arith":
        from cppo_jax.tasks import arith

        n = cfg.num_train if split == "train" else cfg.num_test
        return arith.generate(n, seed=cfg.seed, split=ds_split), {"bad_rows": 0}
    from cppo_jax.data import datasets, example_format

    shipped = datasets._ALIASES.get(source.lower())
    kind = datasets.SHIPPED[shipped][2] if shipped else cfg.task
    strict = cfg.bad_rows == "error"
    required = example_format.TASKS[kind]
    fields, answer_format = {}, "auto"
    if not shipped:  # a user's file: its own column names and answer layout
        own = (cfg.question_field or required[0], cfg.answer_field or required[1])
        fields = {o: t for o, t in zip(own, required) if o != t}
        required = own + required[2:]
        answer_format = cfg.answer_format
    records = datasets.load_records(source, ds_split, required=required, strict=strict)
    examples, bad = [], list(records.bad_rows)
    for rowno, record in enumerate(records, start=1):
        try:
            examples.append(
                example_format.to_example(
                    example_format.rename(record, fields), kind, answer_format
                )
            )
        except ValueError as e:  # no answer where data.answer_format looks for one
            if strict:
                raise ValueError(f"{records.source}, good row {rowno}: {e}") from e
            bad.append((rowno, str(e)))
    return examples, {"bad_rows": len(bad), "bad_row_lines": bad[:20]}


def encode_prompts(
    examples,
    tokenizer,
    task: str,
    max_len: int,
    long_prompts: str,
    system_prompt: str | None = None,
    prompt_format: str = "chat",
    enable_thinking: bool | None = None,
) -> PromptSet:
    """Left-padded prompt ids of `examples` (`data.system_prompt`: None is the task's own prompt;
    `data.enable_thinking` handed to the chat template)."""
    system = resolve_system_prompt(task, system_prompt)
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(
            f"unknown prompt format {prompt_format!r}; expected one of {PROMPT_FORMATS}"
        )
    ids = np.full((len(examples), max_len), tokenizer.pad_id, np.int32)
    valid = np.zeros((len(examples), max_len), bool)
    truncated = 0
    for i, ex in enumerate(examples):
        if prompt_format == "chat":
            row = tokenizer.chat_prompt_ids(system, ex["question"], enable_thinking)
        else:
            row = tokenizer.encode(plain_prompt(ex["question"], system))
        if len(row) > max_len:
            if long_prompts == "reject":
                raise ValueError(
                    f"prompt of example {i} has {len(row)} tokens, more than "
                    f"data.max_prompt_len={max_len} (set data.long_prompts=truncate to cut it)"
                )
            row = row[-max_len:]
            truncated += 1
        ids[i, max_len - len(row) :] = row
        valid[i, max_len - len(row) :] = True
    return PromptSet(list(examples), ids, valid, truncated)


@dataclasses.dataclass
class PromptSets:
    """A run's encoded prompts: train, validation (None when nothing is held out) and test."""

    train: PromptSet
    val: PromptSet | None
    test: PromptSet
    stats: dict  # bad_rows: training rows skipped; truncated: training prompts cut


def load_prompt_sets(cfg: DataConfig, tokenizer, max_len: int, eval_size: int = 0) -> PromptSets:
    """The train, validation (`holdout_validation`) and test prompts of `cfg`, encoded to `max_len`
    slots; the test set cut to its first `eval_size` questions when that is not 0."""
    train, train_stats = load_examples(cfg, "train")
    train, val = holdout_validation(cfg, train)
    test, _ = load_examples(cfg, "test")

    def enc(examples) -> PromptSet:
        return encode_prompts(
            examples,
            tokenizer=tokenizer,
            task=cfg.task,
            max_len=max_len,
            long_prompts=cfg.long_prompts,
            system_prompt=cfg.system_prompt,
            prompt_format=cfg.prompt_format,
            enable_thinking=cfg.enable_thinking,
        )

    train_set = enc(train)
    val_set = enc(val) if val else None
    test_set = enc(test)
    if eval_size:
        test_set = test_set.take(np.arange(min(eval_size, len(test))))
    stats = {"bad_rows": train_stats.get("bad_rows", 0), "truncated": train_set.truncated}
    return PromptSets(train_set, val_set, test_set, stats)


def sample_seeds(seed: int, index_Q) -> np.ndarray:
    """Per-question sampling seeds from a run's `seed` and the questions' indices, so that what a
    question samples does not depend on how the questions are batched."""
    return (seed * SEED_STRIDE + np.asarray(index_Q)) % (2**31)


def decode_completions(tokenizer, tokens_NC: np.ndarray, valid_NC: np.ndarray) -> list[str]:
    """The text of each completion for the rewards: its valid tokens, special tokens (EOS, pad, chat
    markers) skipped, not stripped (the released code's `batch_decode(..., skip_special_tokens=True)`)."""
    return [
        tokenizer.decode([int(t) for t, v in zip(row, valid) if v], skip_special_tokens=True)
        for row, valid in zip(tokens_NC, valid_NC)
    ]


class _ProcessSlice:
    """A grain map: the `[lo, hi)` slice of a global batch (a class, so the dataset stays picklable)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def __call__(self, batch_Q: np.ndarray) -> np.ndarray:
        return batch_Q[self.lo : self.hi]


def question_stream(n: int, seed: int, shuffle: bool) -> grain.MapDataset:
    """`ds[k]` is the k-th question of the endless stream: epoch e (positions `[e n, (e + 1) n)`) is a
    seeded permutation of `range(n)`, a fresh one each epoch (`range(n)` in order without shuffling).
    `question_order` cuts it into steps; `skipping.PromptSkipper` walks it question by question."""
    import grain  # only the question order needs it (the memory plan and gpu_check do not)

    ds = grain.MapDataset.range(n)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None)


def question_order(
    n: int,
    batch: int,
    seed: int,
    shuffle: bool,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """`ds[step]` is the array of question indices this process draws at `step`.

    The global batch is `batch` (Q) questions: a seeded permutation of `range(n)`, re-drawn each epoch,
    cut into consecutive groups of Q (a batch may straddle two epochs when n % Q != 0). Process `i` of
    `process_count` takes the contiguous slice `[i * Q / count, (i + 1) * Q / count)` of every global
    batch, so the processes' slices are disjoint and together form the global batch. Random access by
    step makes the order checkpointable: a run resumed at step s reads `ds[s]`.
    """
    if n < 1:
        raise ValueError(f"question_order: no questions to draw from (n={n})")
    if batch < 1:
        raise ValueError(f"question_order: batch (questions per step) must be >= 1, got {batch}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"question_order: process_index={process_index} is invalid for "
            f"process_count={process_count} (need 0 <= process_index < process_count)"
        )
    if batch % process_count:
        raise ValueError(
            f"question_order: the global batch of {batch} questions per step does not split evenly "
            f"over {process_count} processes; choose cppo.questions_per_step (and pruning/allocation) "
            f"so that Q is a multiple of the process count"
        )
    ds = question_stream(n, seed, shuffle).batch(batch, drop_remainder=True)
    if process_count > 1:
        per = batch // process_count
        ds = ds.map(_ProcessSlice(process_index * per, (process_index + 1) * per))
    return ds


def steps_per_epoch(n: int, batch: int) -> int:
    return max(1, -(-n // batch))


def split_validation(examples: list, val_size: int, seed: int) -> tuple[list, list]:
    """`(train, val)`: a seeded sample of `val_size` examples held out of `examples`.

    Both keep the original order; they are disjoint and together hold every example. The same
    `(len(examples), val_size, seed)` always gives the same split. `val_size=0` holds nothing out.
    """
    n = len(examples)
    if val_size < 0:
        raise ValueError(f"data.val_size must be >= 0, got {val_size}")
    if val_size == 0:
        return list(examples), []
    if val_size >= n:
        raise ValueError(
            f"data.val_size={val_size} leaves no training questions: the training split has {n}"
        )
    held = np.zeros(n, bool)
    held[np.random.default_rng(seed).permutation(n)[:val_size]] = True
    train = [ex for ex, h in zip(examples, held) if not h]
    val = [ex for ex, h in zip(examples, held) if h]
    return train, val


def holdout_validation(cfg: DataConfig, train: list[dict]) -> tuple[list[dict], list[dict]]:
    """`(train, val)` for in-training validation per `data.val_size` (nothing held out when 0).

    The arith task draws `val_size` problems from its own validation split (disjoint from train and
    test by construction), so its training set is unchanged; any other data holds a seeded sample of
    `val_size` training questions out (`split_validation` with `data.seed`). The test split is never used.
    """
    if cfg.val_size == 0:
        return list(train), []
    if cfg.train == "arith":
        from cppo_jax.tasks import arith

        return list(train), arith.generate(cfg.val_size, seed=cfg.seed, split="validation")
    return split_validation(train, cfg.val_size, cfg.seed)
