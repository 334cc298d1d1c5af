"""`logp_sources`: where a step's old-policy and behaviour log-probs come from, row by row.

Each row written out by hand from the trainer's behaviour (docs/concepts.md, step 6-7):
(ahead, tis_cap, mu) -> (old of the first update, old of updates 2..mu, behaviour), where ahead is how
many updates a rollout may run ahead: 0 synchronous, 1 `rollout.overlap`, 2 `rollout.max_staleness=2`.
"""

from __future__ import annotations

import pytest

from cppo_jax.algo.logp_sources import LogpSources, logp_sources
from cppo_jax.config.files import apply_overrides
from cppo_jax.config.schema import Config

TRUTH = [
    # ahead, tis_cap, mu: old,       after the first, behaviour
    (0, 0.0, 1, ("current", None, None)),  # GRPO / CPPO on-policy: ratio 1
    (0, 0.0, 2, ("current", "first_update", None)),  # no separate old-policy pass
    (0, 2.0, 1, ("current", None, "sampler")),  # TIS against the sampler's own log-probs
    (0, 2.0, 2, ("current", "first_update", "sampler")),
    (1, 0.0, 1, ("snapshot", None, None)),  # the stale batch's sampler, recomputed
    (1, 0.0, 2, ("snapshot", "snapshot", None)),  # given: the same old for every update
    (1, 2.0, 1, ("current", None, "snapshot")),  # TIS corrects the staleness instead
    (1, 2.0, 2, ("current", "first_update", "snapshot")),
    # k >= 2 ahead: a rollout may span weight updates, so only the sampler's own per-token log-probs
    # are the behaviour policy's; the old policy is the current one (decoupled PPO's proximal)
    (2, 2.0, 1, ("current", None, "sampler")),
    (2, 2.0, 2, ("current", "first_update", "sampler")),
]


@pytest.mark.parametrize("ahead, tis_cap, mu, want", TRUTH)
def test_truth_table(ahead, tis_cap, mu, want):
    got = logp_sources(ahead, tis_cap, mu)
    assert got == LogpSources(*want)
    # The train step is given old log-probs only when they are not the current policy's.
    assert got.old_given == (want[0] == "snapshot")
    # The snapshot's log-prob pass runs exactly with the one-step overlap.
    assert got.needs_snapshot == (ahead == 1)


def test_truth_table_covers_every_combination():
    """Every combination, k >= 2 without TIS refused (no one snapshot sampled such a rollout)."""
    assert sorted(row[:3] for row in TRUTH) == sorted(
        (a, t, m) for a in (0, 1, 2) for t in (0.0, 2.0) for m in (1, 2) if a < 2 or t
    )
    with pytest.raises(ValueError, match="2 updates ahead need TIS"):
        logp_sources(2, 0.0, 1)


def test_mu_3_is_mu_2s_rule_and_mu_0_is_refused():
    for ahead in (0, 1, 4):
        for tis_cap in (0.0, 2.0) if ahead < 2 else (2.0,):
            assert logp_sources(ahead, tis_cap, 3) == logp_sources(ahead, tis_cap, 2)
    with pytest.raises(ValueError, match="at least one update"):
        logp_sources(False, 0.0, 0)


def test_programs_batch_fields_follow_the_sources(tmp_path):
    """`programs.batch_fields` (what the deviceless compile builds) carries old log-probs exactly when
    the sources give them from outside, behaviour log-probs exactly with TIS."""
    from cppo_jax.train import programs

    for ahead, tis_cap, mu, want in TRUTH:
        overrides = [f"cppo.tis_cap={tis_cap}", f"cppo.mu={mu}"]
        if ahead:
            overrides += ["rollout.backend=vllm", "rollout.vllm_url=http://127.0.0.1:9"]
            overrides += ["rollout.overlap=1", f"rollout.max_staleness={ahead}"]
        cfg = apply_overrides(Config(), overrides)
        assert programs.rollout_ahead(cfg) == ahead
        fields = programs.batch_fields(cfg)
        assert fields["old_logp_MC"] == (want[0] == "snapshot"), (ahead, tis_cap, mu)
        assert fields["behav_logp_MC"] == (want[2] is not None), (ahead, tis_cap, mu)
