"""Draw the figures of docs/concepts.md (run once after a change; the PNGs are committed).

    python docs/make_figures.py            # writes docs/figures/pruning.png

Everything is computed with the functions the trainer uses (`cppo_jax.algo.cppo`) on a fixed group of rewards;
nothing is random, so the figure only changes when the code or this script does.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from cppo_jax.algo import cppo

OUT = Path(__file__).resolve().parent / "figures"
G = 16
RATES = (0.0, 0.5, 0.75, 0.875, 0.9375)
# Rewards of one group of 16 GSM8K completions (accuracy 0 / 1.5 / 2 plus format 0 / 1).
REWARDS_G = np.array([3, 1, 0, 1, 3, 1, 2.5, 1, 0, 1, 1, 3, 1, 0, 1, 1.5], np.float32)


def pruning_figure(path: Path) -> None:
    adv_QG = cppo.group_advantages(jnp.asarray(REWARDS_G)[None, :])
    adv_G = np.asarray(adv_QG[0])
    fig, (ax_group, ax_work, ax_alloc) = plt.subplots(1, 3, figsize=(15, 4.2))

    # 1. One group at p = 0.75: the k = 4 completions with the largest |A| are kept.
    p = 0.75
    k = cppo.num_kept(G, p)
    kept = set(np.asarray(cppo.keep_indices(adv_QG, k)[0]).tolist())
    colors = ["tab:blue" if g in kept else "lightgray" for g in range(G)]
    ax_group.bar(np.arange(G), adv_G, color=colors, edgecolor="black", linewidth=0.4)
    ax_group.axhline(0, color="black", lw=0.8)
    ax_group.set_xticks(np.arange(G))
    ax_group.set_xlabel("completion of one question")
    ax_group.set_ylabel("advantage A = (r - mean) / (std + eps)")
    ax_group.set_title(
        f"one group, p = {p}:\nthe k = {k} of G = {G} with the largest |A| are kept (blue)"
    )

    # 2. Work of each phase relative to GRPO at the same number of questions.
    phases = ("rollout", "reward", "ref_logps", "old_logps", "update")
    x = np.arange(len(phases))
    width = 0.8 / len(RATES)
    for i, rate in enumerate(RATES):
        kk = cppo.num_kept(G, rate)
        work = [1.0, 1.0, kk / G, kk / G, kk / G]
        ax_work.bar(x + (i - (len(RATES) - 1) / 2) * width, work, width, label=f"p={rate} (k={kk})")
    ax_work.set_xticks(x, phases)
    ax_work.set_ylim(0, 1.35)
    ax_work.set_ylabel("work relative to GRPO (same Q)")
    ax_work.set_title("pruning at the same Q:\ngeneration unchanged, the rest scales with k / G")
    ax_work.legend(fontsize=8, ncol=3, loc="upper center")

    # 3. Dynamic allocation for b = 1 (the paper's GSM8K run): Q = floor(b / (1 - p)).
    b = 1
    qs = [cppo.num_questions(b, rate, allocation=True) for rate in RATES]
    ks = [cppo.num_kept(G, rate) for rate in RATES]
    xs = np.arange(len(RATES))
    ax_alloc.plot(xs, [q * G for q in qs], "o-", label="completions sampled, Q G")
    ax_alloc.plot(xs, [q * kk for q, kk in zip(qs, ks)], "s-", label="completions trained, Q k")
    ax_alloc.plot(xs, qs, "^-", label="questions per step, Q")
    ax_alloc.set_yscale("log", base=2)
    ax_alloc.set_xticks(xs, [f"p={rate}" for rate in RATES])
    ax_alloc.set_title(
        f"allocation, Q = floor(b / (1 - p)) (b = {b}, G = {G}):\nsame trained batch, more questions"
    )
    ax_alloc.grid(alpha=0.3)
    ax_alloc.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "pruning.png"
    pruning_figure(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
