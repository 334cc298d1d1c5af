"""GRESO pre-rollout prompt skipping (`data.skip_zero_variance`; arXiv 2506.02177). Host code: no JAX.

A question whose G rewards were all equal (zero variance: no GRPO signal, every advantage 0) tends to
stay so in later epochs. The skipper keeps, for each question, z: the number of its most recent
consecutive zero-variance outcomes, and whether the last of them was easy (every completion correct) or
hard. The step's Q questions are drawn by walking the run's question stream (`pipeline.question_stream`:
the same seeded per-epoch permutations as the plain order, `pipeline.question_order`); a candidate with
z = 0 is always taken, one with z > 0 is rolled out with probability p^z (p = p_easy or p_hard by its
last label) and passed over otherwise, until Q are taken. After scoring, `record` updates each drawn
question's z and label, and adapts p_easy and p_hard by `delta_p` toward the targets alpha_easy =
target / 3 and alpha_hard = 2 target / 3 (the released scripts' split of target_zero_variance): when the
share of the step's Q questions that were easy and zero-variance exceeds alpha_easy, p_easy falls by
delta_p, else it rises, clipped to [delta_p, 1]; the same for hard. p never falls below delta_p, so no
question's chance of being rolled out when it comes up ever reaches 0.

Where this form differs from the paper:
- The batch is fixed: Q questions, drawn before the rollout and all trained on (CPPO's shapes are
  static). GRESO sits inside DAPO-style dynamic sampling, which rolls out more prompts until the batch
  holds enough with a signal; here skipping only chooses which Q are rolled out.
- A draw walks at most one full pass (n candidates). If that cannot fill the batch (nearly everything
  skipped), the questions not taken with the smallest z fill it: the shape holds, and the questions
  take turns (a round robin by z). The paper keeps drawing. A step's questions are distinct.
- "Easy" is judged by the task's accuracy reward (`pipeline.ACCURACY_REWARD`, correct when > 0) when it
  is trained with, else by the total reward > 0; the paper's reward is accuracy alone (1 or 0).
- The coin of the k-th candidate of the stream is the (k mod n)-th uniform of a generator seeded by
  (data.seed, epoch of k): a resumed run flips exactly the coins the uninterrupted one would have.
- With `rollout.overlap = 1` step s + 1's questions are drawn before step s's rewards are recorded
  (the rollout of s + 1 runs while s trains): the histories it sees lag one step. The draw is made on
  the trainer's thread at a fixed point (`Trainer._step`), so the lag is the same in every run.

Every process draws the same ids: the stream and the coins depend on the seed only, and every process
records the gathered rewards of the whole batch. `state_dict` is JSON (checkpoint meta): the histories,
p, the stream cursor, and the ids of steps drawn but not yet trained on.
"""

from __future__ import annotations

import threading

import numpy as np

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.schema import DataConfig
from cppo_jax.data import prompt_batches as pipeline

# The coins' generator is seeded by (data.seed, salt, epoch): apart from the order's own stream.
_COIN_SALT = 0x6C5E5


def zero_variance(rewards_QG) -> np.ndarray:
    """[Q] bool: every one of the question's G rewards is the same (all its advantages are 0)."""
    r = np.asarray(rewards_QG, np.float64)
    return r.max(axis=1) == r.min(axis=1)


def easy_of(rewards_QG, correct_QG=None) -> np.ndarray:
    """[Q] bool: every completion of the question is correct (`correct_QG`, else total reward > 0)."""
    r_QG = np.asarray(rewards_QG)
    correct = r_QG if correct_QG is None else np.asarray(correct_QG).reshape(r_QG.shape)
    return (correct > 0).all(axis=1)


