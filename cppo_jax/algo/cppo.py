"""The CPPO algorithm core: group advantages and completion pruning (pure, jit-friendly).

One CPPO step, in order (the paper, arXiv 2503.22342):

1. Draw Q questions: Q = floor(b / (1 - p)) with dynamic allocation, else Q = b (`num_questions`).
2. Roll out G completions per question.
3. Score them: rewards_QG (`check_rewards` on the host, `nonfinite_questions` in the graph).
4. Group advantages A = (r - group mean) / (std + eps), std with ddof=1 (`group_advantages`).
5. Prune: keep per question the k = max(1, floor(G (1 - p))) completions with the largest |A|
   (`num_kept`, `keep_indices`; `prune` runs steps 4-5 as one program). The released code ranks wider: the TRL fork one top-k
   over each contiguous slice of the step, one slice per training process there (`keep_indices_slice`,
   `cppo.scope = "slice"`), the verl
   recipe one over the whole flattened batch (`keep_indices_batch`, `cppo.scope = "batch"`).
6. Reference (and, for a stale rollout, old-policy) forward passes on the kept Q * k completions only.
7. mu policy updates on the kept completions (the loss lives in `cppo_jax.algo.loss`); with mu > 1 the
   first one's forward gives the old policy's log-probs.

Letters (docs/conventions.md): Q questions, G completions per question, K (the paper's k) kept per
question, N = Q * G rolled-out completions, M kept (trained) sequences (Q * K in question scope), P
prompt and C completion tokens, W slices of the step (`scope="slice"`); b questions per step of plain
GRPO, p pruning rate in [0, 1).

Selection is exact and reproducible: candidates are ranked by a stable sort, so among equal |A|
the lower index wins, and the returned indices are sorted ascending within each question.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cppo_jax.algo import dppo, selection
from cppo_jax.config.choices import ADV_SCALES, GROUP_METRICS, METRICS, ConfigError
from cppo_jax.config.schema import Config, CPPOConfig
from cppo_jax.parallel import sharding as sharding_lib


def _as_fraction(p) -> Fraction:
    """p as an exact fraction, read as the user meant it, so floors do not suffer float error.

    A float within one ulp of a fraction with denominator <= 10**6 is that fraction (2/3 as
    0.6666666666666666 -> 2/3, 0.9 -> 9/10); any other float is its shortest decimal repr
    (1e-7 -> 1/10**7). A Fraction is taken as is.
    """
    if isinstance(p, Fraction):
        return p
    x = float(p)
    near = Fraction(x).limit_denominator(10**6)
    if near != 1 and abs(near - Fraction(x)) <= Fraction(math.ulp(x)):
        return near
    return Fraction(repr(x))


def _check_p(p) -> Fraction:
    if isinstance(p, bool) or not isinstance(p, int | float | Fraction | np.integer | np.floating):
        raise ValueError(f"pruning rate p must be a real number in [0, 1), got {p!r}")
    if not math.isfinite(float(p)):
        raise ValueError(f"pruning rate p must be in [0, 1), got {p!r}")
    frac = _as_fraction(p)
    if not 0 <= frac < 1:
        raise ValueError(f"pruning rate p must be in [0, 1), got {p!r}")
    return frac


def _check_group_size(G: int) -> None:
    if G < 2:
        raise ValueError(f"group size G (completions per question) must be >= 2, got G={G}")


def _check_k(k: int, G: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise ValueError(f"k (kept per question) must be a static Python int, got {k!r}")
    if k < 1:
        raise ValueError(f"k (kept per question) must be >= 1, got k={k}")
    if k > G:
        raise ValueError(f"k (kept per question) must be <= G={G}, got k={k}")


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown pruning metric {metric!r}; expected one of {METRICS}")


def num_kept(G: int, p) -> int:
    """k = max(1, floor(G * (1 - p))), in exact arithmetic (G=16, p=0.875 -> 2; p=0.9 -> 1)."""
    _check_group_size(G)
    frac = _check_p(p)
    return max(1, math.floor(G * (1 - frac)))


def num_questions(b: int, p, allocation: bool) -> int:
    """Questions per step: floor(b / (1 - p)) with dynamic allocation, else b (exact arithmetic).

    When p is not dyadic Q * k only approximates b * G (e.g. b=16, G=16, p=0.9: Q=160, k=1).
    """
    if b < 1:
        raise ValueError(f"questions per step b must be >= 1, got b={b}")
    frac = _check_p(p)
    if not allocation:
        return int(b)
    return math.floor(Fraction(int(b)) / (1 - frac))


def group_advantages(rewards_QG: jax.Array, scale: str = "group", eps: float = 1e-4) -> jax.Array:
    """A = (r - group mean) / (std + eps), std with Bessel's correction (ddof=1).

    scale: "group" (per-question std, GRPO/CPPO), "batch" (std over all Q * G rewards),
    "none" (Dr. GRPO: r - group mean). A group whose rewards are all equal gets A = 0.
    """
    if scale not in ADV_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {ADV_SCALES}")
    if rewards_QG.ndim != 2:
        raise ValueError(f"rewards_QG must be [Q, G], got shape {rewards_QG.shape}")
    _check_group_size(rewards_QG.shape[1])
    centered_QG = rewards_QG - jnp.mean(rewards_QG, axis=1, keepdims=True)
    if scale == "none":
        return centered_QG
    if scale == "group":
        std = jnp.std(rewards_QG, axis=1, keepdims=True, ddof=1)
    else:
        std = jnp.std(rewards_QG, ddof=1)
    return centered_QG / (std + eps)


def _rank(key_XG: jax.Array, metric: str, rng: jax.Array | None) -> jax.Array:
    """Indices along the last axis, best first; stable, so equal keys keep the lower index first.
    X: any leading axes (questions, slices, or none), G: the candidates ranked together."""
    _check_metric(metric)
    if metric in GROUP_METRICS:
        raise ValueError(
            f'metric={metric!r} selects within each question\'s group (scope "question")'
        )
    if metric == "random":
        if rng is None:
            raise ValueError('metric="random" needs an rng key (rng=jax.random.key(...))')
        order_XG = jnp.broadcast_to(jnp.arange(key_XG.shape[-1], dtype=jnp.int32), key_XG.shape)
        return jax.random.permutation(rng, order_XG, axis=-1, independent=True)
    abs_XG = jnp.abs(key_XG)
    # "smallest" drops the smallest |A|: rank by descending |A| via the stable ascending sort of
    # -|A| (every zero of |A| is +0.0, so every zero of -|A| is -0.0: no signed-zero mix-ups).
    # A NaN sorts last, so it is dropped first. lax.top_k is not used: its tie order is unspecified.
    sort_key = -abs_XG if metric == "smallest" else abs_XG
    return jnp.argsort(sort_key, axis=-1, stable=True).astype(jnp.int32)


def keep_indices(
    adv_QG: jax.Array, k: int, metric: str = "smallest", rng: jax.Array | None = None
) -> jax.Array:
    """idx_QK (int32): per question the k kept completions, sorted ascending within each row.

    metric: "smallest" drops the smallest |A| (keeps the k largest), "largest" drops the largest
    |A| (keeps the k smallest), "random" keeps k uniformly without replacement (needs rng),
    "max_variance" keeps the k whose advantages (so rewards: one affine map per group) vary most,
    "proportional" k with replacement, with probability |A| / sum |A|, "dppo" k distinct, with
    probability ~ |A| (both need rng; train them with `selection.proportional_advantages`,
    `dppo.trained_advantages`). Ties in |A| keep the lower index first. k: a static Python int."""
    if adv_QG.ndim != 2:
        raise ValueError(f"adv_QG must be [Q, G], got shape {adv_QG.shape}")
    G = adv_QG.shape[1]
    _check_group_size(G)
    _check_k(k, G)
    if metric == "max_variance":
        return selection.max_variance_indices(adv_QG, k)
    if metric in ("proportional", "dppo"):
        if rng is None:
            raise ValueError(f'metric="{metric}" needs an rng key (rng=jax.random.key(...))')
        draw = dppo.completion_indices if metric == "dppo" else selection.proportional_indices
        return draw(adv_QG, k, rng)
    rank_QG = _rank(adv_QG, metric, rng)
    return jnp.sort(rank_QG[:, :k], axis=1)


def keep_indices_batch(
    adv_N: jax.Array, n_keep: int, metric: str = "smallest", rng: jax.Array | None = None
) -> jax.Array:
    """idx_M (int32): `scope="batch"`, one selection over the flattened (per-device) batch.

    The released code keeps floor(N (1 - p)): pass n_keep = num_kept(N, p). Same metrics, tie
    rule (lower index first) and ascending output order as `keep_indices`.
    """
    if adv_N.ndim != 1:
        raise ValueError(f"adv_N must be [N], got shape {adv_N.shape}")
    N = adv_N.shape[0]
    _check_k(n_keep, N)
    return jnp.sort(_rank(adv_N, metric, rng)[:n_keep])


def num_kept_slice(Q: int, G: int, slices: int, p) -> int:
    """Kept completions per slice of the step (`scope="slice"`): the TRL fork drops int(N_s p) of the
    N_s = (Q / slices) G completions of each slice, so n = N_s - floor(N_s p) (exact arithmetic)."""
    _check_group_size(G)
    _check_slices(Q, slices)
    n_s = Q // slices * G
    return max(1, n_s - math.floor(n_s * _check_p(p)))


def _check_slices(Q: int, slices: int) -> None:
    if slices < 1 or Q % slices:
        raise ValueError(
            f"slices must divide the Q={Q} questions of a step into equal parts, got {slices}"
        )


def keep_indices_slice(
    adv_QG: jax.Array,
    slices: int,
    n_keep: int,
    metric: str = "smallest",
    rng: jax.Array | None = None,
) -> jax.Array:
    """idx_M (int32, M = slices * n_keep): `scope="slice"`, the released TRL fork's pruning.

    The Q questions are cut into `slices` contiguous slices (the fork's per-process batches, one per
    training GPU); each slice ranks its (Q / slices) G completions together and keeps `n_keep` of
    them (pass `num_kept_slice`). Flat indices into Q * G, ascending. A group whose rewards are all equal has
    |A| = 0 and so loses its completions first; an informative group may keep more than G (1 - p).
    Same metrics and tie rule (lower index first) as `keep_indices`.
    """
    if adv_QG.ndim != 2:
        raise ValueError(f"adv_QG must be [Q, G], got shape {adv_QG.shape}")
    Q, G = adv_QG.shape
    _check_slices(Q, slices)
    adv_WX = adv_QG.reshape(slices, Q // slices * G)  # W slices of X completions each
    idx_Wn = keep_indices(adv_WX, n_keep, metric=metric, rng=rng)  # n = n_keep per slice
    return (idx_Wn + jnp.arange(slices, dtype=jnp.int32)[:, None] * adv_WX.shape[1]).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The static shapes of one step, fixed by the config: every compiled program keeps them."""

    Q: int  # questions rolled out per step
    G: int  # completions per question
    k: int  # kept per question (question scope)
    M: int  # kept sequences per step (the trained batch)
    P: int  # prompt slots
    C: int  # completion slots
    U: int  # questions trained per step: Q, or fewer with `cppo.filter_groups`


