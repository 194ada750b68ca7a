"""Your model, not ours: Hugging Face models built from their config classes (no download)
and any nn.Module given by ``_target_``, under every strategy, held against DDP."""

from __future__ import annotations

import pytest
import torch

from sharded_exp.compose import compose
from tests.helpers.jobs import ROOT, STRATEGY_NAMES, TINY, launch_job, read_result, run_cli, without_package
from tests.helpers.overrides import SCALAR
from tests.helpers.states import max_relative_diff

HF_SMALL = ["model.seq_len=32", "trainer.batch_size=4", "trainer.steps=6"]
# SGD with momentum (sharded as optimizer state like Adam's moments). With Adam, BERT's
# attention key biases cannot be compared: their gradient is zero in exact arithmetic
# (softmax ignores a shift shared by every score), and Adam turns its rounding noise,
# whose sign differs between strategies, into full +-lr steps.
TINY_RUN = [o for o in TINY if not o.startswith("model.")]  # the MLP's shapes do not apply
COMMON = [*HF_SMALL, "optimizer=sgd", "trainer.save_final_state=true", "optimizer.no_decay_lr_scale=0.5"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf_bert", "hf_gpt2"])
@pytest.mark.parametrize("strategy", [s for s in STRATEGY_NAMES if s != "ddp"])
def test_hf_model_matches_ddp_and_its_prediction(strategy, model, ddp_reference, tmp_path):
    ref_dir, ref = ddp_reference(f"model={model}", *COMMON)
    result = launch_job([f"model={model}", f"strategy={strategy}", *COMMON], tmp_path)
    assert result["status"] == "ok", result.get("error")
    assert max_relative_diff(tmp_path, ref_dir) <= 1e-6
    assert result["param_digest"]["l2"] == pytest.approx(ref["param_digest"]["l2"], rel=1e-6)
    # model states predicted within 2% on every rank (GPT-2's tied head counted once)
    assert result["memory"]["model_states_rel_error_max"] <= 0.02
    for entry in result["memory"]["per_rank"]:
        for part in ("params", "grads", "optimizer"):
            assert entry["predicted_model_states_mib"][part] == pytest.approx(entry["model_states_mib"][part], rel=0.02)


@pytest.mark.slow
def test_tied_head_is_one_parameter_everywhere(ddp_reference):
    _, result = ddp_reference("model=hf_gpt2", *COMMON)
    state = torch.load(ddp_reference("model=hf_gpt2", *COMMON)[0] / "model_final.pt", weights_only=True)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # still tied after training
    counted = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")
    assert result["params"] == counted  # the shared weight counts once


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_one_rank_inf_at_precision_16_skips_the_step_on_every_rank(strategy, tmp_path):
    result = launch_job(
        ["model=hf_bert", f"strategy={strategy}", "precision=16", *HF_SMALL, "trainer.steps=4"],
        tmp_path,
        env={"SHARDED_EXP_FAULT": "rank=1,step=2,kind=inf_grad"},
    )
    assert result["status"] == "ok", result.get("error")
    ranks = result["memory"]["per_rank"]
    assert [r["skipped_steps"] for r in ranks] == [1, 1]
    assert ranks[0]["loss_scale"] == ranks[1]["loss_scale"] == 2.0**15
    assert all(r["nonfinite_params"] == 0 for r in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf_bert", "hf_gpt2", "hf_llama"])
def test_bf16_trains(model, tmp_path):
    result = launch_job(
        [f"model={model}", "precision=bf16", "model.seq_len=32", "trainer.batch_size=8", "trainer.steps=12",
         "trainer.log_interval=3", "optimizer.lr=3e-3"],
        tmp_path,
    )  # fmt: skip
    assert result["status"] == "ok", result.get("error")
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]


@pytest.mark.slow
def test_hf_bert_headline_command_reports_eval(tmp_path):
    proc = run_cli(
        ["model=hf_bert", "strategy=sharded_ddp", "precision=16", *TINY_RUN, f"hydra.run.dir={tmp_path}"], cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(tmp_path)
    final = result["eval"]["final"]
    assert 0 <= final["eval/accuracy"] <= 1 and 0 <= final["eval/f1"] <= 1 and final["eval/loss"] > 0
    assert result["eval"]["history"][-1]["step"] == result["steps_done"]
    assert "acc " in proc.stdout and "f1 " in proc.stdout  # the end-of-run table


def test_eval_metrics_come_from_the_task_and_learn(tmp_path):
    """Token classification is scored per token (padding excluded), not as a classifier or a
    language model; a few steps of training beat chance on held-out batches."""
    result = launch_job(
        ["model=hf_bert", "model.seq_len=16", "trainer.batch_size=16", "trainer.steps=40", "trainer.warmup_steps=1",
         "trainer.log_interval=10", "optimizer.lr=3e-3", "trainer.eval_every=20", "trainer.eval_batches=4"],
        tmp_path,
    )  # fmt: skip
    assert result["status"] == "ok", result.get("error")
    assert "accuracy" in result["history"][-1] and "perplexity" not in result["history"][-1]
    evals = result["eval"]["history"]
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[-1]["eval/accuracy"] > 2 / 9  # chance is about 1/9
    assert (
        evals[-1]["eval/loss"] < evals[0]["eval/loss"] + 1e-9 or evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"]
    )


# --------------------------------------------------------------------------- any nn.Module
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_model_of_your_own_trains(strategy, user_module, tmp_path):
    proc = run_cli(
        ["model=custom", "model._target_=my_models.build", "+model.hidden=24", f"strategy={strategy}", *TINY_RUN,
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=user_module,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(tmp_path)
    assert result["status"] == "ok" and result["model"] == "custom"
    assert result["params"] == 64 * 24 + 24 + 24 * 24 + 24 + 24 * 10 + 10
    assert result["memory"]["model_states_rel_error_max"] <= 0.02
    assert result["history"][-1]["loss"] < result["history"][0]["loss"] * 1.05


@pytest.mark.slow
def test_a_model_without_a_loss_is_named(user_module, tmp_path):
    proc = run_cli(
        ["model=custom", "model._target_=my_models.build_no_loss", *TINY_RUN, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=user_module,
    )  # fmt: skip
    assert proc.returncode == 1
    error = read_result(tmp_path)["error"]
    assert "without a loss" in error and "batch keys inputs, targets" in error


@pytest.mark.slow
def test_a_model_that_rejects_a_batch_key_is_refused_before_ranks_start(user_module, tmp_path):
    proc = run_cli(
        ["model=custom", "model._target_=my_models.build_only_x", *TINY_RUN, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=user_module,
    )  # fmt: skip
    assert proc.returncode == 2
    assert (
        "model=custom cannot take the batch of data=teacher: forward() has no argument inputs, targets" in proc.stderr
    )
    assert not (tmp_path / "result.json").exists()


@pytest.mark.slow
def test_custom_without_a_target_is_refused(tmp_path):
    proc = run_cli(["model=custom", *TINY_RUN, f"hydra.run.dir={tmp_path}"], cwd=ROOT)
    assert proc.returncode != 0
    assert "model._target_" in proc.stderr


@pytest.mark.slow
def test_hf_model_without_transformers_names_the_extra(tmp_path):
    env = without_package(tmp_path, "transformers")
    proc = run_cli(["model=hf_bert", *TINY_RUN, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "model=hf_bert needs the package transformers, which is not installed here (pip install -e '.[hf]')"
        in proc.stderr
    )
    assert not (tmp_path / "run" / "result.json").exists()


# ------------------------------------------------------- model.attn_implementation
@pytest.mark.parametrize("model", ["hf_bert", "hf_gpt2", "hf_llama"])
def test_attn_implementation_reaches_the_hugging_face_config(model):
    from sharded_exp.models import build_model

    for value, expected in ((None, "sdpa"), ("eager", "eager"), ("sdpa", "sdpa")):  # null: Hugging Face's default
        chosen = [] if value is None else [f"model.attn_implementation={value}"]
        with torch.device("meta"):
            module = build_model(compose([f"model={model}", *chosen]).model)
        assert module.config._attn_implementation == expected, (model, value)


def test_attn_implementation_reaches_a_saved_model(tmp_path_factory):
    from sharded_exp.models import build_model
    from tests.helpers.jobs import saved_tiny_hf

    saved = saved_tiny_hf(tmp_path_factory, "bert")
    cfg = compose(["model=hf_bert", f"model.pretrained={saved}", "model.attn_implementation=eager"]).model
    for weights in (True, False):  # the ranks' load, and the fake step's shapes-only build
        assert build_model(cfg, weights=weights).config._attn_implementation == "eager", weights


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=hf_bert", "model.attn_implementation=flash"],
         "model.attn_implementation='flash' is not one of null (Hugging Face's default), eager, sdpa"),
        (["model=hf_gpt2", "model.attn_implementation=EAGER"], "model.attn_implementation='EAGER' is not one of"),
        (["model=custom", "model._target_=tests.helpers.user_models.build", "model.attn_implementation=eager"],
         "model._target_=tests.helpers.user_models.build is no Hugging Face model class"),
    ],
)  # fmt: skip
def test_a_bad_attn_implementation_is_refused_before_any_rank_starts(overrides, message, tmp_path):
    import re

    from sharded_exp.errors import ConfigError
    from sharded_exp.launch.parent import launch

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=re.escape(message)):
        launch(compose(overrides), str(out))
    assert not out.exists()  # refused by the parent's checks: no directory, no rank


# -------------------------------- a 0-dim parameter, and BatchNorm's buffers under FSDP
@pytest.mark.parametrize(
    "strategy", [pytest.param(s, marks=[] if s == "fsdp" else pytest.mark.slow) for s in STRATEGY_NAMES if s != "ddp"]
)
def test_a_0_dim_parameter_trains_under_every_strategy_as_under_ddp(strategy, shared_runs):
    ref_dir, ref = shared_runs("strategy=ddp", *SCALAR)
    out, result = shared_runs(f"strategy={strategy}", *SCALAR)
    assert ref["status"] == "ok" and result["status"] == "ok", result["error"]
    final = torch.load(out / "model_final.pt", weights_only=True)
    assert final["temperature"].dim() == 0 and final["temperature"].item() != 1.0  # trained, still a scalar
    assert max_relative_diff(out, ref_dir) <= 1e-6
    assert result["memory"]["predicted_peak_mib_max"] is not None


BN = ["model=custom", "model._target_=tests.helpers.user_models.build_with_batchnorm", "trainer.steps=4",
      "trainer.save_final_state=true", "trainer.eval_batches=4"]  # fmt: skip


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("fsdp_grad_op", marks=pytest.mark.slow)])
def test_batchnorm_buffers_agree_across_ranks_and_with_ddp(strategy, shared_runs):
    ref_dir, ref = shared_runs("strategy=ddp", *BN)
    out, result = shared_runs(f"strategy={strategy}", *BN)
    assert result["status"] == "ok", result["error"]
    # Each rank's running statistics are DDP's: rank 0's, broadcast before every forward.
    for mine, ddp in zip(result["memory"]["per_rank"], ref["memory"]["per_rank"]):
        assert mine["buffer_digest"] == pytest.approx(ddp["buffer_digest"], rel=1e-6), (mine["rank"], ref["memory"])
    assert result["eval"]["final"]["eval/accuracy"] == ref["eval"]["final"]["eval/accuracy"]
    assert result["eval"]["final"]["eval/loss"] == pytest.approx(ref["eval"]["final"]["eval/loss"], rel=1e-5)
    assert max_relative_diff(out, ref_dir) <= 1e-6  # model_final.pt: parameters and buffers


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_grad_op"])
def test_batchnorm_trains_under_fsdp_at_bf16_like_ddp(strategy, shared_runs):
    """FSDP's half-precision policy cast BatchNorm's weight beside its fp32 statistics, and
    a CPU run failed ("expected scalar type BFloat16 but found Float"): BatchNorm is now a
    unit of its own in fp32, as autocast runs it under DDP."""
    args = [*BN, "precision=bf16", "trainer.world_size=3", "trainer.grad_accum=2", "trainer.freeze=[layers.0.*]"]
    _, ref = shared_runs("strategy=ddp", *args)
    _, result = shared_runs(f"strategy={strategy}", *args)
    assert ref["status"] == "ok" and result["status"] == "ok", result["error"]
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=2e-2)  # bf16 rounding