class PromptSkipper:
    """The per-question histories, p_easy / p_hard and the cursor into the question stream."""

    def __init__(
        self,
        n: int,
        Q: int,
        seed: int,
        shuffle: bool = True,
        p_init: float = 0.5,
        target: float = 0.25,
        delta_p: float = 0.01,
    ):
        if n < Q:
            raise ConfigError(
                f"data.skip_zero_variance=true draws distinct questions by walking the data, but the "
                f"step's Q={Q} questions exceed the {n} training questions: lower "
                "cppo.questions_per_step or use more data (or data.skip_zero_variance=false)"
            )
        self.n, self.Q, self.seed, self.shuffle = n, Q, seed, shuffle
        self.alpha_easy, self.alpha_hard = target / 3, 2 * target / 3
        self.delta_p = delta_p
        self.p_easy = self.p_hard = float(p_init)
        self.z_n = np.zeros(n, np.int64)  # most recent consecutive zero-variance outcomes
        self.easy_n = np.zeros(n, bool)  # the last zero-variance outcome was easy (all correct)
        self.cursor = 0  # stream position of the next candidate
        self.next_step = 0  # the step the next draw is for
        self.drawn: dict[int, tuple[list[int], int]] = {}  # step -> (ids, skipped), recent steps
        self._stream = pipeline.question_stream(n, seed, shuffle)
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None
        self._lock = threading.Lock()  # `ids` may run on the overlap's rollout thread

    @classmethod
    def from_config(cls, cfg: DataConfig, n: int, Q: int) -> PromptSkipper | None:
        """The skipper of `cfg` (None when `data.skip_zero_variance` is false)."""
        if not cfg.skip_zero_variance:
            return None
        return cls(n, Q, cfg.seed, cfg.shuffle, cfg.skip_p_init, cfg.skip_target, cfg.skip_delta_p)

    # -- drawing -----------------------------------------------------------------------------------

    def _candidate(self, k: int) -> tuple[int, float]:
        """The question at stream position k and its coin (a uniform in [0, 1))."""
        epoch = k // self.n
        if self._epoch is None or self._epoch[0] != epoch:
            base = epoch * self.n
            order = np.array([self._stream[base + i] for i in range(self.n)], np.int64)
            coins = np.random.default_rng([self.seed, _COIN_SALT, epoch]).random(self.n)
            self._epoch = (epoch, order, coins)
        _, order, coins = self._epoch
        return int(order[k % self.n]), float(coins[k % self.n])

    def p_of(self, qid: int) -> float:
        """The chance that question `qid` is rolled out when it comes up: p^z."""
        p = self.p_easy if self.easy_n[qid] else self.p_hard
        return p ** int(self.z_n[qid])

    def draw(self) -> tuple[list[int], int]:
        """The next Q distinct question ids (in stream order) and how many candidates were skipped.

        The walk stops after one pass (n candidates). A pass may straddle two epochs: a question met
        again after it was taken is passed by (not a skip). When the pass did not fill the batch, the
        questions not taken with the smallest z fill it (ties: first met in the pass, then by id)."""
        taken, passed = [], []  # (stream position, id)
        for _ in range(self.n):
            k, self.cursor = self.cursor, self.cursor + 1
            qid, coin = self._candidate(k)
            if any(qid == q for _, q in taken):
                continue
            if self.z_n[qid] == 0 or coin < self.p_of(qid):
                taken.append((k, qid))
                if len(taken) == self.Q:
                    break
            else:
                passed.append((k, qid))
        if len(taken) < self.Q:
            met: dict[int, int] = {}
            for k, qid in passed:
                met.setdefault(qid, k)
            have = {qid for _, qid in taken}
            later = self.cursor + self.n  # after the pass: questions it did not meet
            rest = sorted(
                (q for q in range(self.n) if q not in have),
                key=lambda q: (self.z_n[q], met.get(q, later), q),
            )
            back = rest[: self.Q - len(taken)]
            taken = sorted(taken + [(met.get(q, later + q), q) for q in back])
            came_back = set(back)
            passed = [kq for kq in passed if kq[1] not in came_back]
        return [qid for _, qid in taken], len(passed)

    def ids(self, step: int) -> np.ndarray:
        """Step `step`'s question ids: drawn once (steps in order), then the same ids on every call."""
        with self._lock:
            if step not in self.drawn and step < self.next_step:
                raise RuntimeError(
                    f"prompt skipper: step {step}'s questions were drawn and forgotten "
                    f"(the next draw is for step {self.next_step})"
                )
            while step not in self.drawn:
                self.drawn[self.next_step] = self.draw()
                self.next_step += 1
            return np.asarray(self.drawn[step][0], np.int64)

    # -- recording ---------------------------------------------------------------------------------

    def record(self, step: int, rewards_QG, easy_Q) -> dict[str, float]:
        """Update the histories of step `step`'s questions with their rewards (`easy_Q`: all correct,
        see `easy_of`), adapt p_easy / p_hard; the step's `skip/*` metrics."""
        with self._lock:
            ids, skipped = self.drawn[step]
            zero_Q = zero_variance(rewards_QG)
            easy_Q = np.asarray(easy_Q, bool)
            for qid, zero, easy in zip(ids, zero_Q, easy_Q):
                self.z_n[qid] = self.z_n[qid] + 1 if zero else 0
                if zero:
                    self.easy_n[qid] = easy
            self.p_easy = self._adapt(self.p_easy, np.mean(zero_Q & easy_Q), self.alpha_easy)
            self.p_hard = self._adapt(self.p_hard, np.mean(zero_Q & ~easy_Q), self.alpha_hard)
            for old in [s for s in self.drawn if s < step - 1]:  # keep the last two (a re-run step)
                del self.drawn[old]
            return {
                "skip/skipped": float(skipped),
                "skip/p_easy": self.p_easy,
                "skip/p_hard": self.p_hard,
                "skip/zero_variance_frac": float(np.mean(zero_Q)),
            }

    def _adapt(self, p: float, share: float, alpha: float) -> float:
        p = p - self.delta_p if share > alpha else p + self.delta_p
        return float(np.clip(p, self.delta_p, 1.0))

    # -- checkpoint ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The whole state as JSON-able values (checkpoint meta)."""
        with self._lock:
            return {
                "n": self.n,
                "Q": self.Q,
                "seed": self.seed,
                "shuffle": self.shuffle,
                "cursor": self.cursor,
                "next_step": self.next_step,
                "p_easy": self.p_easy,
                "p_hard": self.p_hard,
                "z": self.z_n.tolist(),
                "easy": self.easy_n.astype(int).tolist(),
                "drawn": {str(s): [ids, k] for s, (ids, k) in self.drawn.items()},
            }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s output; refuses a state of another data set, Q or seed."""
        for key, name in (
            ("n", "the number of training questions (data.*)"),
            ("Q", "cppo.questions_per_step (Q)"),
            ("seed", "data.seed"),
            ("shuffle", "data.shuffle"),
        ):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"the checkpoint's prompt-skipping state was made with {name} = {state[key]!r}, "
                    f"this run has {getattr(self, key)!r}: resume with the same value"
                )
        with self._lock:
            self.cursor, self.next_step = int(state["cursor"]), int(state["next_step"])
            self.p_easy, self.p_hard = float(state["p_easy"]), float(state["p_hard"])
            self.z_n = np.asarray(state["z"], np.int64)
            self.easy_n = np.asarray(state["easy"], bool)
            self.drawn = {
                int(s): ([int(i) for i in v[0]], int(v[1])) for s, v in state["drawn"].items()
            }

    def start_at(self, step: int) -> None:
        """Resume a run that trained without skipping up to `step`: no histories, the stream at the
        position the plain order had reached (step * Q)."""
        with self._lock:
            self.cursor, self.next_step, self.drawn = step * self.Q, step, {}


def resume(skipper: PromptSkipper | None, state: dict | None, step: int) -> None:
    """Restore `skipper` from a checkpoint's meta `state` at `step` (None: the run trained without
    skipping so far, and the skipper starts where the plain order stood); nothing when skipping is off."""
    if skipper is None:
        return
    if state is None:
        skipper.start_at(step)
    else:
        skipper.load_state_dict(state)
