"""`logp_sources`: where a step's old-policy and behaviour log-probs come from, row by row.

Each row written out by hand from the trainer's behaviour (docs/concepts.md, step 6-7):
(overlap, tis_cap, mu) -> (old of the first update, old of updates 2..mu, behaviour).
"""

from __future__ import annotations

import pytest

from cppo_jax.algo.logp_sources import LogpSources, logp_sources
from cppo_jax.config.files import apply_overrides
from cppo_jax.config.schema import Config

TRUTH = [
    # overlap, tis_cap, mu: old,       after the first, behaviour
    (False, 0.0, 1, ("current", None, None)),  # GRPO / CPPO on-policy: ratio 1
    (False, 0.0, 2, ("current", "first_update", None)),  # no separate old-policy pass
    (False, 2.0, 1, ("current", None, "sampler")),  # TIS against the sampler's own log-probs
    (False, 2.0, 2, ("current", "first_update", "sampler")),
    (True, 0.0, 1, ("snapshot", None, None)),  # the stale batch's sampler, recomputed
    (True, 0.0, 2, ("snapshot", "snapshot", None)),  # given: the same old for every update
    (True, 2.0, 1, ("current", None, "snapshot")),  # TIS corrects the staleness instead
    (True, 2.0, 2, ("current", "first_update", "snapshot")),
]


@pytest.mark.parametrize("overlap, tis_cap, mu, want", TRUTH)
def test_truth_table(overlap, tis_cap, mu, want):
    got = logp_sources(overlap, tis_cap, mu)
    assert got == LogpSources(*want)
    # The train step is given old log-probs only when they are not the current policy's.
    assert got.old_given == (want[0] == "snapshot")
    # The snapshot's log-prob pass runs exactly with overlap.
    assert got.needs_snapshot == overlap


def test_truth_table_covers_every_combination():
    assert sorted(row[:3] for row in TRUTH) == sorted(
        (o, t, m) for o in (False, True) for t in (0.0, 2.0) for m in (1, 2)
    )


def test_mu_3_is_mu_2s_rule_and_mu_0_is_refused():
    for overlap in (False, True):
        for tis_cap in (0.0, 2.0):
            assert logp_sources(overlap, tis_cap, 3) == logp_sources(overlap, tis_cap, 2)
    with pytest.raises(ValueError, match="at least one update"):
        logp_sources(False, 0.0, 0)


def test_programs_batch_fields_follow_the_sources(tmp_path):
    """`programs.batch_fields` (what the deviceless compile builds) carries old log-probs exactly when
    the sources give them from outside, behaviour log-probs exactly with TIS."""
    from cppo_jax.train import programs

    for overlap, tis_cap, mu, want in TRUTH:
        overrides = [f"cppo.tis_cap={tis_cap}", f"cppo.mu={mu}"]
        if overlap:
            overrides += ["rollout.backend=vllm", "rollout.vllm_url=http://127.0.0.1:9"]
            overrides += ["rollout.overlap=1"]
        cfg = apply_overrides(Config(), overrides)
        fields = programs.batch_fields(cfg)
        assert fields["old_logp_MC"] == (want[0] == "snapshot"), (overlap, tis_cap, mu)
        assert fields["behav_logp_MC"] == (want[2] is not None), (overlap, tis_cap, mu)
