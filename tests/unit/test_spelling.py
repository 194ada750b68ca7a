"""A mistyped override is refused in one line with the name meant, from the config alone (no torch)."""

from __future__ import annotations

import pytest

from sharded_exp import spelling
from sharded_exp.errors import closest
from sharded_exp.spelling import misspelled, refuse_misspelled


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["trainer.wold_size=4"],
            "trainer.wold_size is not a setting of this config; did you mean trainer.world_size?",
        ),
        (["model.hiden=3"], "model.hiden is not a setting of this config; did you mean model.hidden?"),
        (["strateg=fsdp"], "strateg is not a setting of this config; did you mean strategy?"),
        (["strategy=fdsp"], "strategy=fdsp is not an option of strategy; did you mean strategy=fsdp?"),
        (["precision=fp17"], "precision=fp17 is not an option of precision; did you mean precision=fp16?"),
        # every value of a sweep, not only the first
        (["-m", "strategy=ddp,fdsp"], "strategy=fdsp is not an option of strategy; did you mean strategy=fsdp?"),
        # a group's own range check, which needs no torch
        (["trainer.world_size=0"], "trainer.world_size=0 must be >= 1"),
        # a bad value anywhere in a sweep, not only first (each point composed and checked)
        (["-m", "model=gpt", "model.n_heads=3,4"], "model.d_model=128 is not divisible by model.n_heads=3"),
        (["-m", "model=gpt", "model.n_heads=4,3"], "model.d_model=128 is not divisible by model.n_heads=3"),
        (["-m", "strategy=ddp,fsdp", "model.depth=2,0"], "model.depth=0 must be >= 1 (model=mlp)"),
        (["-m", "trainer.grad_accum=1,0"], "trainer.grad_accum=0 must be >= 1"),
        # a Hugging Face model's own heads and kernel name, from the config alone
        (
            ["model=hf_llama", "model.config.num_attention_heads=7"],
            "model.config.hidden_size=128 is not divisible by model.config.num_attention_heads=7",
        ),
        (["model=hf_gpt2", "model.attn_implementation=flash"], "model.attn_implementation='flash' is not one of null"),
    ],
)
def test_a_typo_is_named_with_the_closest_valid_name(argv, said):
    assert misspelled(argv).startswith(said)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--cfg", "job"],
        ["strategy=fsdp", "trainer.world_size=2", "precision=bf16"],
        ["-m", "strategy=ddp,fsdp", "trainer.world_size=1,2"],
        ["-m", "precision=choice(32,bf16)"],
        ["model=gpt", "model.d_model=64"],
        ["-m", "model=gpt", "model.n_heads=2,4,8"],  # every point divides 128
        ["model=hf_bert", "data=token_classification", "data.min_len=0"],  # 0: sequences from one token
        ["model=hf_gpt2", "data=text_file"],  # data.path still missing: the others checked, it left to pre-flight
        [
            "+trainer.new_key=1"
        ],  # a key added on purpose: pre-flight, which reads the schemas, refuses what nothing reads
        ["hydra/launcher=submitit_local", "hydra.run.dir=x"],  # Hydra's own groups are not ours to check
        ["-cn", "plan"],  # another config: left to Hydra
    ],
)
def test_what_composes_is_let_through(argv):
    assert misspelled(argv) is None


def test_the_planner_config_is_checked_with_its_own_keys():
    assert misspelled(["plan.wrld_sizes=[8]"], "plan").startswith("plan.wrld_sizes is not a setting")
    assert misspelled(["plan.world_sizes=[8]"], "plan") is None


def test_closest_suggests_only_a_near_name():
    assert closest("world_sise", ["world_size", "batch_size"]) == "world_size"
    assert closest("zzz", ["world_size", "batch_size"]) is None


