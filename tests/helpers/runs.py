"""What a run promises, and ways of running one shared by several test modules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers.jobs import ROOT, run_cli


def cli(args, tmp_path, env=None, timeout=240):
    """``python -m sharded_exp ARGS`` with its run directory at ``tmp_path``."""
    return run_cli([*args, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, timeout=timeout)


def rank_errors(out) -> list[dict]:
    """The ranks' error records of a run directory."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*_error.json"))]


def check_run(result: dict, overrides: list[str]) -> None:
    """What every training run promises, asserted."""
    assert result["status"] == "ok", result.get("error")
    history = [h["loss"] for h in result["history"]]
    assert all(math.isfinite(v) for v in history) and math.isfinite(result["final_loss"])
    assert history[-1] < history[0], history
    mem = result["memory"]
    assert mem["source"] == "torch_mem_tracker" and mem["peak_error"] is None
    assert len(mem["per_rank"]) == result["world_size"]
    for entry in mem["per_rank"]:
        for part in ("params", "grads", "optimizer"):
            assert entry["predicted_model_states_mib"][part] == pytest.approx(
                entry["model_states_mib"][part], rel=0.02, abs=1e-6
            ), (part, entry)
        assert entry["peak_allocated_mib"] > 0
        # The fake step (made in the parent before any rank started) against the measured peak.
        assert abs(entry["peak_rel_error"]) <= 0.10, entry
    assert mem["peak_prediction"]["error"] is None


def step0_reference(result: dict) -> float:
    """The saved model's loss on the batches of step 0 (every rank's, averaged as the
    trainer's logged loss is), computed in this process from the run's resolved config."""
    from omegaconf import OmegaConf

    from sharded_exp.data import build_task
    from sharded_exp.models import build_model

    cfg = OmegaConf.create(result["config"])
    model = build_model(cfg.model, weights=True).eval()
    task = build_task(cfg.data, cfg.model, cfg.trainer.batch_size)
    with torch.no_grad():
        losses = [task.loss_of(model(**task(0, 0, rank))).item() for rank in range(cfg.trainer.world_size)]
    return sum(losses) / len(losses)


def check_starts_from_saved(result: dict) -> None:
    """A run from ``model.pretrained``: its step-0 loss is the saved model's, not random weights'."""
    assert result["status"] == "ok", result.get("error")
    first = result["history"][0]
    assert first["step"] == 1, first
    reference = step0_reference(result)
    assert first["loss"] == pytest.approx(reference, rel=1e-5, abs=1e-6), (first["loss"], reference)
    # and not what random weights give: the saved ones were loaded
    assert not math.isclose(first["loss"], result_of_random(result), rel_tol=1e-3)


def result_of_random(result: dict) -> float:
    """Step 0's loss of the same architecture with the seed's random weights instead."""
    from omegaconf import OmegaConf

    from sharded_exp.data import build_task
    from sharded_exp.models import build_model

    cfg = OmegaConf.create(result["config"])
    torch.manual_seed(cfg.trainer.seed + 1)
    model = build_model(cfg.model, weights=False).eval()
    task = build_task(cfg.data, cfg.model, cfg.trainer.batch_size)
    with torch.no_grad():
        return task.loss_of(model(**task(0, 0, 0))).item()


def plan_json(*overrides: str) -> dict:
    """The planner's JSON, run in this process (its command line is tested in test_plan_cli): the same ``main`` a shell runs, without a second torch start-up."""
    import contextlib
    import io

    from sharded_exp.plan import command

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = command.main(["plan.format=json", *overrides])
    assert code == 0, out.getvalue()[-2000:]
    return json.loads(out.getvalue())
