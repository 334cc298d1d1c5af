"""The trainer's evaluations: held-out accuracy, validation with the best policy kept, the run's summary.

Functions of a `cppo_jax.train.trainer.Trainer` (`trainer` below: its current params and its roles: the
rollout's backend, the data's prompt sets, the host's reward pool and log); the trainer's `evaluate`
and `train` call them. The evaluations before and during training score a fixed sample of the test
split (`trainer.eval_subset`), the one after training every question (the last batch is padded by
wrapping, the padding dropped), each under each evaluation rule of the task
(`rewards.registry.TASK_EVAL`): `accuracy_<rule>` is the share of questions the rule scores above 0.
"""

from __future__ import annotations

import numpy as np

from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.observe import profile as prof
from cppo_jax.observe.runlog import phase_table, plot_curves
from cppo_jax.parallel import distributed
from cppo_jax.train.export import export_policy

SAMPLED_SEED = 2**30  # question i of a sampled evaluation is seeded SAMPLED_SEED + i


def subset_ids(trainer) -> np.ndarray | None:
    """The test questions the evaluations before and during training score (`trainer.eval_subset`:
    a fixed random sample by `data.seed`, in split order), None when that is the whole split."""
    n, k = len(trainer.data.test_set), trainer.cfg.trainer.eval_subset
    if not k or k >= n:
        return None
    return np.sort(np.random.default_rng(trainer.cfg.data.seed).choice(n, k, replace=False))


def evaluate(
    trainer,
    step: int,
    batch_size: int = 64,
    split: str = "test",
    sampled: bool = False,
    whole: bool = False,
) -> dict:
    """Greedy accuracy on the test (or validation) split under both rules.

    `accuracy` is the headline rule's (`eval.rule`), `accuracy_released` and `accuracy_strict` both.
    On the test split the questions are `subset_ids`' sample unless `whole` (the evaluation after
    training: the whole split, and `subset_accuracy` (and per rule) on the sample within it); `n`
    says how many were scored, of `split_n`. With `sampled`, also `sampled_accuracy` (and per
    rule): one completion per question at the rollout temperature, from fixed seeds (question i:
    seed 2**30 + i), so that before and after a run the same random numbers are used.
    """
    prompts = trainer.data.val_set if split == "validation" else trainer.data.test_set
    rule = trainer.cfg.eval.rule
    subset = subset_ids(trainer) if split == "test" else None
    ids = np.arange(len(prompts)) if whole or subset is None else subset
    if len(ids) < len(prompts) and not any(e.get("split") == split for e in trainer.evals):
        trainer.host.log.event(  # once: what the evaluations before the last one score
            "eval_subset",
            questions=len(ids),
            of=len(prompts),
            note=f"evaluations before the last score {len(ids)} of the {len(prompts)} test "
            "questions (trainer.eval_subset; 0: all); the last scores all, and these within them",
        )
    what = f"eval step {step}: {len(ids)} of {len(prompts)} {split} questions"
    correct = correctness(trainer, prompts, ids, batch_size, None, f"{what}, greedy")
    result = {"step": step, **_accuracies(correct, rule), "n": len(ids), "split_n": len(prompts)}
    if sampled:  # after greedy, which pushes `trainer.params` to a server that lags behind
        got = correctness(trainer, prompts, ids, batch_size, SAMPLED_SEED, f"{what}, sampled")
        result.update({f"sampled_{k}": v for k, v in _accuracies(got, rule).items()})
        correct.update({f"sampled_{k}": v for k, v in got.items()})
    if whole and subset is not None:  # the sample's share of the whole split: like for like
        result["subset_n"] = len(subset)
        result.update({f"subset_{k}": v for k, v in _accuracies(correct, rule, subset).items()})
    result.update(split=split, rule=rule)
    trainer.evals.append(result)
    trainer.host.log.evaluation(result)
    return result


def _accuracies(correct: dict[str, np.ndarray], rule: str, ids=None) -> dict[str, float]:
    """`accuracy_<rule>` per rule (of the questions `ids`, all by default), `accuracy` the
    headline rule's; `sampled_` keys of a sampled evaluation carry through as they are."""
    acc = {k: float(np.mean(v if ids is None else v[ids])) for k, v in correct.items()}
    headline = {
        f"{p}accuracy": acc[f"{p}accuracy_{rule}"]
        for p in ("", "sampled_")
        if f"{p}accuracy_{rule}" in acc
    }
    return {**headline, **acc}


def correctness(
    trainer, prompts, ids: np.ndarray, batch_size: int, seed: int | None, desc: str
) -> dict[str, np.ndarray]:
    """`accuracy_<rule>` -> [len(ids)] whether each rule scores question ids[i] above 0, of
    greedy (seed None) or one-sample (seeds seed + question index) completions by the trainer's
    current params; a progress bar (`logging.progress`, process 0) counts the questions."""
    from tqdm.auto import tqdm

    n = len(ids)
    texts = []
    weights = trainer.sampler_params()  # with LoRA: as the rollout samples (`Rollout.weights`)
    show = trainer.cfg.logging.progress and trainer.host.main and n > batch_size
    with tqdm(total=n, desc=desc, unit="q", leave=False, disable=not show) as bar:
        for lo in range(0, n, batch_size):
            idx = ids[np.arange(lo, lo + batch_size) % n]  # pad the last batch by wrapping
            part = prompts.take(idx)
            tok = distributed.rows(part.ids_nP, trainer.mesh)
            valid = distributed.rows(part.valid_nP, trainer.mesh)
            if seed is None:
                out = trainer.rollout.backend.greedy(weights, tok, valid)
            else:
                seeds = distributed.rows((seed + idx).astype(np.uint32), trainer.mesh)
                out = trainer.rollout.backend.generate(weights, tok, valid, seeds, 1)
            got = pipeline.decode_completions(
                trainer.data.tokenizer, *distributed.to_host((out.tokens_NC, out.valid_NC))
            )
            texts.extend(got[: min(batch_size, n - lo)])  # the padding dropped
            bar.update(min(batch_size, n - lo))
    solutions = [prompts.examples[i]["solution"] for i in ids]
    _, per_fn, _ = trainer.host.rewards.score(texts, solutions, list(trainer.host.eval_rules))
    return {f"accuracy_{name.split('/')[1]}": np.asarray(v) > 0 for name, v in per_fn.items()}


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
    # Before and after on the same questions: the sample's share of the last, whole-split one.
    same = "subset_" if "subset_accuracy" in after else ""
    rules = " ".join(
        f"{rule} {before[f'accuracy_{rule}']:.3f} -> {after[f'{same}accuracy_{rule}']:.3f};"
        for rule in ("released", "strict")
    )
    whole = (
        f"; after, on the whole split ({after['n']} questions): {after['accuracy']:.3f}"
        if same
        else ""
    )
    (trainer.host.out_dir / "summary.md").write_text(
        f"accuracy ({trainer.cfg.eval.rule} rule, {before['n']} test questions) before "
        f"{before['accuracy']:.3f}, after {after[f'{same}accuracy']:.3f} (both rules: "
        f"{rules[:-1]}){whole}\n\n{table}\n"
    )
    return table
