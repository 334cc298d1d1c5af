"""The meaning of each config key and the note of each section, as docs/configuration.md shows them.

Read by `tools/docs_gen.py`. A key listed here overrides the trailing `# comment` on its field; a key that
no longer exists fails generation, so the two never drift apart.
"""

from __future__ import annotations

# Meanings of fields whose trailing comment is missing or too terse. Keys are dotted config paths.
MEANINGS: dict[str, str] = {
    # model.arch
    "model.arch.arch": "Architecture family of a model built from scratch (the SFT warm start).",
    "model.arch.vocab_size": "Vocabulary size; the SFT warm start replaces it with its tokenizer's.",
    "model.arch.hidden_size": "Model width D.",
    "model.arch.intermediate_size": "MLP width F.",
    "model.arch.num_layers": "Decoder layers L.",
    "model.arch.num_heads": "Query heads H.",
    "model.arch.num_kv_heads": "Key/value heads J (grouped-query attention).",
    "model.arch.head_dim": "Width of one attention head E (even: rotary embeddings).",
    "model.arch.rope_theta": "Rotary embedding base.",
    "model.arch.rms_norm_eps": "Epsilon of the RMS norms.",
    "model.arch.tie_word_embeddings": "Share the input embedding and the output projection (lm_head).",
    "model.arch.max_position_embeddings": "Longest sequence (prompt + completion) the model is built for.",
    # model
    "model.path": "The policy's model: a local Hugging Face folder (config.json, *.safetensors, "
    "tokenizer). Never a hub name: nothing is downloaded. Required unless `model.init_checkpoint` is set.",
    "model.tokenizer": "Tokenizer folder; empty: the model folder's own.",
    "model.init_checkpoint": "A Hugging Face folder the policy and the reference model start from instead "
    "of `model.path` (a warm start).",
    "model.warm_start": "An SFT config file (`get_config()` returning `SFTConfig`) run first to create "
    "`model.init_checkpoint` when that folder does not exist.",
    "model.lora.enabled": "Train low-rank adapters (LoRA) on a frozen base instead of every weight: "
    "gradients and AdamW state for the adapters only, the base held in `model.dtype`, the reference "
    "policy (cppo.beta > 0) the base with the adapters off (no reference copy), checkpoints of the "
    "adapters only (docs/lora.md).",
    "model.lora.rank": "Rank r of each adapter (A [in, r], B [r, out]); at most the width of every "
    "target projection.",
    "model.lora.alpha": "Adapter scale numerator: the update is (alpha / rank) B A x, as PEFT's "
    "`lora_alpha`.",
    "model.lora.targets": "Projections that get adapters: any of q, k, v, o (attention), gate, up, "
    "down (MLP); PEFT's `target_modules` q_proj ... down_proj.",
    "model.lora.dropout": "Dropout on the adapters' input; only 0 is accepted (the forward stays "
    "deterministic, so the old policy's log-probs are exact).",
    "model.dtype": "Compute dtype of the forward and backward passes and of the sampler's KV cache.",
    "model.param_dtype": "Storage dtype of the parameters (and so of the optimizer's updates).",
    "model.remat": "What each decoder layer keeps of its forward for the backward pass (a "
    "`jax.checkpoint` policy, named as MaxText's `remat_policy`); the rest is recomputed there. "
    "`full`: only the layer's input, the whole layer recomputed (least memory, about one more "
    "forward pass of compute); `minimal`: the outputs of the projections (q, k, v, o, gate, up, "
    "down), attention's scores and everything elementwise recomputed; `dots_saveable`: every matmul "
    "output, attention's float32 scores too (per layer [heads, T, T] per sequence), elementwise work "
    "recomputed; `save_all`: no `jax.checkpoint`, every residual kept (under `model.scan_layers`, "
    "some of them once per layer). The booleans of older configs still load: true is `full`, false "
    "`dots_saveable` (what each ran before).",
    "model.scan_layers": "Run the decoder layers under one `lax.scan` over their stacked params, so "
    "every program holds one copy of the layer and compiles in about the same time at any depth; "
    "false unrolls them (same params and results, one copy per layer in each program).",
    "model.attention": "How a whole sequence attends in training and log-probs: `einsum` (this "
    "package's grouped-query attention, scores in float32), `cudnn` "
    "(`jax.nn.dot_product_attention`'s fused kernel on NVIDIA GPUs; needs `model.dtype=bfloat16`, "
    "refused off a GPU), `splash` (TPUs' Pallas splash attention: no [T, T] scores in memory; "
    "Pallas' interpreter on CPU, refused on a GPU) or `xla` (the same call on any backend, to "
    "compare). The sampler's cached steps always use `einsum`.",
    # data
    "data.task": "Prompt format, system prompt and answer parsing: `arith` (the tiny synthetic task), "
    "`gsm8k` or `math`.",
    "data.train": "Training questions: a shipped data set name (`arith`, `gsm8k`, `math500`, ...) or a "
    "local .jsonl / .jsonl.gz / .json / .csv / .parquet file, a folder of `<split>.<suffix>` files, or "
    "a saved Hugging Face dataset folder (`save_to_disk`); a file's own columns and answer layout: "
    "`data.question_field`, `data.answer_field`, `data.answer_format`.",
    "data.test": "Held-out questions evaluated before and after training (and every "
    "`trainer.eval_every` steps without a validation split); same forms as `data.train`.",
    "data.split_train": "Split of `data.train` to read.",
    "data.split_test": "Split of `data.test` to read.",
    "data.max_prompt_len": "Prompt slots P: prompts are left-padded (or cut) to this many tokens.",
    "data.system_prompt": "System prompt; unset (None): the task's own (`cppo_jax/tasks/prompts.py`, the "
    "released strings for gsm8k and math); an empty string: no system message.",
    "data.prompt_format": "`chat`: the tokenizer's chat template over [system, user] (the released "
    "code); `plain`: the system prompt and the question on their own lines, no template.",
    "data.enable_thinking": "Handed to the chat template as its `enable_thinking` (reasoning models' "
    "templates, Qwen3: `false` closes an empty `<think></think>` block after the generation prompt, so "
    "the policy answers without reasoning); `none`: not handed, the template's own default. Templates "
    "without the variable ignore it.",
    "data.long_prompts": "A prompt longer than `data.max_prompt_len`: `truncate` keeps its last tokens, "
    "`reject` raises an error naming the example.",
    "data.question_field": "A user's data file: the column holding the question (empty: the task's own, "
    "`question` for gsm8k, `problem` for math). Shipped data sets ignore it.",
    "data.answer_field": "A user's data file: the column holding the answer or solution (empty: the "
    "task's own, `answer` for gsm8k, `solution` for math).",
    "data.answer_format": "Where the gold answer sits in that column: `auto` (the task's rule: after "
    "`####` for gsm8k, the last `\\boxed{}` for math), `boxed`, `last_number` or `whole` (the text is "
    "the answer). A row without one is a bad row (`data.bad_rows`).",
    "data.bad_rows": "A malformed data row: `skip` it (counted and reported) or raise an `error` naming "
    "the file and line.",
    "data.shuffle": "Shuffle the training questions (per epoch, from `data.seed`).",
    "data.seed": "Seed of the question order, of the validation hold-out and of the arith generator.",
    "data.skip_zero_variance": "GRESO pre-rollout skipping (`cppo_jax/data/skipping.py`): a question whose "
    "last z outcomes had zero reward variance is rolled out with probability p^z when it comes up, and "
    "passed over otherwise; p adapts per easy/hard kind toward `data.skip_target`.",
    "data.skip_p_init": "Initial exploration probability p of both easy (all correct) and hard (all "
    "wrong) questions.",
    "data.skip_target": "Target share of zero-variance questions in a step (a third of it for easy ones, "
    "two thirds for hard).",
    "data.skip_delta_p": "Step by which p_easy and p_hard move toward the target each step; also their "
    "floor, so every question keeps a chance to be rolled out.",
    # rollout
    "rollout.backend": "Where completions come from: `embedded` (the JAX sampler on the training "
    "devices) or `vllm` (an external vLLM server, see docs/vllm.md).",
    "rollout.max_new_tokens": "Completion slots C: the most tokens sampled per completion.",
    "rollout.temperature": "Sampling temperature of training rollouts; log-probs are computed from "
    "logits divided by it too.",
    "rollout.top_p": "Nucleus sampling: keep the smallest set of tokens with this much probability.",
    "rollout.top_k": "Sample among the k most likely tokens; 0: off.",
    "rollout.compact": "Embedded sampler: as rows end, decode the running ones in ever smaller loops "
    "(0.6 of the rows of the last, down to one): the same tokens, fewer row-steps ("
    "benchmarks/results/compaction.md).",
    "rollout.vllm_url": "Base URL of the vLLM server (`backend=vllm`), e.g. http://127.0.0.1:8000.",
    "rollout.vllm_api_key": "Sent as `Authorization: Bearer <key>` to the server's /v1 routes.",
    "rollout.push_every": "Push the policy's weights to the vLLM server every this many steps.",
    "rollout.timeout_s": "Read timeout of one request to the vLLM server, in seconds.",
    "rollout.server_wait_s": (
        "Before its first request the vLLM backend waits this many seconds for the server's `GET "
        "/health` (a server still loading its model; launch/gpu_node.sh starts both at once); 0: no "
        "wait, a server that is not up fails the first request after its retries."
    ),
    "rollout.weight_sync": "How the vLLM backend pushes weights: `file` (a safetensors folder and "
    "`reload_weights`), `protocol` (vLLM's weight-transfer routes with the `cppo_shm` engine; full pushes "
    "and sparse patches of the changed serving-dtype elements), `auto` (protocol when the server was "
    "started with that engine, else file). Every push is checked by the probe either way (docs/vllm.md).",
    "rollout.full_push_every": "With `rollout.weight_sync` = protocol: every this many pushes one is full, "
    "the others send only the elements whose serving-dtype value changed since the last confirmed push; "
    "a refused check forces a full push. 1: every push is full.",
    "rollout.lora_push": "With `model.lora.enabled` and the vLLM backend: `adapter` pushes only the "
    "adapters (a PEFT folder of float32 A and B, about 1/50 to 1/200 of the merged bf16 weights), loaded "
    "under a new name `cppo-lora-<n>` per push so the prefix cache never mixes versions; the server must "
    "run with `--enable-lora --max-lora-rank` >= `model.lora.rank` (VLLM_LORA_RANK, launch/vllm_server.sh). "
    "`merged` pushes the merged weights by `rollout.weight_sync` (any server; needed with several "
    "trainer processes). `auto`: adapter when the server has LoRA enabled, else merged (docs/lora.md).",
    "rollout.overlap": "1: generate the next step's completions (with the current weights) while the "
    "current step trains; they are trained on one update later, with the sampling weights' log-probs "
    "as the old policy. vLLM backend only.",
    "rollout.max_staleness": "With `rollout.overlap=1`: how many updates a rollout may run ahead of the "
    "update that trains on it. 1: the next step's, from a snapshot (above). k >= 2: up to k steps' "
    "generations at once on the server, pushes landing mid-rollout (partial rollouts: the running "
    "requests go on with the new weights), TIS against the server's log-probs (needs `cppo.tis_cap` "
    "and `rollout.temperature=1`); a batch older than k updates (e.g. with `rollout.push_every` > 1) "
    "is dropped, counted (`rollout/dropped_stale`) and its questions sampled again.",
    # cppo
    "cppo.num_generations": "G: completions sampled per question.",
    "cppo.questions_per_step": "b: questions per step of plain GRPO; with allocation CPPO draws "
    "Q = floor(b / (1 - p)).",
    "cppo.pruning_rate": "p: the fraction of each group's completions pruned before any forward pass; "
    "k = max(1, floor(G (1 - p))) are kept. 0 is GRPO.",
    "cppo.allocation": "Dynamic allocation: draw Q = floor(b / (1 - p)) questions per step so that "
    "Q k is about b G (GRPO's trained batch).",
    "cppo.metric": "Which completions are pruned: `smallest` drops the smallest |A| (CPPO); "
    "`max_variance` keeps the k of each group whose rewards vary most (PODS, arXiv 2504.13818: some "
    "of the lowest and the rest of the highest rewards; question scope only); `proportional` draws k "
    "per group with replacement, with probability |A| / sum |A|, and trains each with advantage "
    "sign(A) mean |A|: an unbiased estimate of the unpruned gradient (question scope only); `dppo` "
    "(DPPO, arXiv 2603.04135) draws k distinct completions per group, g with probability pi_g "
    "proportional to |A_g| (capped at 1), and trains each with advantage A k / (G pi_g): unbiased, "
    "without replacement (question scope only; with `cppo.prompt_rate` it prunes questions too); "
    "`largest` and `random` are ablations. See docs/concepts.md.",
    "cppo.scope": "`question`: keep k per question (the paper's text); `slice`: one top-|A| over each "
    "of `cppo.slices` contiguous slices of the step, dropping int(N p) of its N (the released TRL "
    "fork's per-process pruning, which produced the paper's tables); `batch`: one top-|A| over the "
    "whole batch, keeping floor(Q G (1 - p)) (the released verl recipe). See docs/concepts.md. "
    "`process` is the old name of `slice` (read, with a warning).",
    "cppo.slices": "`scope=slice`: how many contiguous slices the step's questions are cut into, each "
    "ranked on its own (the TRL fork's training processes, one per GPU; unrelated to this run's "
    "`jax.process_count()`); must divide Q. `cppo.processes` is its old name (read, with a warning).",
    "cppo.adv_scale": "Advantage scale: `group` (r - mean) / (group std + eps); `batch` divides by the "
    "std of the whole batch; `none` is r - mean (Dr. GRPO: `loss_type=dr_grpo` needs it).",
    "cppo.adv_eps": "Added to the std in the advantage's denominator.",
    "cppo.mu": "mu: policy updates per generation, on the same kept batch; with mu > 1 the old "
    "policy's log-probs are those of the first update's forward (the policy before it), kept for the "
    "others.",
    "cppo.beta": "Weight of the k3 KL penalty to the reference model; 0: no reference model is kept "
    "and its forward pass is skipped.",
    "cppo.eps_low": "Lower clip range: the ratio is clipped below at 1 - eps_low.",
    "cppo.eps_high": "Upper clip range: the ratio is clipped above at 1 + eps_high (DAPO: 0.28).",
    "cppo.loss_type": "Loss aggregation: `token_mean` (released CPPO code; over the whole batch, as "
    "DAPO's token-level loss, micro-batched or not), `seq_mean` (GRPO paper), `dr_grpo` (a constant "
    "denominator; needs `adv_scale=none`) (see cppo_jax/algo/loss.py). `dapo` is refused: it was "
    "`token_mean`; DAPO here is `token_mean` with `eps_high=0.28`, `mask_truncated` and "
    '`filter_groups`. Two other objectives (docs/concepts.md, "GSPO and CISPO"): `gspo` (one '
    "length-normalised ratio per completion, clipped per completion, averaged over completions; its "
    "paper's clip is `eps_low=3e-4`, `eps_high=4e-4`) and `cispo` (each token's REINFORCE term "
    "weighted by min(ratio, `cispo_cap`) without its gradient, no token clipped away, token-averaged).",
    "cppo.cispo_cap": "`loss_type=cispo`: the cap of its stop-gradient token weight min(pi / pi_old, "
    "cap); 5.0 is the ScaleRL paper's eps_max (TRL's recommended value); >= 1, inf: no cap (the "
    "unclipped importance-sampled gradient).",
    "cppo.mask_truncated": "Leave completions that hit `rollout.max_new_tokens` without an EOS out of "
    "the loss (DAPO-style).",
    "cppo.filter_groups": "Zero-variance filtering (DAPO's dynamic sampling with a fixed shape): roll "
    "out floor(`cppo.filter_oversample` U) questions and train the U whose rewards are not all equal "
    "first (zero-variance ones fill the batch when too few vary); the counts are logged as `filter/*`.",
    "cppo.filter_oversample": "`filter_groups`: questions rolled out per question trained (>= 1).",
    "cppo.prompt_rate": "DPPO's prompt pruning rate r_q (needs `metric=dppo`, not `filter_groups`): "
    "roll out floor(U / (1 - r_q)) questions and train U of them, group q drawn with probability "
    "rho_q proportional to its mean |A| (capped at 1) and its advantages scaled by U / (Q rho_q), so "
    "the gradient stays unbiased. 0: every rolled-out question is trained.",
    "cppo.tis_cap": "Truncated importance sampling (Yao et al. 2025): each token's policy-gradient term "
    "is weighted by min(pi_old / pi_sampler, tis_cap), pi_sampler being the policy that really sampled it "
    "(the vLLM server's or the embedded sampler's returned log-probs; with `rollout.overlap=1` the stale "
    "snapshot's, the old policy then being the current one; with `rollout.max_staleness` >= 2 the "
    "server's own). 0: off; else >= 1. With the vLLM backend and no overlap, or max_staleness >= 2, it "
    "needs `rollout.temperature=1` (the server's log-probs are before temperature).",
    # reward
    "reward.funcs": "Reward functions by registered name (`arith_accuracy`, `gsm8k_format`, "
    "`math_accuracy`, ...), `module:function` or `path/to/file.py:function`; the reward is their "
    "weighted sum. A function takes `(completion, solution)`, or TRL's keywords (`prompts`, "
    "`completions`, `completion_ids`, the data's columns) and returns a list of floats, None to abstain.",
    "reward.weights": "One weight per reward function.",
    "reward.timeout_s": "Longest time one completion may take to score; a completion over it scores 0 "
    "and is counted in `rewards/timeouts`.",
    "reward.num_workers": "Reward worker processes; 0 scores in the training process (no time bound).",
    # optim
    "optim.lr": "Peak learning rate of AdamW.",
    "optim.schedule": "Learning-rate schedule after the warm-up: `cosine` decay to 0, `linear` decay "
    "to 0, or `constant`.",
    "optim.warmup_ratio": "Fraction of the optimizer updates spent warming up linearly from 0.",
    "optim.weight_decay": "AdamW weight decay.",
    "optim.b1": "Adam's first-moment decay.",
    "optim.b2": "Adam's second-moment decay.",
    "optim.eps": "Adam's epsilon.",
    "optim.grad_clip": "Clip the gradient's global norm to this; 0: off.",
    "optim.allow_bf16_underflow": "Train with `model.param_dtype=bfloat16` at an `optim.lr` under "
    "0.02 x 2^-9 = 3.9e-5 (`config.choices.BF16_MIN_LR`), refused by default: AdamW's update (about lr per "
    "step) is then under half the bf16 spacing of every weight of magnitude 0.02 or more, so it "
    "rounds away and the weights do not move.",
    # mesh
    "mesh.data": "Data-parallel axis: each device along it holds different questions.",
    "mesh.fsdp": "Fully sharded data-parallel axis: parameters and optimizer state are sharded along it.",
    "mesh.tensor": "Tensor-parallel axis: weight matrices are split along it.",
    # trainer
    "trainer.seed": "Seed of sampling, pruning (`metric=random`) and everything random in a step.",
    "trainer.out_dir": "Parent folder of the run folders.",
    "trainer.run_name": "The run's folder under `trainer.out_dir`; every output lands there.",
    "trainer.resume": "Continue from the latest checkpoint in the run folder (if any).",
    "trainer.keep_checkpoints": "Checkpoints kept on disk (the oldest are deleted).",
    "trainer.log_every": "Write sample completions every this many steps (metrics are written every "
    "step).",
    "trainer.eval_every": "Evaluate (validation when `data.val_size` > 0, else test) every this many "
    "steps; 0: only before and after training.",
    "trainer.eval_size": "Test questions evaluated; 0: the whole test split.",
    "trainer.micro_batch": "Kept sequences per forward/backward pass (gradient accumulation); must "
    "divide the kept sequences per step; 0: all at once.",
    "trainer.pack": "Packed training rows: the kept sequences' real tokens (prompt + completion) "
    "placed by first-fit decreasing into `trainer.pack_rows` rows of `trainer.pack_len` tokens, "
    "attention within each sequence, RoPE positions from 0 per sequence, log-probs gathered back; "
    "loss and gradient equal the padded step's. One trainer process, `trainer.micro_batch=0` "
    "(docs/concepts.md, Packed rows).",
    "trainer.pack_rows": "Rows of a packed step (static per run). `auto`: chosen at load from the "
    "run's training prompts and reference-solution lengths (capped at C; C where a task has no "
    "worked solution) over 2000 simulated steps: the 99.5% quantile of the rows first-fit decreasing "
    "needs, + 5%, at most M (cppo_jax/packing/plan.py; the `pack_rows` event and the plan say how). "
    "A step that does not fit trains padded (same loss and gradient; `pack_overflow` event, "
    "`pack/overflow` metric). On a mesh, split over data x fsdp as the kept sequences are (e.g. a "
    "multiple of data x fsdp); 0: the kept sequences M (always fits, saves nothing).",
    "trainer.pack_len": "Tokens per packed row (static per run); a step with a longer sequence "
    "trains padded; 0: P + C (any sequence fits).",
    "trainer.max_nan_streak": "Stop (saving the last good state) after this many non-finite steps in "
    "a row; a non-finite step skips its update.",
    "trainer.dry_run": "Load and check the config, data, tokenizer and shapes, print the plan, train "
    "nothing (no weights needed).",
    "trainer.profile_steps": "`[first, last]`, steps numbered as in metrics.jsonl: record an XLA "
    "trace of these steps under `<run>/profile` (cppo_jax/observe/profile.py), and the HLO of the "
    "program they run after the rewards (`profile/hlo/step.hlo.txt`): the same program as every other "
    "step (cppo_jax/train/after_rewards.py), its phases named scopes (`prune`, `ref_logps`, "
    "`old_logps`, `update`) in the HLO and the trace (docs/profiling.md). `[]`: no trace.",
    "trainer.compile_cache_dir": "Persistent XLA compilation cache: `auto` (`$JAX_COMPILATION_CACHE_DIR` "
    "when set, else `~/.cache/cppo_jax/xla`), a folder, or `none`. A repeated or resumed run (or "
    "another run with the same shapes) loads its programs instead of compiling them again.",
    "trainer.steps": "Steps to run; 0: one pass over the training questions (one epoch).",
    "trainer.checkpoint_every": "Save a checkpoint (orbax, under `<run>/checkpoints`) every this many "
    "steps; 0: only at the end. The last step is always saved.",
    # eval
    "eval.rule": "The headline accuracy (summary, best checkpoint): `released`, the released code's "
    "lenient rule (spec section 4: exact, single number, or last number, on the extracted answer, else "
    "on the raw text; MATH: math-verify of the boxed answer), or `strict`, accuracy reward > 0.",
    "eval.samples": "`python -m cppo_jax.evaluate`: completions per question for every benchmark (0: each "
    "benchmark's own, 1 greedy or 4 for AMC23/AIME24); accuracy is then mean@n, and pass@k is reported.",
    "eval.temperature": "Its sampling temperature (None: each benchmark's own; must be > 0 with "
    "several samples).",
    "eval.top_p": "Its top-p (None: each benchmark's own).",
    # logging
    "logging.progress": "Show a progress bar (reward, accuracy, kept, phase times).",
    "logging.tensorboard": "Write TensorBoard events under `<run>/tensorboard`.",
    "logging.samples_per_log": "Questions whose first completion is written to samples.jsonl when "
    "samples are logged; 0: none.",
    "logging.plot": "Draw `<run>/curves.png` (reward and accuracy) at the end.",
    "logging.wandb": "Log metrics and evaluations to Weights & Biases too (needs `pip install wandb`); "
    "the run name is `trainer.run_name`, the run's config is the whole config.",
    "logging.wandb_project": "The W&B project.",
    "logging.wandb_entity": "The W&B entity (team or user); None: the account's default.",
    "logging.wandb_mode": "`online`, or `offline`: written under `<run>/wandb` without a network or "
    "an account (`wandb sync` uploads it later).",
    # sft (cppo_jax/train/sft.py)
    "sft.out": "The Hugging Face folder written at the end (the RL run's `model.init_checkpoint`).",
    "sft.init_from": "Continue from this Hugging Face folder (weights and tokenizer) instead of a "
    "random model with the tiny tokenizer.",
    "sft.arch": "Architecture of the random model (the keys of `model.arch`).",
    "sft.data": "Data of the warm start (the keys of `data`; the arith task).",
    "sft.completion_len": "Completion tokens of the reference completions trained on.",
    "sft.batch": "Sequences per update.",
    "sft.steps": "Updates.",
    "sft.lr": "Peak learning rate (AdamW, cosine decay after the warm-up).",
    "sft.warmup": "Warm-up updates.",
    "sft.seed": "Seed of the initialisation and of the batches.",
    "sft.log_every": "Print the loss every this many updates.",
    "sft.eval_size": "Held-out questions answered greedily at the end (accuracy printed).",
    "sft.direct_fraction": "Share of targets in the direct style (expression, then answer, no worked "
    "steps; `arith.direct_completion`), drawn per row of every batch; the rest are stepwise.",
}