def step_shapes(algo: CPPOConfig, prompt_len: int, completion_len: int) -> Shapes:
    """Q, G, k, M and U of `algo` (exact arithmetic) with P prompt and C completion slots."""
    U = num_questions(algo.questions_per_step, algo.pruning_rate, algo.allocation)
    over = 1 / (1 - _as_fraction(algo.prompt_rate))  # DPPO's prompt pruning (1 when r_q = 0)
    Q = math.floor(U * (_as_fraction(algo.filter_oversample) if algo.filter_groups else over))
    G = algo.num_generations
    k = num_kept(G, algo.pruning_rate)
    if algo.scope == "question":
        M = U * k
    elif algo.scope == "slice":
        if U % algo.slices:
            raise ConfigError(
                f"config key 'cppo.slices' = {algo.slices} is invalid: allowed a divisor of "
                f"the {U} questions trained per step (scope='slice' cuts them into equal parts)"
            )
        M = algo.slices * num_kept_slice(U, G, algo.slices, algo.pruning_rate)
    else:
        M = num_kept(U * G, algo.pruning_rate)
    return Shapes(Q, G, k, M, prompt_len, completion_len, U)


def shapes_of(cfg: Config) -> Shapes:
    """The step shapes of a run config."""
    return step_shapes(cfg.cppo, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens)


