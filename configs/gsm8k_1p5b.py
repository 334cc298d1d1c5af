"""The paper's GSM8K run: CPPO on Qwen2.5-1.5B-Instruct (spec section 5).

    python -m cppo_jax.launch --config configs/gsm8k_1p5b.py model.path=/models/Qwen2.5-1.5B-Instruct

`model.path` is required: a local Hugging Face folder (nothing is downloaded). Settings as in the paper:
G = 16 completions per question, mu = 2 updates per generation, beta = 0.04, eps = 0.2, temperature 1.0,
AdamW at 1e-6 with cosine decay after a 10% warm-up, no weight decay, grad-norm clip 1.0, prompts of 512
and completions of 1024 tokens, one epoch over the 7473 training questions, rewards GSM8K accuracy +
format with weights 1, 1, greedy evaluation on the whole GSM8K test split (1319 questions).

Default: the paper's headline CPPO setting, p = 0.875 with dynamic allocation. The paper trains 16
completions per step on one GPU, i.e. b = 1 question for GRPO; with allocation CPPO draws
Q = floor(1 / (1 - p)) = 8 questions, keeps k = 2 of 16 completions each and so trains the same 16.
Other rows of the paper's table are overrides:

    cppo.pruning_rate=0.0                          # GRPO (k = 16)
    cppo.pruning_rate=0.5 | 0.75 | 0.9375          # CPPO at k = 8, 4, 1 (allocation stays on)
    cppo.allocation=false                          # pruning alone (the ablation)

Rollouts use the embedded JAX sampler; on a GPU node with a vLLM server use
`rollout.backend=vllm rollout.vllm_url=http://127.0.0.1:8000` (see docs/vllm.md). In-training validation
on questions held out of train (never the test set): `data.val_size=200 trainer.eval_every=100`.
Check everything first, reading no weights: add `trainer.dry_run=true` (with `--devices N
--device-memory-gb GB` for GPUs other than this machine's).
"""

from cppo_jax.config.schema import (
    Config,
    CPPOConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from cppo_jax.tasks.prompts import GSM8K_SYSTEM_PROMPT


def get_config() -> Config:
    return Config(
        # remat "full": each layer keeps its input and recomputes the rest in the backward. At
        # p = 0.875 the update is about 5% of a step's least time (benchmarks/results/aot_tpu.md:
        # 0.30 of 6.7 s on v5e-8), so the recompute costs little, and the memory it frees is the
        # most of any choice: "minimal" (projections kept) took the mu = 2 train step on v5e-8
        # (mesh 2/4/1) to 13.08 GiB of 16 and on v5p-8 (4/1/1) to 39.93 GiB.
        model=ModelConfig(path="", dtype="bfloat16", param_dtype="float32", remat="full"),
        data=DataConfig(
            task="gsm8k",
            train="gsm8k",
            test="gsm8k",
            split_train="train",
            split_test="test",
            max_prompt_len=512,
            system_prompt=GSM8K_SYSTEM_PROMPT,  # the released recipe's, byte for byte
            prompt_format="chat",
            long_prompts="truncate",
            seed=42,
        ),
        rollout=RolloutConfig(backend="embedded", max_new_tokens=1024, temperature=1.0, top_p=1.0),
        cppo=CPPOConfig(
            num_generations=16,
            questions_per_step=1,
            pruning_rate=0.875,
            allocation=True,
            metric="smallest",
            scope="slice",  # the released TRL fork's pruning, which produced the paper's tables
            slices=1,  # one per training process (GPU) of the released run
            mu=2,
            beta=0.04,
            eps_low=0.2,
            eps_high=0.2,
            loss_type="token_mean",
        ),
        reward=RewardConfig(
            funcs=("gsm8k_accuracy", "gsm8k_format"),
            weights=(1.0, 1.0),
            timeout_s=5.0,
            num_workers=4,
        ),
        optim=OptimConfig(
            lr=1e-6, schedule="cosine", warmup_ratio=0.1, weight_decay=0.0, grad_clip=1.0
        ),
        trainer=TrainerConfig(
            steps=0,  # one epoch
            seed=42,
            out_dir="runs",
            run_name="gsm8k_1p5b",
            checkpoint_every=100,
            keep_checkpoints=2,
            log_every=10,
            eval_every=0,
            eval_size=0,
        ),
        eval=EvalConfig(rule="released"),  # the rule behind the paper's accuracies
        logging=LoggingConfig(progress=True, samples_per_log=2),
    )
