"""Configs: every shipped config loads; overrides are typed; bad input names the key and the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cppo_jax.config import choices as config_choices
from cppo_jax.config import files as CI
from cppo_jax.config import schema as C

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py") if p.name != "tiny_sft.py")


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    extra = (
        ["model.path=/nonexistent/ok-for-validation"]
        if "7b" in path.name or "1p5b" in path.name
        else []
    )
    cfg = CI.load_config(path, extra)
    assert isinstance(cfg, C.Config)
    assert CI.from_dict(json.loads(json.dumps(CI.to_dict(cfg)))) == cfg


def test_overrides_are_parsed_by_type():
    cfg = CI.apply_overrides(
        C.Config(),
        [
            "cppo.pruning_rate=0.875",
            "cppo.allocation=true",
            "cppo.num_generations=8",
            "trainer.profile_steps=[2,4]",
            "reward.funcs=gsm8k_accuracy,gsm8k_format",
            "model.arch.hidden_size=96",
            "rollout.vllm_url=http://127.0.0.1:8000",
        ],
    )
    assert cfg.cppo.pruning_rate == 0.875 and cfg.cppo.allocation is True
    assert cfg.cppo.num_generations == 8
    assert cfg.trainer.profile_steps == (2, 4)
    assert cfg.reward.funcs == ("gsm8k_accuracy", "gsm8k_format")
    assert cfg.model.arch.hidden_size == 96
    assert cfg.rollout.vllm_url == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    "override, culprit, allowed",
    [
        ("cppo.pruning_rate=1.0", "cppo.pruning_rate", "[0, 1)"),
        ("cppo.pruning_rate=-0.1", "cppo.pruning_rate", "[0, 1)"),
        ("cppo.num_generations=1", "cppo.num_generations", ">= 2"),
        ("cppo.num_generations=abc", "cppo.num_generations", "integer"),
        ("cppo.metric=median", "cppo.metric", "'smallest'"),
        ("cppo.loss_type=sum", "cppo.loss_type", "'token_mean'"),
        ("cppo.allocation=maybe", "cppo.allocation", "true or false"),
        ("rollout.backend=ray", "rollout.backend", "'embedded'"),
        ("rollout.top_p=0", "rollout.top_p", "(0, 1]"),
        ("mesh.data=-2", "mesh.data", "-1 (the rest) or 0 (auto / unset)"),
        ("model.arch.num_kv_heads=3", "model.arch.num_kv_heads", "divisor"),
        ("trainer.run_name=../../etc", "trainer.run_name", "plain folder name"),
        ("reward.weights=1.0", "reward.weights", "one weight per reward function"),
    ],
)
def test_bad_values_name_key_value_and_allowed(override, culprit, allowed):
    with pytest.raises(C.ConfigError) as e:
        CI.apply_overrides(C.Config(), [override])
    msg = str(e.value)
    assert culprit in msg and allowed in msg
    assert override.split("=", 1)[1].strip("[]") in msg


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(
        C.ConfigError, match=r"unknown config key 'cppo\.prunning_rate'.*pruning_rate"
    ):
        CI.apply_overrides(C.Config(), ["cppo.prunning_rate=0.5"])
    with pytest.raises(C.ConfigError, match="unknown config key 'nope.x'"):
        CI.apply_overrides(C.Config(), ["nope.x=1"])


def test_malformed_override_and_sections():
    with pytest.raises(C.ConfigError, match="malformed"):
        CI.apply_overrides(C.Config(), ["cppo.pruning_rate"])
    with pytest.raises(C.ConfigError, match="is a section"):
        CI.apply_overrides(C.Config(), ["cppo=1"])


def test_cross_field_rules():
    with pytest.raises(C.ConfigError, match="rollout.vllm_url"):
        CI.apply_overrides(C.Config(), ["rollout.backend=vllm"])
    with pytest.raises(C.ConfigError, match="nothing to overlap"):
        CI.apply_overrides(C.Config(), ["rollout.overlap=1"])


def test_config_files_errors(tmp_path):
    with pytest.raises(C.ConfigError, match="does not exist"):
        CI.load_config(tmp_path / "missing.py")
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n")
    with pytest.raises(C.ConfigError, match="bad.py.*failed to load"):
        CI.load_config(bad)
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    with pytest.raises(C.ConfigError, match="defines no get_config"):
        CI.load_config(none)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def get_config():\n    return {'cppo': {}}\n")
    with pytest.raises(C.ConfigError, match="returned dict, expected Config"):
        CI.load_config(wrong)


def test_from_dict_rejects_unknown_and_mistyped_keys():
    with pytest.raises(C.ConfigError, match="unknown config key 'cppo.bogus'"):
        CI.from_dict({"cppo": {"bogus": 1}})
    with pytest.raises(C.ConfigError, match="'cppo.num_generations' = '16'.*int"):
        CI.from_dict({"cppo": {"num_generations": "16"}})


@pytest.mark.parametrize(
    "overrides",
    [
        # The order launch/gpu_node.sh, the sbatch script and the docs use: the backend first.
        ["rollout.backend=vllm", "rollout.vllm_url=http://127.0.0.1:8011"],
        ["mesh.fsdp=-1", "mesh.data=1"],
        ["reward.funcs=[gsm8k_accuracy]", "reward.weights=[1.0]"],
        ["reward.weights=[2.0]", "reward.funcs=[gsm8k_accuracy]"],
    ],
    ids=["backend-then-url", "fsdp-then-data", "funcs-then-weights", "weights-then-funcs"],
)
def test_overrides_are_validated_once_after_all_are_applied(overrides):
    """Each of these failed when every single override was validated on its own."""
    cfg = CI.apply_overrides(C.Config(), overrides)
    for item in overrides:
        key, _, _ = item.partition("=")
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) is not None
    # The whole is still validated: the same pairs, left half-done, are refused naming the key.
    with pytest.raises(C.ConfigError, match="rollout.vllm_url"):
        CI.apply_overrides(C.Config(), ["rollout.backend=vllm"])
    # (A mesh has no half-done state since mesh=auto: `mesh.fsdp=-1` alone is data = 1, fsdp = rest.)
    with pytest.raises(C.ConfigError, match="at most one axis of size -1"):
        CI.apply_overrides(C.Config(), ["mesh.fsdp=-1", "mesh.data=-1"])


def test_config_found_by_bare_name(monkeypatch, tmp_path):
    """`--config math7b.py` (what users are told to type) finds configs/math7b.py from anywhere."""
    monkeypatch.chdir(tmp_path)
    for name in ("math7b.py", "math7b", "tiny_cpu.py"):
        path = CI.resolve_config_path(name)
        assert path.parent.name == "configs" and path.stem == Path(name).stem
    cfg = CI.load_config("math7b.py", ["model.path=/nonexistent/ok-for-validation"])
    assert cfg.model.path == "/nonexistent/ok-for-validation"
    with pytest.raises(C.ConfigError, match="nosuch.py"):
        CI.resolve_config_path("nosuch.py")


def test_bf16_params_refuse_an_lr_their_updates_round_away():
    """bf16 keeps 8 significant bits: a weight of magnitude 0.02 moves by no less than 0.02 * 2^-9 per
    rounding step (half its spacing), so AdamW's update of about lr is lost below that."""
    import numpy as np

    bf16 = "model.param_dtype=bfloat16"
    with pytest.raises(C.ConfigError) as e:
        CI.apply_overrides(C.Config(), [bf16, "optim.lr=1e-6"])  # the paper's lr
    msg = str(e.value)
    for key in ("'optim.lr' = 1e-06", "model.param_dtype=bfloat16", "optim.allow_bf16_underflow"):
        assert key in msg
    # Accepted: float32 params (the default) at that lr, bf16 at a large enough lr, or the override.
    threshold = 0.02 * 2.0**-9
    assert CI.apply_overrides(C.Config(), ["optim.lr=1e-6"]).optim.lr == 1e-6
    assert CI.apply_overrides(C.Config(), [bf16, f"optim.lr={threshold}"]).optim.lr == threshold
    cfg = CI.apply_overrides(C.Config(), [bf16, "optim.lr=1e-6", "optim.allow_bf16_underflow=true"])
    assert cfg.model.param_dtype == "bfloat16" and cfg.optim.allow_bf16_underflow

    # The derivation, checked on bf16 itself: an update of the threshold leaves every weight in
    # [0.02, 2) unchanged; one of two spacings at 0.02 (bf16's eps is the spacing at 1) moves it.
    assert (0.02, threshold) == (config_choices.BF16_TYPICAL_WEIGHT, config_choices.BF16_MIN_LR)
    jnp = pytest.importorskip("jax.numpy")
    w = jnp.asarray(np.geomspace(0.02, 1.99, 257), jnp.bfloat16)
    assert bool(jnp.all(w + jnp.asarray(threshold, jnp.bfloat16) == w))
    spacing = 0.02 * float(jnp.finfo(jnp.bfloat16).eps)
    assert bool(jnp.all((w[:1] - jnp.asarray(2 * spacing, jnp.bfloat16)) != w[:1]))