def test_the_refusal_is_one_error_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        refuse_misspelled(["strategy=fdsp"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: strategy=fdsp is not an option") and err.count("\n") == 1
    assert "search path" not in err and "HYDRA_FULL_ERROR" not in err


@pytest.mark.parametrize("argv", [["-m", "optimizer.lr=interval(0.001,0.1)"], ["-m", "trainer.batch_size=range(4,8)"]])
def test_a_sweep_the_check_cannot_expand_is_left_to_hydra(argv):
    # Hydra expands interval() only inside a sweeper (its ConfigLoader); the check must not fail on it.
    assert misspelled(argv) is None


@pytest.mark.parametrize("config_name", ["config", "plan"])
def test_a_config_file_that_is_no_readable_config_is_named_before_torch(config_name, tmp_path):
    absent = tmp_path / "absent.json"
    assert misspelled(["model=hf_causal", f"model.config_file={absent}"], config_name) == (
        f"model.config_file={absent} is no file: give the path of a Hugging Face config.json "
        "(read from this machine; nothing is downloaded)"
    )
    broken = tmp_path / "config.json"
    broken.write_text("{")
    assert misspelled(["model=hf_llama", f"model.config_file={broken}"], config_name).startswith(
        f"model.config_file={broken} is not readable JSON"
    )
    broken.write_text('{"model_type": "llama"}')
    assert misspelled(["model=hf_causal", f"model.config_file={broken}"], config_name) is None


def test_a_sweep_longer_than_the_checks_leaves_its_last_values_to_their_jobs(monkeypatch):
    import sharded_exp.spelling as spelling

    monkeypatch.setattr(spelling, "MAX_SWEEP_POINTS", 3)  # each point a composition
    assert misspelled(["-m", "model=gpt", "model.n_heads=4,4,4,4,3"]) is None  # past the last checked
    assert misspelled(["-m", "model=gpt", "model.n_heads=4,4,4,3"]).endswith("model.n_heads=3")  # the last checked


def test_each_point_of_a_sweep_is_composed_one_value_varied_at_a_time(monkeypatch):
    import sharded_exp.spelling as spelling

    seen = []
    monkeypatch.setattr(
        spelling, "value_problem", lambda cfg, world_size=None: seen.append((cfg.strategy.name, cfg.trainer.steps))
    )
    assert misspelled(["-m", "strategy=ddp,fsdp,zero1", "trainer.steps=10,20"]) is None
    assert seen == [("ddp", 10), ("fsdp", 10), ("zero1", 10), ("ddp", 20)]  # each value once, the others first
    seen.clear()
    monkeypatch.setattr(
        spelling, "value_problem", lambda cfg, world_size=None: seen.append((cfg.precision.name, cfg.trainer.steps))
    )
    assert misspelled(["-m", "precision=32,16,bf16", "trainer.steps=10,20"]) is None  # 16: an option, not a number
    assert seen == [("32", 10), ("16", 10), ("bf16", 10), ("32", 20)]
    seen.clear()
    monkeypatch.setattr(spelling, "MAX_SWEEP_POINTS", 2)
    assert misspelled(["-m", "precision=32,16,bf16", "trainer.steps=10,20"]) is None
    assert seen == [("32", 10), ("16", 10), ("bf16", 10)]


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "trainer.steps=30,0", "trainer.steps=20"],  # a later override wins, as Hydra applies them
        ["-m", "model=hf_llama", "model.config.num_attention_heads=4,7", "model.config={num_attention_heads:8}"],
        ["-m", "experiment=null,seed_table"],  # null: no preset
        ["-m", "model=gpt", "model.n_heads=shuffle(4,8)"],  # drawn anew by Hydra: left to the jobs
    ],
)
def test_a_sweep_hydra_runs_as_given_is_let_through(argv):
    assert misspelled(argv) is None


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["-m", "model=gpt", "model.n_heads='4','3'"],
            "model.d_model=128 is not divisible by model.n_heads=3",
        ),  # quoted
        (["-m", "logger.run_name=${hydra:job.name},x", "trainer.steps=10,0"], "trainer.steps=0 must be >= 1"),
        (["-m", "trainer.steps=0", "logger.run_name=${hydra:job.name},x"], "trainer.steps=0 must be >= 1"),
    ],
)
def test_a_bad_value_is_found_beside_what_cannot_be_resolved_here_and_when_quoted(argv, said):
    assert misspelled(argv) == said


def test_the_jobs_world_size_is_torchruns_where_it_starts_the_ranks(monkeypatch):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"trainer": {"world_size": 4}})
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert spelling.job_world_size(cfg) == 4
    assert spelling.job_world_size(OmegaConf.create({"trainer": {"world_size": "???"}})) is None
    env = {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "6", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "6",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert spelling.job_world_size(cfg) == 6


def test_a_value_that_must_divide_the_world_size_is_held_only_where_the_command_knows_it(monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    hsdp = ["strategy=fsdp", "strategy.replicate=4"]
    said = misspelled([*hsdp, "trainer.world_size=2"])
    assert said.startswith("strategy.replicate=4 must divide trainer.world_size=2"), said
    assert misspelled([*hsdp, "trainer.world_size=8"]) is None
    # the size is decided elsewhere: a plan's own world sizes, another launcher's tasks, a preset's sweep
    assert misspelled([*hsdp, "plan.world_sizes=[8,64]"], "plan") is None
    assert misspelled([*hsdp, "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=4"]) is None
    assert misspelled(["-m", *hsdp, "experiment=seed_study_gpu"]) is None
    # a world size that does not resolve here leaves the other values held
    said = misspelled(["trainer.world_size=${oc.env:SHARDED_EXP_SURELY_UNSET_NP}", "model.depth=0"])
    assert said == "model.depth=0 must be >= 1 (model=mlp)", said
    assert spelling.job_world_size(spelling.OmegaConf.create({"trainer": {"world_size": -1}})) is None