class Pruned(NamedTuple):
    """What `prune` keeps of a rolled-out step: the trained batch and how it was chosen."""

    adv_UG: jax.Array  # the advantages of the trained groups (all Q of them without filtering)
    groups_U: jax.Array  # int32: which of the Q rolled-out groups are trained (ascending)
    kept: jax.Array  # flat indices into Q * G: [U, k] (question scope) or [M]
    tokens_MT: jax.Array  # prompt then completion of each kept sequence
    valid_MT: jax.Array
    mask_MC: jax.Array  # float32: completion tokens that count in the loss
    adv_M: jax.Array
    behav_logp_MC: jax.Array | None = None  # the sampler's log-probs of the kept tokens, when given


@functools.partial(jax.jit, static_argnames=("shapes", "algo", "mesh"))
def prune(
    rewards_QG,
    key,
    prompt_QP,
    pvalid_QP,
    tokens_NC,
    cvalid_NC,
    finished_N,
    logp_NC=None,
    *,
    shapes: Shapes,
    algo: CPPOConfig,
    mesh=None,
) -> Pruned:
    """Steps 4-5 of a CPPO step as one compiled program: advantages, selection, the kept batch.

    With `cppo.filter_groups` the U of the Q groups whose rewards vary are taken first
    (`selection.informative_groups`, a gather across the mesh), with `cppo.prompt_rate` drawn by
    `dppo.prompt_indices`; otherwise U = Q. Question scope keeps k per question inside its own
    group: with the questions split over the mesh's data axes every device prunes its own
    questions and nothing crosses devices. Slice scope ranks each of `algo.slices` slices of the
    step together, batch scope the whole step (a global gather). `key` drives `metric="random"`,
    `"proportional"` and `"dppo"`. Shapes are static: new data never compiles. Below, n = U * G:
    the completions of the trained groups. `logp_NC` (the sampler's log-probs, for `cppo.tis_cap`)
    is gathered like the tokens when given.
    """
    U, G, M = shapes.U, shapes.G, shapes.M
    with sharding_lib.use_mesh(mesh):
        by_row = lambda x: sharding_lib.constrain(x, ("batch",) + (None,) * (x.ndim - 1))  # noqa: E731
        rewards_QG, prompt_QP, pvalid_QP, tokens_NC, cvalid_NC, finished_N = map(
            by_row, (rewards_QG, prompt_QP, pvalid_QP, tokens_NC, cvalid_NC, finished_N)
        )
        adv_QG = group_advantages(rewards_QG, scale=algo.adv_scale, eps=algo.adv_eps)
        if subset := U < shapes.Q:  # U of the Q groups trained: DPPO's draw, or filtered
            by_dppo = dppo.prompt_indices(adv_QG, U, jax.random.fold_in(key, 1))
            groups_U = by_dppo if algo.prompt_rate else selection.informative_groups(rewards_QG, U)
            rows_n = (groups_U[:, None] * G + jnp.arange(G, dtype=jnp.int32)).reshape(-1)
            rewards_UG, prompt_UP, pvalid_UP = (
                x[groups_U] for x in (rewards_QG, prompt_QP, pvalid_QP)
            )
            tokens_nC, cvalid_nC, finished_n = (
                x[rows_n] for x in (tokens_NC, cvalid_NC, finished_N)
            )
        else:
            groups_U = jnp.arange(U, dtype=jnp.int32)
            rows_n = jnp.arange(U * G, dtype=jnp.int32)
            rewards_UG, prompt_UP, pvalid_UP = rewards_QG, prompt_QP, pvalid_QP
            tokens_nC, cvalid_nC, finished_n = tokens_NC, cvalid_NC, finished_N
        adv_UG = group_advantages(rewards_UG, scale=algo.adv_scale, eps=algo.adv_eps)
        trained_UG = adv_UG  # the advantage a kept completion trains with
        if algo.metric == "proportional":
            trained_UG = selection.proportional_advantages(adv_UG, shapes.k)
        elif algo.metric == "dppo":  # estimates the mean over all Q rolled-out groups
            adv_UG, trained_UG = dppo.trained_advantages(adv_QG, groups_U, shapes.k)
        if algo.scope == "question":
            idx_UK = keep_indices(adv_UG, shapes.k, metric=algo.metric, rng=key)
            kept_n = idx_UK + jnp.arange(U)[:, None] * G

            def pick(x_n):  # [U*G, ...] -> [U*k, ...], a gather batched over U
                x_UG = x_n.reshape(U, G, *x_n.shape[1:])
                idx = idx_UK.reshape(U, shapes.k, *(1,) * (x_n.ndim - 1))
                return jnp.take_along_axis(x_UG, idx, axis=1).reshape(M, *x_n.shape[1:])

            rows = lambda x_UP: jnp.repeat(x_UP, shapes.k, axis=0)  # noqa: E731
        else:
            if algo.scope == "slice":
                per = M // algo.slices
                kept_n = keep_indices_slice(adv_UG, algo.slices, per, algo.metric, key)
            else:
                kept_n = keep_indices_batch(adv_UG.reshape(-1), M, metric=algo.metric, rng=key)
            pick = lambda x_n: x_n[kept_n]  # noqa: E731
            rows = lambda x_UP: x_UP[kept_n // G]  # noqa: E731
        kept = rows_n[kept_n]  # into the Q * G rolled out
        if algo.scope == "question":
            kept = by_row(kept)
        mask_MC = pick(cvalid_nC).astype(jnp.float32)
        if algo.mask_truncated:
            mask_MC = mask_MC * pick(finished_n)[:, None].astype(jnp.float32)
        out = (
            jnp.concatenate([rows(prompt_UP), pick(tokens_nC)], axis=1),
            jnp.concatenate([rows(pvalid_UP), pick(cvalid_nC)], axis=1),
            mask_MC,
            pick(trained_UG.reshape(-1)),
        )
        if logp_NC is not None:
            logp_nC = by_row(logp_NC)[rows_n] if subset else by_row(logp_NC)
            out += (pick(logp_nC),)
        if mesh is not None:
            b_sh = sharding_lib.batch_sharding(mesh, M)
            out = tuple(jax.lax.with_sharding_constraint(x, b_sh) for x in out)
    return Pruned(adv_UG, groups_U, kept, *out)


def nonfinite_questions(rewards_QG: jax.Array) -> jax.Array:
    """bool_Q: True for each question with a NaN or inf reward (jittable)."""
    return jnp.any(~jnp.isfinite(rewards_QG), axis=1)


def check_rewards(rewards_QG) -> None:
    """Host-side check: raise ValueError naming every question with a NaN or inf reward."""
    r_QG = np.asarray(rewards_QG)
    if r_QG.ndim != 2:
        raise ValueError(f"rewards_QG must be [Q, G], got shape {r_QG.shape}")
    bad_QG = ~np.isfinite(r_QG)
    if not bad_QG.any():
        return
    parts = []
    for q in np.flatnonzero(bad_QG.any(axis=1)):
        cells = ", ".join(
            f"completion {g}: {float(r_QG[q, g])!r}" for g in np.flatnonzero(bad_QG[q])
        )
        parts.append(f"question {q} ({cells})")
    raise ValueError("non-finite rewards in " + "; ".join(parts))