def test_dr_grpo_needs_unscaled_advantages():
    """Dr. GRPO's advantages are r - mean: the group std normalisation is what it removes."""
    for scale in ("group", "batch"):
        with pytest.raises(C.ConfigError) as e:
            CI.apply_overrides(C.Config(), ["cppo.loss_type=dr_grpo", f"cppo.adv_scale={scale}"])
        msg = str(e.value)
        assert "'cppo.loss_type' = 'dr_grpo'" in msg and f"cppo.adv_scale={scale!r}" in msg
        assert "cppo.adv_scale=none" in msg
    for order in (["cppo.loss_type=dr_grpo", "cppo.adv_scale=none"],) * 2:
        cfg = CI.apply_overrides(C.Config(), order)
        assert (cfg.cppo.loss_type, cfg.cppo.adv_scale) == ("dr_grpo", "none")
        order.reverse()


def test_dapo_loss_type_is_refused_with_what_to_use():
    """'dapo' computed exactly token_mean in every path of the trainer; the message says what DAPO is
    here: token_mean with clip-higher, and the overlong and dynamic-sampling filters."""
    with pytest.raises(C.ConfigError) as e:
        CI.apply_overrides(C.Config(), ["cppo.loss_type=dapo"])
    msg = str(e.value)
    for part in ("'cppo.loss_type' = 'dapo'", "token_mean", "cppo.eps_high=0.28"):
        assert part in msg
    assert "dapo" not in config_choices.LOSS_TYPES
    cfg = CI.apply_overrides(C.Config(), ["cppo.loss_type=token_mean", "cppo.eps_high=0.28"])
    assert cfg.cppo.eps_high == 0.28


