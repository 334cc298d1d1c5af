"""The trainer's evaluations: held-out accuracy, validation with the best policy kept, the run's summary.

Functions of a `cppo_jax.trainer.Trainer` (`trainer` below: its current params and its roles: the
rollout's backend, the data's prompt sets, the host's reward pool and log); the trainer's `evaluate`
and `train` call them. Every question of the split is scored (the last batch is padded by wrapping,
the padding dropped) under each evaluation rule of the task (`rewards.registry.TASK_EVAL`):
`accuracy_<rule>` is the share of questions the rule scores above 0.
"""

from __future__ import annotations

import numpy as np

from cppo_jax import distributed, pipeline
from cppo_jax import profile as prof
from cppo_jax.export import export_policy
from cppo_jax.runlog import phase_table, plot_curves

SAMPLED_SEED = 2**30  # question i of a sampled evaluation is seeded SAMPLED_SEED + i


def evaluate(
    trainer, step: int, batch_size: int = 64, split: str = "test", sampled: bool = False
) -> dict:
    """Greedy accuracy on the test (or validation) split under both rules; every question is scored.

    `accuracy` is the headline rule's (`eval.rule`), `accuracy_released` and `accuracy_strict` both.
    With `sampled`, also `sampled_accuracy` (and per rule): one completion per question at the
    rollout temperature, from fixed seeds (question i: seed 2**30 + i), so that before and after
    a run the same random numbers are used.
    """
    prompts = trainer.data.val_set if split == "validation" else trainer.data.test_set
    rule = trainer.cfg.eval.rule
    acc = accuracies(trainer, prompts, batch_size, None)
    result = {"step": step, "accuracy": acc[f"accuracy_{rule}"], **acc, "n": len(prompts)}
    if sampled:  # after greedy, which pushes `trainer.params` to a server that lags behind
        sampled_acc = accuracies(trainer, prompts, batch_size, SAMPLED_SEED)
        result["sampled_accuracy"] = sampled_acc[f"accuracy_{rule}"]
        result.update({f"sampled_{k}": v for k, v in sampled_acc.items()})
    result.update(split=split, rule=rule)
    trainer.evals.append(result)
    trainer.host.log.evaluation(result)
    return result


def accuracies(trainer, prompts, batch_size: int, seed: int | None) -> dict[str, float]:
    """Accuracy under each evaluation rule (`accuracy_<rule>`) of greedy (seed None) or one-sample
    (seeds seed + question index) completions of `prompts` by the trainer's current params."""
    n = len(prompts)
    texts = []
    weights = trainer.sampler_params()  # with LoRA: as the rollout samples (`Rollout.weights`)
    for lo in range(0, n, batch_size):
        idx = np.arange(lo, lo + batch_size) % n  # pad the last batch by wrapping, then drop
        part = prompts.take(idx)
        ids = distributed.rows(part.ids_nP, trainer.mesh)
        valid = distributed.rows(part.valid_nP, trainer.mesh)
        if seed is None:
            out = trainer.rollout.backend.greedy(weights, ids, valid)
        else:
            seeds = distributed.rows((seed + idx).astype(np.uint32), trainer.mesh)
            out = trainer.rollout.backend.generate(weights, ids, valid, seeds, 1)
        got = pipeline.decode_completions(
            trainer.data.tokenizer, *distributed.to_host((out.tokens_NC, out.valid_NC))
        )
        texts.extend(got[: min(batch_size, n - lo)])
    solutions = [ex["solution"] for ex in prompts.examples]
    _, per_fn, _ = trainer.host.rewards.score(texts, solutions, list(trainer.host.eval_rules))
    return {
        f"accuracy_{name.split('/')[1]}": float(np.mean(np.asarray(v) > 0))
        for name, v in per_fn.items()
    }


def validate(trainer, step: int) -> None:
    """Validation accuracy; the best policy so far is kept as a Hugging Face folder `best/`."""
    if trainer.data.val_set is None:
        return
    r = evaluate(trainer, step, split="validation")
    if trainer.best_val is None or r["accuracy"] > trainer.best_val:
        trainer.best_val = r["accuracy"]
        export_policy(
            trainer.actor.graphdef,
            trainer.policy_params(),
            trainer.cfg,
            trainer.host.out_dir / "best",
            trainer.actor.model_path,
            cppo_step=step,
            cppo_val_accuracy=r["accuracy"],
        )
        trainer.host.log.event("best", step=step, accuracy=r["accuracy"])


def write_summary(trainer, before: dict, after: dict) -> str:
    """The run's files (process 0): `curves.png`, `compiled_programs.md` and `summary.md` (accuracy
    before and after under both rules, the median time per phase); returns the phase table."""
    table = phase_table(trainer.host.log.history)
    if not trainer.host.main:
        return table
    if trainer.cfg.logging.plot and trainer.host.log.history:
        plot_curves(trainer.host.log.history, trainer.evals, trainer.host.out_dir / "curves.png")
    programs = prof.format_programs_report()
    (trainer.host.out_dir / "compiled_programs.md").write_text(programs + "\n")
    rules = " ".join(
        f"{rule} {before[f'accuracy_{rule}']:.3f} -> {after[f'accuracy_{rule}']:.3f};"
        for rule in ("released", "strict")
    )
    (trainer.host.out_dir / "summary.md").write_text(
        f"accuracy ({trainer.cfg.eval.rule} rule) before {before['accuracy']:.3f}, after "
        f"{after['accuracy']:.3f} (both rules: {rules[:-1]})\n\n{table}\n"
    )
    return table
