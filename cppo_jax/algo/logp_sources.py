"""Where a step's old-policy and behaviour log-probs come from, decided from the config alone.

The policy loss weighs each token by pi / pi_old (clipped), and with `cppo.tis_cap > 0` also by
min(pi_old / pi_behav, tis_cap) (truncated importance sampling against the policy that sampled).
The sources, by name:

  "current"       this update's own forward, detached: the ratio is exactly 1
  "first_update"  the forward of the first of the step's mu updates (the params before it),
                  kept for updates 2..mu: no separate old-policy pass
  "snapshot"      the `logps` program on the overlap's snapshot, the params that sampled the batch
                  (one update behind after step 1 with `rollout.overlap = 1`)
  "sampler"       the sampler's own log-probs of the tokens it drew (TIS without overlap, and
                  rollouts up to k >= 2 updates ahead: `rollout.max_staleness`, where a rollout
                  may span weight updates and no one snapshot sampled it)
  None            not used (no TIS: no behaviour log-probs; mu = 1: no later updates)

Host code: no JAX. The trainer computes what this names, `step.train_step` reads the choice from
the batch (`Batch.old_logp_MC` None: the current policy's, then the first update's).
"""

from __future__ import annotations

from typing import NamedTuple


class LogpSources(NamedTuple):
    old: str  # the first update's old policy: "current" or "snapshot"
    old_after_first: str | None  # updates 2..mu: "first_update" or "snapshot"; None when mu = 1
    behav: str | None  # "sampler", "snapshot", or None (tis_cap = 0)

    @property
    def old_given(self) -> bool:
        """Whether the old log-probs come into the train step from outside (`Batch.old_logp_MC`)."""
        return self.old == "snapshot"

    @property
    def needs_snapshot(self) -> bool:
        """Whether the step runs the `logps` program on the overlap's snapshot."""
        return "snapshot" in (self.old, self.behav)


def logp_sources(ahead: int, tis_cap: float, mu: int) -> LogpSources:
    """The sources of a step's old-policy and behaviour log-probs (see the module docstring).
    `ahead`: how many updates the rollout may run ahead of the update (0 synchronous, 1 the
    overlap's one-step snapshot, k >= 2 `rollout.max_staleness`, which needs TIS).

    With k >= 2 the old policy is the current one (the update's own forward, the proximal policy
    of decoupled PPO) and the behaviour policy the sampler's per-token log-probs, which hold even
    for a rollout whose tokens were drawn across a weight update. With overlap (k = 1) and no TIS
    the stale batch's old policy is the snapshot that sampled it (the ratio corrects the
    staleness). With TIS the old policy is the current one and the snapshot (k = 1) or the sampler
    (otherwise) is the behaviour policy the weights correct for. Otherwise the old policy is the
    current one, its log-probs the first update's forward for the updates after it.
    """
    if mu < 1:
        raise ValueError(f"mu = {mu}: a step makes at least one update")
    tis = tis_cap > 0
    if ahead > 1 and not tis:
        raise ValueError(
            f"rollouts {ahead} updates ahead need TIS (tis_cap > 0): no one snapshot sampled them"
        )
    overlap = ahead == 1
    old = "snapshot" if overlap and not tis else "current"
    after_first = None
    if mu > 1:
        after_first = "snapshot" if old == "snapshot" else "first_update"
    behav = None
    if tis:
        behav = "snapshot" if overlap else "sampler"
    return LogpSources(old, after_first, behav)