def test_renamed_keys_and_values_are_read_with_a_warning():
    """`cppo.processes` / `cppo.scope=process` (old names): an override, a saved config.json and a
    config file's constructor still load, each with a FutureWarning naming the new name."""
    with pytest.warns(
        FutureWarning, match="'cppo.processes' is an old name, read as 'cppo.slices'"
    ):
        cfg = CI.apply_overrides(C.Config(), ["cppo.scope=slice", "cppo.processes=2"])
    assert (cfg.cppo.scope, cfg.cppo.slices) == ("slice", 2)
    with pytest.warns(
        FutureWarning, match="'cppo.scope=process' is an old name, read as 'cppo.scope=slice'"
    ):
        cfg = CI.apply_overrides(C.Config(), ["cppo.scope=process"])
    assert cfg.cppo.scope == "slice"
    saved = CI.to_dict(C.Config())
    saved["cppo"]["processes"] = saved["cppo"].pop("slices") + 2
    saved["cppo"]["scope"] = "process"
    with pytest.warns(FutureWarning, match="cppo.processes"):
        cfg = CI.from_dict(saved)
    assert (cfg.cppo.scope, cfg.cppo.slices) == ("slice", 3)
    with pytest.warns(FutureWarning, match="cppo.scope=process"):
        assert C.CPPOConfig(scope="process").scope == "slice"
    # The old key is not a second way to set the field: it reads as the new one, with its checks.
    with pytest.raises(C.ConfigError, match="cppo.slices"), pytest.warns(FutureWarning):
        CI.apply_overrides(C.Config(), ["cppo.processes=0"])


def test_a_shipped_config_by_name_a_new_one_without_code_and_an_unknown_name_lists_them(
    monkeypatch, tmp_path
):
    """`--config gsm8k_1p5b` is configs/gsm8k_1p5b.py; any configs/<name>.py is found the same way
    (one added later needs no code); an unknown name is refused naming the known configs."""
    monkeypatch.chdir(tmp_path)
    shipped = Path(CI.__file__).resolve().parents[2] / "configs"
    assert CI.resolve_config_path("gsm8k_1p5b") == shipped / "gsm8k_1p5b.py"
    assert CI.resolve_config_path(str(shipped / "math7b.py")) == shipped / "math7b.py"  # a path
    assert set(CI.known_configs()) >= {p.stem for p in shipped.glob("*.py")}

    added = tmp_path / "more"
    added.mkdir()
    text = (shipped / "gsm8k_1p5b.py").read_text()
    (added / "added_later_config.py").write_text(text)
    monkeypatch.setattr(CI, "CONFIG_DIRS", (*CI.CONFIG_DIRS, added))
    assert CI.resolve_config_path("added_later_config") == added / "added_later_config.py"
    assert "added_later_config" in CI.known_configs()

    with pytest.raises(C.ConfigError) as e:
        CI.load_config("gsm8k_1p5", [])
    msg = str(e.value)
    assert "'gsm8k_1p5'" in msg and "did you mean gsm8k_1p5b" in msg
    assert "the known configs are " in msg and all(
        n in msg for n in ("gsm8k_1p5b", "math7b", "tiny_cpu", "added_later_config")
    )
