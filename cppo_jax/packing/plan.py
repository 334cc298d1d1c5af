"""How many packed rows a run gets (`trainer.pack_rows=auto`): R chosen at load from the run's own
data by simulating its steps on the host. Host code: NumPy, no JAX.

Letters (docs/conventions.md): U questions trained per step, M kept sequences, P prompt and C
completion slots; locally R packed rows and L tokens per row, n questions of the training set,
s simulated steps.

The lengths (`data_lengths`), in the run's tokenizer:
- a prompt: its question under the run's chat template and system prompt, as the run encodes it
  (`pipeline.encode_prompts`, cut to P);
- a completion: its question's reference solution (the `solution` of `example_format`, GSM8K's
  worked answer, MATH's solution) plus EOS, capped at C. A question whose solution is only its
  answer in the task's form (`#### N`, `\\boxed{N}`: AMC23, AIME24, a user's answer-only file) has
  no worked solution to go by: its completions are counted C long, the worst case.

The choice (`choose_rows`), in order:
1. `STEPS` steps drawn with a fixed seed as the run draws them: U questions uniformly from the
   training set, M / U kept sequences each (question scope: k; else the M spread at random over
   the U), each sequence's prompt its question's and its completion length drawn from all the
   completion lengths (as benchmarks/packing.py draws them).
2. The rows first-fit decreasing needs for each (`packing.rows_for`), in rows of L = P + C.
3. R = the `QUANTILE` of those plus `MARGIN` of it (at least one row), rounded up to split over
   the mesh as the M sequences do (`round_rows`), and never more than M (then packing saves
   nothing, and the run's `pack_rows` event says so).
A step that needs more than R rows anyway trains on the padded batch, exactly
(`packing.rows.Packer.batch`, metric `pack/overflow`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from cppo_jax.packing import pack as packing

STEPS = 2000  # simulated steps
SEED = 0
QUANTILE = 0.995  # of the simulated steps' rows
MARGIN = 0.05  # R = needed + ceil(MARGIN * needed): at least one row more


@dataclasses.dataclass(frozen=True)
class RowChoice:
    rows: int  # R
    length: int  # L
    needed: int  # the QUANTILE of the simulated steps' rows (0: not simulated)
    most: int  # the most rows a simulated step needed
    source: str  # where the lengths came from

    @property
    def pack(self) -> tuple[int, int]:
        """(R, L): `layout.memory_plan`'s `pack`."""
        return self.rows, self.length

    def note(self, M: int) -> str:
        """One line for the run's log and the plan."""
        head = f"R={self.rows} rows of L={self.length} tokens"
        if not self.needed:
            return f"{head}: {self.source}"
        sim = (
            f"{self.source}; over {STEPS} simulated steps first-fit decreasing needed "
            f"{self.needed} rows at the {QUANTILE:.1%} quantile, {self.most} at most"
        )
        if self.rows >= M:
            return f"{head} (= M: packing saves nothing): {sim}"
        return f"{head} ({self.rows / M:.0%} of M={M}): {sim}, + {MARGIN:.0%} margin"


