"""TRL's side of benchmarks/vs_trl.py: GRPO steps with Hugging Face TRL's GRPOTrainer on CPU PyTorch.

Runs inside the TRL environment that vs_trl.py builds (torch, trl, no JAX):

    <venv-trl>/bin/python benchmarks/_trl_worker.py SPEC.json RESULT.json

SPEC (written by vs_trl.py): the model folder (a random Qwen2 with the arith tokenizer, saved by cppo_jax),
the chat-formatted prompt texts in step order with their solutions and the prompt token ids cppo_jax
uses, G, Q, C, beta, mu, the learning rate, the seed and the number of steps. RESULT: one row of
phase seconds per optimizer step, plus the versions.

Timing: `TimedGRPOTrainer` wraps four GRPOTrainer methods with `time.perf_counter()` (not a profiler):
  rollout    `_generate_single_turn` (left-padding, `model.generate`, cutting at EOS),
  reward     `_calculate_rewards`,
  ref_logps  `_get_per_token_logps_and_entropies` called with gradients off (the reference model),
  update     `training_step` minus its `_prepare_inputs` (loss forward and backward), plus the time from
             the end of `training_step` to `on_step_end` (gradient clipping, AdamW, zero_grad),
  step       `on_step_begin` to `on_step_end` of a TrainerCallback: the whole optimizer step.
Everything else in the step (prompt tokenization, decoding, advantages, logging) is `other`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))  # the reward functions are cppo_jax's own (host code: no JAX)
    from cppo_jax.rewards import gsm8k

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    got = tokenizer(spec["prompts"])["input_ids"]
    if got != spec["prompt_ids"]:
        bad = next(i for i, (a, b) in enumerate(zip(got, spec["prompt_ids"])) if a != b)
        raise SystemExit(f"TRL's tokenizer gives other prompt ids than cppo_jax (prompt {bad})")
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)

    def arith_accuracy(prompts, completions, solution, **_):
        return [gsm8k.accuracy_reward(c, s) for c, s in zip(completions, solution)]

    def arith_format(prompts, completions, **_):
        return [gsm8k.format_reward(c) for c in completions]

    times: dict[str, float] = {}
    marks: dict[str, float] = {}

    def add(name, seconds):
        times[name] = times.get(name, 0.0) + seconds

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            add("rollout", time.perf_counter() - t)
            return out

        def _calculate_rewards(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            add("reward", time.perf_counter() - t)
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if not torch.is_grad_enabled():
                add("ref_logps", time.perf_counter() - t)
            return out

        def _prepare_inputs(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._prepare_inputs(*args, **kwargs)
            add("prepare", time.perf_counter() - t)
            return out

        def training_step(self, *args, **kwargs):
            t = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            marks["train_end"] = time.perf_counter()
            add("training_step", marks["train_end"] - t)
            return out

    rows: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            times.clear()
            marks["begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            update = times["training_step"] - times["prepare"] + (now - marks["train_end"])
            row = {
                "step": now - marks["begin"],
                "rollout": times.get("rollout", 0.0),
                "reward": times.get("reward", 0.0),
                "ref_logps": times.get("ref_logps", 0.0),
                "update": update,
            }
            row["training"] = row["ref_logps"] + row["update"]
            row["other"] = row["step"] - row["rollout"] - row["reward"] - row["training"]
            rows.append(row)
            print(
                f"TRL step {len(rows)}: {row['step']:.2f} s (rollout {row['rollout']:.2f}, "
                f"training {row['training']:.2f})",
                flush=True,
            )

    Q, G, C = spec["questions"], spec["group"], spec["new_tokens"]
    data = datasets.Dataset.from_list(
        [{"prompt": p, "solution": s} for p, s in zip(spec["prompts"], spec["solutions"])]
    )
    args = GRPOConfig(
        output_dir=spec["out_dir"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=Q * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=C,
        # Fixed length: EOS is masked out of the first C tokens, so every completion has C tokens.
        generation_kwargs={"min_new_tokens": C},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=spec["beta"],
        num_iterations=spec["mu"],
        epsilon=0.2,
        loss_type="bnpo",  # the token mean over the batch, as cppo_jax's loss_type="token_mean"
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=spec["steps"],
        shuffle_dataset=False,
        seed=spec["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[arith_accuracy, arith_format],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    lengths = trainer._metrics["train"].get("completions/mean_length", [])
    result = {
        "rows": rows,
        "mean_completion_length": lengths,
        "versions": {
            "torch": torch.__version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "datasets": datasets.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
