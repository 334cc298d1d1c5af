"""Questions in, fixed-shape prompt batches out (host code: imports no JAX).

Each example becomes the chat-template prompt of (system prompt, question), left-truncated or rejected
when longer than `data.max_prompt_len`, then left-padded to exactly that length so every compiled
function sees one shape. The order of questions is a grain `MapDataset` indexed by step: shuffled by
seed, repeated over epochs, batched to Q; the iterator position is simply the step number, so a resumed
run draws exactly the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from cppo_jax.config import DataConfig
from cppo_jax.tasks.prompts import system_prompt_for

ACCURACY_REWARD = {"arith": "arith_accuracy", "gsm8k": "gsm8k_accuracy", "math": "math_accuracy"}


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
    from cppo_jax import datasets

    shipped = datasets._ALIASES.get(source.lower())
    kind = datasets.SHIPPED[shipped][2] if shipped else cfg.task
    records = datasets.load_records(
        source, ds_split, required=datasets.TASKS[kind], strict=cfg.bad_rows == "error"
    )
    examples = [datasets.to_example(r, kind) for r in records]
    return examples, {"bad_rows": len(records.bad_rows), "bad_row_lines": records.bad_rows[:20]}


def encode_prompts(examples, tokenizer, task: str, max_len: int, long_prompts: str) -> PromptSet:
    system = system_prompt_for(task)
    ids = np.full((len(examples), max_len), tokenizer.pad_id, np.int32)
    valid = np.zeros((len(examples), max_len), bool)
    truncated = 0
    for i, ex in enumerate(examples):
        row = tokenizer.chat_prompt_ids(system, ex["question"])
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


def question_order(n: int, batch: int, seed: int, shuffle: bool) -> grain.MapDataset:
    """`ds[step]` is the array of `batch` question indices drawn at that step."""
    ds = grain.MapDataset.range(n)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None).batch(batch, drop_remainder=True)


def steps_per_epoch(n: int, batch: int) -> int:
    return max(1, -(-n // batch))