def round_rows(rows: int, M: int, dp: int) -> int:
    """`rows` rounded up to a multiple of the dp = data x fsdp devices (so the R rows split as the M
    sequences do), at most M; M itself when M does not split evenly."""
    if dp > 1 and M % dp:
        return M
    return min(M, -(-rows // dp) * dp)


def choose_rows(
    prompt_n: np.ndarray, completion_n: np.ndarray, U: int, M: int, length: int, dp: int = 1
) -> tuple[int, int, int]:
    """(R, needed, most): the rows of `trainer.pack_rows=auto` for steps of U questions and M kept
    sequences drawn from questions of `prompt_n` prompt tokens and completions of `completion_n`
    tokens, in rows of `length` (see the module doc)."""
    prompt_n, completion_n = np.asarray(prompt_n), np.asarray(completion_n)
    rng = np.random.default_rng(SEED)
    rows_s = np.empty(STEPS, np.int64)
    for s in range(STEPS):
        q_U = rng.integers(0, len(prompt_n), U)
        q_M = np.repeat(q_U, M // U) if M % U == 0 else rng.choice(q_U, M)
        n_M = prompt_n[q_M] + rng.choice(completion_n, M)
        rows_s[s] = packing.rows_for(np.minimum(n_M, length), length)
    needed = int(np.quantile(rows_s, QUANTILE, method="higher"))
    rows = round_rows(needed + math.ceil(MARGIN * needed), M, dp)
    return rows, needed, int(rows_s.max())


def solution_lengths(examples: list[dict], tokenizer, C: int) -> np.ndarray:
    """Completion tokens of each example's reference solution plus EOS, capped at C; C where the
    solution is only the answer in the task's form (see the module doc)."""
    bare = [
        ex["solution"].strip() in (f"#### {ex['answer']}", f"\\boxed{{{ex['answer']}}}")
        for ex in examples
    ]
    ids = tokenizer.hf([ex["solution"] for ex in examples], add_special_tokens=False)["input_ids"]
    n = np.array([len(x) + 1 for x in ids], np.int64)
    return np.where(bare, C, np.minimum(n, C))


def data_lengths(train_set, tokenizer, C: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(prompt_n, completion_n, source) of an encoded training set (`pipeline.PromptSet`)."""
    prompt_n = train_set.valid_nP.sum(axis=1).astype(np.int64)
    completion_n = solution_lengths(train_set.examples, tokenizer, C)
    worked = int((completion_n < C).sum())
    source = (
        f"{len(prompt_n)} training prompts (mean {prompt_n.mean():.0f} tokens) and their reference "
        f"solutions capped at C={C} (mean {completion_n.mean():.0f}; {len(prompt_n) - worked} "
        f"without a worked solution or cut: counted C)"
    )
    return prompt_n, completion_n, source


def choice(trainer_cfg, shapes, lengths=None, dp: int = 1) -> RowChoice:
    """The packed rows and length of a run: `trainer.pack_rows` as given (0: M), or with `auto`
    chosen from `lengths` (`data_lengths`; None: the data could not be read: R = M)."""
    L = trainer_cfg.pack_len or shapes.P + shapes.C
    given = trainer_cfg.pack_rows
    if given != "auto":
        return RowChoice(given or shapes.M, L, 0, 0, "trainer.pack_rows as given (0: M)")
    if lengths is None:
        return RowChoice(shapes.M, L, 0, 0, "trainer.pack_rows=auto without the data's lengths: M")
    prompt_n, completion_n, source = lengths
    rows, needed, most = choose_rows(prompt_n, completion_n, shapes.U, shapes.M, L, dp)
    return RowChoice(rows, L, needed, most, source)


def config_lengths(cfg, shapes) -> tuple[np.ndarray, np.ndarray, str] | None:
    """`data_lengths` of a config without a run (the plan, the compiled programs): its training
    data loaded and encoded as a run does; None without `trainer.pack_rows=auto`, a tokenizer
    folder or `data.train`."""
    from cppo_jax.config.choices import REQUIRED_PREFIX
    from cppo_jax.models.tokenizer import has_tokenizer

    folder = cfg.model.tokenizer_folder
    if cfg.trainer.pack_rows != "auto" or not has_tokenizer(folder):
        return None
    if cfg.data.train.startswith(REQUIRED_PREFIX):
        return None
    return _lengths(cfg.data, folder, shapes.P, shapes.C)


@functools.lru_cache(maxsize=4)
def _lengths(d, folder: str, P: int, C: int) -> tuple[np.ndarray, np.ndarray, str]:
    from cppo_jax.data import prompt_batches as pipeline
    from cppo_jax.models.tokenizer import Tokenizer

    train, _ = pipeline.load_examples(d, "train")
    train, _ = pipeline.holdout_validation(d, train)
    tok = Tokenizer.from_dir(folder)
    enc = pipeline.encode_prompts(
        train, tok, d.task, P, d.long_prompts, d.system_prompt, d.prompt_format, d.enable_thinking
    )
    return data_lengths(enc, tok, C)


@functools.lru_cache(maxsize=8)
def config_choice(cfg, shapes, dp: int = 1) -> RowChoice:
    """`choice` of a config without a run (`config_lengths`)."""
    return choice(cfg.trainer, shapes, config_lengths(cfg, shapes), dp)
