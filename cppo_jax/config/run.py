"""How a run is carried out and recorded: the sections of the run config for the device mesh
(`MeshConfig`), the training loop and its checkpoints (`TrainerConfig`), evaluation (`EvalConfig`) and
logging (`LoggingConfig`). Host code: imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re

from cppo_jax.config.choices import EVAL_RULES, WANDB_MODES, ConfigError, _check, _choice


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes of the device mesh. All three 0 (the default) is `mesh=auto`: the layout is chosen at
    launch from the memory plan for the devices the run sees (`cppo_jax.plan.choose_mesh`). Any size
    set makes the mesh explicit: -1 means "the rest of the devices", and an axis left at 0 is then 1
    (`data` the rest when no axis is -1)."""

    data: int = 0
    fsdp: int = 0
    tensor: int = 0

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        for name, size in zip(("data", "fsdp", "tensor"), sizes):
            _check(size >= -1, f"mesh.{name}", size, ">= 1, -1 (the rest) or 0 (auto / unset)")
        _check(sizes.count(-1) <= 1, "mesh", sizes, "at most one axis of size -1")

    @property
    def auto(self) -> bool:
        """No size set: the launch picks the layout from the memory plan."""
        return (self.data, self.fsdp, self.tensor) == (0, 0, 0)

    def explicit(self) -> dict[str, int]:
        """The sizes with unset (0) axes filled: 1, and `data` the rest (-1) when no axis is -1; an
        auto mesh is then all on `data` (what the run gets without a plan)."""
        sizes = dataclasses.asdict(self)  # axis name -> size, in the mesh's order
        rest = -1 not in sizes.values()
        return {k: v or (-1 if rest and k == "data" else 1) for k, v in sizes.items()}

    def sizes(self, num_devices: int) -> dict[str, int]:
        """The axis sizes on `num_devices` devices, -1 resolved to the rest (what the mesh of a run
        and of a plan get); a `ConfigError` naming the keys when they do not fit the devices."""
        sizes = self.explicit()
        fixed = math.prod(v for v in sizes.values() if v != -1)
        given = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items())
        if -1 in sizes.values():
            if num_devices % fixed:
                raise ConfigError(
                    f"{given}: the fixed axes ({fixed} devices) do not divide the {num_devices} "
                    f"devices; choose mesh sizes whose product divides {num_devices}"
                )
            return {k: (num_devices // fixed if v == -1 else v) for k, v in sizes.items()}
        if fixed != num_devices:
            raise ConfigError(
                f"{given} = {fixed} devices, but there are {num_devices}; set the sizes so their "
                f"product is {num_devices} (one of them may be -1: the rest)"
            )
        return sizes


MESH_AXES = tuple(f.name for f in dataclasses.fields(MeshConfig))  # the mesh's axes, in order

_REMOTE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # gs://, s3://, hdfs://, file://, ...


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    steps: int = 0  # 0: one pass over the training questions
    seed: int = 0
    out_dir: str = "runs"
    run_name: str = "run"
    resume: bool = False
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_every: int = 0  # 0: only before and after training
    eval_size: int = 0  # 0: the whole test split
    # The last evaluation scores the whole split, and the sample within it (like for like).
    eval_subset: int = 256  # test questions evaluated before and during training: a fixed sample (data.seed); 0: all
    micro_batch: int = 0  # sequences per forward/backward; 0: all kept sequences at once
    # Packed rows (cppo_jax/packing/pack.py): the kept sequences' real tokens placed into pack_rows rows
    # of pack_len tokens (first-fit decreasing), one segment each; static per run. pack_rows "auto":
    # chosen at load from the run's data (cppo_jax/packing/plan.py); 0: M (no saving). A step that
    # does not fit trains padded.
    pack: bool = False
    pack_rows: int | str = "auto"
    pack_len: int = 0  # 0: P + C (any sequence fits)
    max_nan_streak: int = 3
    dry_run: bool = False
    profile_steps: tuple[int, ...] = ()
    # Persistent XLA compilation cache: "auto" ($JAX_COMPILATION_CACHE_DIR when set, else
    # ~/.cache/cppo_jax/xla), a folder, or "none". A repeated or resumed run skips its compiles.
    compile_cache_dir: str = "auto"

    def __post_init__(self):
        _check(self.steps >= 0, "trainer.steps", self.steps, ">= 0")
        _check(
            not _REMOTE_URL.match(self.out_dir),
            "trainer.out_dir",
            self.out_dir,
            "a folder path; remote URLs (gs://, s3://, ...) are not written to: mount the bucket "
            "(e.g. gcsfuse, s3fs) and give the mount's path",
        )
        _check(bool(self.run_name), "trainer.run_name", self.run_name, "a non-empty name")
        _check(self.eval_subset >= 0, "trainer.eval_subset", self.eval_subset, ">= 0")
        _check(
            "/" not in self.run_name and ".." not in self.run_name,
            "trainer.run_name",
            self.run_name,
            "a plain folder name (no '/' or '..')",
        )
        _check(
            self.keep_checkpoints >= 1, "trainer.keep_checkpoints", self.keep_checkpoints, ">= 1"
        )
        _check(self.log_every >= 1, "trainer.log_every", self.log_every, ">= 1")
        _check(self.micro_batch >= 0, "trainer.micro_batch", self.micro_batch, ">= 0")
        _check(
            self.pack_rows == "auto" or (type(self.pack_rows) is int and self.pack_rows >= 0),
            "trainer.pack_rows",
            self.pack_rows,
            "auto or an integer >= 0",
        )
        _check(
            self.pack_len in (0,) or self.pack_len >= 2,
            "trainer.pack_len",
            self.pack_len,
            "0 or >= 2",
        )
        _check(
            not (self.pack and self.micro_batch),
            "trainer.micro_batch",
            self.micro_batch,
            "0 with trainer.pack=true (all kept sequences are packed into one forward)",
        )
        _check(self.max_nan_streak >= 1, "trainer.max_nan_streak", self.max_nan_streak, ">= 1")
        _check(
            len(self.profile_steps) in (0, 2),
            "trainer.profile_steps",
            self.profile_steps,
            "[] or [first, last]",
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    rule: str = (
        "strict"  # the headline accuracy: "released" (spec section 4) or "strict" (reward > 0)
    )
    samples: int = (
        0  # python -m cppo_jax.evaluate: completions per question (0: each benchmark's own)
    )
    temperature: float | None = None  # its sampling temperature (None: each benchmark's own)
    top_p: float | None = None  # its top-p (None: each benchmark's own)

    def __post_init__(self):
        _choice("eval.rule", self.rule, EVAL_RULES)
        _check(self.samples >= 0, "eval.samples", self.samples, ">= 0")
        t, p = self.temperature, self.top_p
        _check(t is None or t >= 0, "eval.temperature", t, "None or >= 0")
        _check(p is None or 0 < p <= 1, "eval.top_p", p, "None or in (0, 1]")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True
    tensorboard: bool = True
    samples_per_log: int = 2
    plot: bool = True
    wandb: bool = False  # Weights & Biases (pip install wandb): metrics and evaluations
    wandb_project: str = "cppo_jax"
    wandb_entity: str | None = None  # None: the account's default
    wandb_mode: str = "online"  # or "offline": written under the run folder, `wandb sync` later

    def __post_init__(self):
        _choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)
        _check(bool(self.wandb_project), "logging.wandb_project", self.wandb_project, "a name")