SECTION_NOTES: dict[str, str] = {
    "model": "What the policy is and how it is stored and computed.",
    "model.arch": "Only used to build a model from scratch (the SFT warm start of the tiny task); a "
    "model loaded from a folder takes its architecture from its config.json.",
    "data": "Where questions come from and how prompts are shaped.",
    "rollout": "How completions are sampled during training.",
    "cppo": "The algorithm: GRPO plus completion pruning (p = 0 is plain GRPO).",
    "reward": "How completions are scored (host processes, bounded in time).",
    "optim": "AdamW and its learning-rate schedule; the schedule runs over steps x mu updates.",
    "mesh": (
        "Axis sizes of the device mesh. All three 0 (the default): `mesh=auto`, the layout chosen by "
        "`cppo_jax.launch` from the memory plan for the devices it sees (`cppo_jax.plan.choose_mesh`: "
        "the most data-parallel layout whose data x fsdp divides Q and that fits, tensor absorbing the "
        "rest; on TPUs only layouts that map onto the slice); the run refuses before loading weights "
        "when none fits. Any size set makes the mesh explicit: -1 is the rest of the devices, an axis "
        "left at 0 is 1 (data the rest when no axis is -1)."
    ),
    "trainer": "The run: length, outputs, checkpoints, evaluation, safety nets.",
    "eval": "How held-out accuracy is counted; both rules are always reported.",
    "logging": "What the run writes for its user besides metrics.jsonl.",
    "sft": "The supervised warm start (`cppo_jax/train/sft.py`), a config file of its own whose "
    "`get_config()` returns an `SFTConfig` (configs/tiny_sft.py). Its keys are set without the "
    "`sft.` prefix, e.g. `python -m cppo_jax.launch --config configs/tiny_sft.py steps=300`.",
}
