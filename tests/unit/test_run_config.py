"""earl.config: YAML + CLI overrides fill the typed tree; bad input names the field and fix."""

from __future__ import annotations

import pytest

from earl.config import RunConfig, load_config, parse_overrides, to_dict
from earl.stages.optim import OptimConfig, lr_scale


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.batch_size % cfg.group_size == 0
    assert cfg.recipe == "tictactoe" and cfg.algorithm.critic == "recipe"  # the recipe's
    assert load_config(None, ["--recipe=calc"]).recipe == "calc"


def test_yaml_then_overrides(tmp_path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("steps: 7\noptim:\n  lr: 0.01\nalgorithm:\n  gamma: 0.9\nplacement:\n"
                 "  rollout: 2\n")
    cfg = load_config(f, ["--optim.lr=3e-4", "--max_policy_lag", "0",
                          "--model.hidden=96", "--dump_trajectories=false"])
    assert cfg.steps == 7
    assert cfg.optim.lr == pytest.approx(3e-4)   # CLI wins over YAML
    assert cfg.algorithm.gamma == pytest.approx(0.9)  # YAML kept where not overridden
    assert cfg.placement.rollout == 2
    assert cfg.max_policy_lag == 0
    assert cfg.model.hidden == 96
    assert cfg.dump_trajectories is False
    assert to_dict(cfg)["optim"]["lr"] == pytest.approx(3e-4)


def test_parse_overrides_nested() -> None:
    assert parse_overrides(["--a.b=1", "--a.c", "x", "--d=[1, 2]"]) == \
        {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ValueError, match="--key.sub=value"):
        parse_overrides(["steps=3"])
    with pytest.raises(ValueError, match="needs a value"):
        parse_overrides(["--steps"])
    with pytest.raises(ValueError, match="--seed=VALUE"):  # a bare flag never eats the next
        parse_overrides(["--seed", "--steps=3"])
    with pytest.raises(ValueError, match="conflicts"):  # a section is never silently replaced
        parse_overrides(["--selector.initial_context=192", "--selector=on"])


def test_a_list_of_any_length_fills_a_variadic_tuple() -> None:
    cfg = load_config(None, ["--selector.policy.dp_only=[reference, train]"])
    assert cfg.selector.policy.dp_only == ("reference", "train")
    with pytest.raises(TypeError, match="selector.policy.dp_only"):
        load_config(None, ["--selector.policy.dp_only=3"])


@pytest.mark.parametrize(("overrides", "exc", "words"), [
    (["--algorithm.lrr=1"], ValueError, ["algorithm.lrr", "valid keys under algorithm", "gamma"]),
    (["--algorithm.lr=1"], ValueError, ["algorithm.lr", "now optim.lr"]),
    (["--algorithm.clip=0.3"], ValueError, ["algorithm.clip", "clip_low and algorithm.clip_high"]),
    (["--selector_initial_context=9"], ValueError, ["now selector.initial_context"]),
    (["--algorithm.clip_high=0"], ValueError, ["algorithm.clip_low", "> 0"]),
    (["--algorithm.agg=mean"], ValueError, ["algorithm.agg", "token-mean"]),
    (["--selector=maybe"], ValueError, ["selector.mode", "--selector on"]),
    (["--selector.policy.headroom=1.5"], ValueError, ["selector.policy.headroom", "[0, 1)"]),
    (["--selector.policy.actors.rollout=dance"], ValueError,
     ["selector.policy.actors.rollout", "'train'"]),
    (["--optim.betas=[0.9]"], TypeError, ["optim.betas", "2 values"]),
    (["--nope=1"], ValueError, ["nope", "top level"]),
    (["--batch_size=30", "--group_size=8"], ValueError, ["batch_size", "not divisible", "24"]),
    (["--placement.trainer=3"], ValueError, ["placement.trainer", "divides"]),
    (["--placement.rollout=0"], ValueError, ["placement.rollout", "at least 1"]),
    (["--placement.reference=0", "--algorithm.kl_coef=0.1"], ValueError,
     ["placement.reference", "kl_coef"]),
    (["--placement.device=tpu"], ValueError, ["placement.device", "cpu"]),
    (["--placement.devices=4"], ValueError, ["placement.devices", "slot_memory_mib"]),
    (["--placement.devices=4", "--placement.slot_memory_mib=900"],
     ValueError, ["placement.devices", "selector's to hand out", "--selector on"]),
    (["--selector.policy_factory=nocolon"], ValueError,
     ["selector.policy_factory", "PATH.py:NAME"]),
    (["--model.path=/does/not/exist"], ValueError, ["model.path", "does not exist"]),
    (["--steps=ten"], TypeError, ["steps", "integer"]),
    (["--optim.lr=fast"], TypeError, ["optim.lr", "number"]),
    (["--algorithm=3"], TypeError, ["algorithm", "mapping"]),
    (["--max_policy_lag=-1"], ValueError, ["max_policy_lag", "synchronous"]),
    (["--eval_games=201"], ValueError, ["eval_games", "even"]),
    (["--model.hidden=48"], ValueError, ["model.hidden", "32"]),
    (["--optim.lr_anneal_from=1.5"], ValueError, ["optim.lr_anneal_from", "[0, 1]"]),
    (["--optim.lr_final=0"], ValueError, ["optim.lr_final", "fraction of lr"]),
    (["--optim.lr=.inf"], ValueError, ["optim.lr", "finite"]),
    (["--algorithm.entropy_coef=.inf"], ValueError, ["algorithm.entropy_coef", "finite"]),
    (["--optim.grad_clip=-1"], ValueError, ["optim.grad_clip", ">= 0"]),
    (["--optim.grad_clip=.nan"], ValueError, ["optim.grad_clip", "finite"]),
    (["--warm_start.lr=-1"], ValueError, ["warm_start.lr", "> 0"]),
    (["--eval_every=-5"], ValueError, ["eval_every", ">= 0"]),
    (["--output_dir="], ValueError, ["output_dir", "folder"]),
    (["--recipe=chess"], ValueError, ["recipe", "tictactoe", "agent"]),
    (["--algorithm.off_policy=magic"], ValueError, ["algorithm.off_policy", "decoupled"]),
    (["--agent=a.py:agent"], ValueError, ["tasks", "FILE.jsonl"]),
    (["--weight_update=keep"], ValueError,
     ["weight_update", "inflight, inflight_keep_kv, drain", "'keep'"]),
    (["--tasks=t.jsonl", "--recipe=calc"], ValueError, ["agent", "PATH.py:NAME"]),
])
def test_bad_input_names_field_and_fix(overrides: list[str], exc: type[Exception],
                                       words: list[str]) -> None:
    with pytest.raises(exc) as info:
        load_config(None, overrides)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_weight_update_defaults_to_keeping_the_kv_on_cpu_and_preempting_on_cuda() -> None:
    assert load_config().weight_update == "inflight_keep_kv"
    assert load_config(None, ["--placement.device=cuda"], gpus=3).weight_update == "inflight"
    assert load_config(None, ["--weight_update=drain"]).weight_update == "drain"


def test_keep_kv_loads_turn_async_scheduling_off() -> None:
    from earl.loop.stage_configs import engine_config
    from earl.stages.vllm_build import engine_args

    for mode, on in (("inflight_keep_kv", False), ("inflight", True), ("drain", True)):
        cfg = load_config(None, ["--placement.device=cuda", f"--weight_update={mode}"], gpus=3)
        ec = engine_config(cfg, model="m", max_model_len=256)
        assert ec.async_scheduling is on
        assert engine_args(ec, gpu_total_mib=80_000)["async_scheduling"] is on
        cpu = engine_config(load_config(None, [f"--weight_update={mode}"]), model="m",
                            max_model_len=256)
        assert engine_args(cpu)["async_scheduling"] is False  # never on CPU


def test_missing_yaml_file_and_model_folder_without_config(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_config(None, [f"--model.path={tmp_path / 'm'}"])
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(TypeError, match="mapping"):
        load_config(bad)


def test_lr_anneal_schedule() -> None:
    a = OptimConfig(lr_anneal_from=0.5, lr_final=0.1)
    assert lr_scale(a, 0.0) == lr_scale(a, 0.5) == 1.0
    assert lr_scale(a, 0.75) == pytest.approx(0.55)  # halfway down from 1.0 to 0.1
    assert lr_scale(a, 1.0) == pytest.approx(0.1) == lr_scale(a, 1.3)  # past the limit: floor
    assert lr_scale(OptimConfig(lr_anneal_from=1.0), 1.0) == 1.0  # off


def test_bad_files_name_file_and_line(tmp_path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("steps: 3\nalgorithm: [lr\n")
    with pytest.raises(ValueError, match=r"bad.yaml:\d+"):
        load_config(f)
    f.write_text("steps: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match="bad.yaml:1"):
        load_config(f)
    f.write_bytes(b"\x00\x01\x02binary")
    with pytest.raises(ValueError, match="binary"):
        load_config(f)
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid JSON"):
        load_config(None, [f"--model.path={m}"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_config(None, [f"--output_dir={tmp_path / 'file'}"])


def test_selector_shorthand_and_its_knobs_are_config_fields() -> None:
    cfg = load_config(None, ["--selector.mode=on", "--selector.policy.headroom=0.3"])
    assert load_config(None, ["--selector", "on"]).selector.on
    assert cfg.selector.on and cfg.selector.policy.headroom == pytest.approx(0.3)
    assert cfg.selector.policy.bucket_base == 256  # the run's default, not the policy class's
    assert not load_config(None, ["--selector=off"]).selector.on
    d = to_dict(cfg)
    assert d["selector"]["policy"]["actors"] == {"rollout": "rollout", "trainer": "train"}
    assert load_config(None, ["--selector.mode=on"]).selector == cfg.selector.__class__(
        mode="on", policy=cfg.selector.__class__().policy)


def test_every_field_is_declared_once() -> None:
    """No field name repeats between the run's sections that configure the same component
    (the trainer's loss and optimizer are sections, not copies)."""
    import dataclasses

    from earl.config import AlgorithmConfig
    from earl.stages.trainer_torch import TrainerConfig

    trainer = {f.name for f in dataclasses.fields(TrainerConfig)}
    for section in (AlgorithmConfig, OptimConfig):
        names = {f.name for f in dataclasses.fields(section)}
        assert not names & trainer - {"temperature"}, names & trainer


async def _agent(rollout: object, sample: object) -> float:
    return 0.0


def test_eval_games_applies_to_eval_tasks(tmp_path) -> None:
    """`--eval_games N` with `--eval-tasks FILE` evaluates the file's first N lines (0: all),
    and asking for more than the file has is refused naming both numbers."""
    from earl.resolve import resolve_recipe

    f = tmp_path / "eval.jsonl"
    f.write_text("".join(f'{{"q": {i}}}\n' for i in range(10)))

    def size(n: int) -> int:
        recipe, _ = resolve_recipe(RunConfig(eval_tasks=str(f), eval_games=n),
                                   agent=_agent, tasks=[{"q": 0}])
        return len(recipe.eval.samples("validation", 0, 64))

    assert size(0) == 10 and size(4) == 4 and size(3) == 3  # odd is fine for a file
    with pytest.raises(ValueError, match=r"eval_games.*12.*10 samples"):
        size(12)


def test_a_tensor_parallel_replica_takes_its_devices() -> None:
    """4 devices: a TP-2 replica takes two, the trainer's two ranks the others; one device
    more would be left to a selector that is off."""
    base = ["--placement.slot_memory_mib=900", "--placement.reference=0", "--algorithm.kl_coef=0",
            "--placement.rollout_tp=2", "--placement.trainer=2"]
    assert load_config(None, [*base, "--placement.devices=4"]).placement.devices == 4
    with pytest.raises(ValueError, match=r"ranks take 4 \(rollout 1 x rollout_tp 2"):
        load_config(None, [*base, "--placement.devices=5"])
