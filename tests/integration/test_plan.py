"""The planner: the same config tree and the same fake step as every run's prediction."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.helpers.jobs import ROOT, TINY_CONFIGS, launch_job, write_tiny_config
from tests.helpers.runs import plan_json

GIB, MIB = 2**30, 2**20
TWO_STEPS = ["trainer.steps=3", "trainer.warmup_steps=2", "trainer.eval_batches=0"]


def test_raw_count_is_an_ideally_divisible_model():
    """7.5e9 parameters, 64 ranks, precision 16, Adam: torch AMP keeps fp32 parameters and
    gradients (4 + 4 bytes) and Adam's two fp32 moments (8 bytes), sharded or not."""
    plan = plan_json("plan.params=7.5e9", "plan.world_sizes=[64]", "precision=16", "optimizer=adam")
    rows = {r["strategy"]: r for r in plan["rows"]}
    gb = lambda r, *parts: sum(r[f"{p}_gib"] for p in parts) * GIB / 1e9  # noqa: E731
    states = ("params", "grads", "optimizer")
    assert all(r["method"].startswith("raw parameter count") and r["activations_gib"] is None for r in rows.values())
    assert gb(rows["ddp"], *states) == pytest.approx(120.0, rel=1e-3)
    for zero1 in ("oss", "zero1"):  # 8 + 8/64 bytes per parameter
        assert gb(rows[zero1], *states) == pytest.approx(60.94, rel=1e-3)
    # DDP's all-reduce buckets: one more fp32 place per parameter, beside the gradients
    assert gb(rows["ddp"], "buckets") == pytest.approx(30.0, rel=1e-3)
    # ShardedDDP: 4 + 12/64 bytes, plus reduce buckets kept for every destination rank
    # (which hold the bucketed gradients: filed as buckets, not twice)
    buckets = gb(rows["sharded_ddp"], *states, "buckets") - 31.41
    assert 0 < buckets <= 64 * 2**23 * 4 / 1e9
    assert gb(rows["sharded_ddp"], "buckets") > 0
    assert gb(rows["fsdp"], *states) == pytest.approx(1.875, rel=1e-3)
    # gathered at the peak: one of 32 units (ZeRO-3), or every parameter (ZeRO-2), in fp16
    assert gb(rows["fsdp"], "gathered") == pytest.approx(7.5e9 / 32 * 2 / 1e9, rel=1e-3)
    assert gb(rows["fsdp_grad_op"], "gathered") == pytest.approx(7.5e9 * 2 / 1e9, rel=1e-3)
    assert rows["ddp"]["total_gib"] > rows["oss"]["total_gib"] > rows["sharded_ddp"]["total_gib"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "sharded_ddp", "fsdp"])
def test_plan_is_the_runs_prediction(strategy, tmp_path):
    model = ["model=gpt", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "model.vocab_size=64"]
    result = launch_job([f"strategy={strategy}", *model], tmp_path)
    plan = plan_json(*model, "trainer.batch_size=8", "plan.world_sizes=[2]", f"plan.strategies=[{strategy}]",
                     "plan.device=cpu")  # a CPU run: its kernels  # fmt: skip
    (row,) = plan["rows"]
    mem = result["memory"]
    assert row["total_gib"] * GIB / MIB == pytest.approx(mem["predicted_peak_mib_max"], rel=1e-4)
    assert row["model_states_gib"] * GIB / MIB == pytest.approx(mem["predicted_model_states_mib_max"], rel=1e-9)


@pytest.mark.slow  # plan.find stays in the default tier: test_find_brackets_the_answer_in_a_few_fake_steps
def test_largest_batch_that_fits_is_checked_by_real_runs(tmp_path):
    """plan.find=batch_size under a budget; a real run at that batch stays within it, one
    sample more goes over (the CPU tracker enforces trainer.memory_limit_mib)."""
    model = ["model=gpt", "model.d_model=32", "model.n_heads=2", "model.seq_len=32", "model.vocab_size=256"]
    budget_mib = 24
    plan = plan_json(
        *model, "plan.world_sizes=[2]", "plan.strategies=[fsdp]", "plan.find=batch_size",
        f"plan.device_memory_gib={budget_mib / 1024}", "plan.device=cpu",
    )  # fmt: skip
    (found,) = plan["found"]
    batch = found["value"]
    assert batch >= 2, found
    runs = {}
    for b in (batch, batch + 1):
        runs[b] = launch_job(
            [*model, "strategy=fsdp", f"trainer.batch_size={b}", f"trainer.memory_limit_mib={budget_mib}",
             *TWO_STEPS], tmp_path / str(b),
        )  # fmt: skip
    assert runs[batch]["status"] == "ok", runs[batch].get("error")
    assert runs[batch + 1]["status"] == "oom", runs[batch + 1].get("error")


@pytest.mark.slow
def test_a_7b_plan_point_is_fast_and_allocates_nothing():
    code = (
        "import resource, sys, time; t = time.perf_counter(); from sharded_exp.plan.command import main; "
        "main(['model=gpt_7b', 'trainer.batch_size=1', 'plan.format=json', 'plan.world_sizes=[8]', "
        "'plan.strategies=[ddp,fsdp]']); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seconds, max_rss_kib = proc.stderr.strip().splitlines()[-1].split()
    plan = json.loads(proc.stdout)
    assert plan["params"] > 6.5e9
    # A guard against a hang or a real allocation, not the speed target (benchmarks/ and
    # the closing note time it): two fake steps of a 7B model per point.
    assert int(max_rss_kib) < 2 * 1024 * 1024  # peak RSS under 2 GiB: nothing was allocated
    rows = {r["strategy"]: r for r in plan["rows"]}
    assert rows["ddp"]["method"].startswith("composed by depth") and rows["fsdp"]["method"].startswith("composed")
    assert not rows["ddp"]["fits"] and rows["fsdp"]["fits"]
    # FSDP holds an eighth of the 16 bytes per parameter of model states
    assert math.isclose(rows["fsdp"]["model_states_gib"] * 8, rows["ddp"]["model_states_gib"], rel_tol=0.01)


# ---------------------------------------------------- a planner that answers fast
@pytest.mark.slow  # the rule in the default tier: tests/unit/plan/test_points.py (exact to 1024 ranks, then drawn)
def test_a_raw_plan_at_a_million_ranks_is_drawn_from_exact_plans():
    from sharded_exp.compose import compose
    from sharded_exp.plan import points as plan

    cfg = compose(["plan.params=1e9"], config_name="plan")
    rows = plan.plan_rows(cfg, [8192, 1_000_000])
    assert all("from the exact plans at 256, 512 and 1024 ranks" in r["note"] for r in rows)
    exact_up_to, plan.EXACT_UP_TO = plan.EXACT_UP_TO, 10**9
    try:
        exact = {(r["strategy"], r["world_size"]): r["total_gib"] for r in plan.plan_rows(cfg, [8192])}
    finally:
        plan.EXACT_UP_TO = exact_up_to
    for row in (r for r in rows if r["world_size"] == 8192):
        assert row["total_gib"] == pytest.approx(exact[(row["strategy"], 8192)], rel=1e-3)


@pytest.mark.slow  # the default tier's case: test_plan_compose.py's ddp (the same rule, drawn and reused)
@pytest.mark.parametrize("model", [
    ["model=gpt", "model.n_layers=8", "model.d_model=64", "model.n_heads=2", "model.seq_len=32"],
    pytest.param(["model=hf_llama", "model.config.num_hidden_layers=7", "model.seq_len=16"], marks=pytest.mark.slow),
], ids=["gpt", "hf_llama"])  # fmt: skip
def test_a_deep_model_drawn_from_three_depths_equals_the_whole_model_faked(model):
    from sharded_exp.compose import compose
    from sharded_exp.plan import points as plan

    cfg = compose([*model, "trainer.batch_size=2"], config_name="plan")
    shapes = plan.model_shapes(cfg.model, cfg.optimizer)
    for name in ("ddp", "zero1", "fsdp", "sharded_ddp"):
        drawn = plan.model_row(cfg, name, 4, shapes, "cpu")
        cfg.plan.by_depth = False
        whole = plan.model_row(cfg, name, 4, shapes, "cpu")
        cfg.plan.by_depth = True
        assert drawn["total_gib"] == pytest.approx(whole["total_gib"], rel=1e-6), name
        assert drawn["mean_gib"] == pytest.approx(whole["mean_gib"], rel=1e-6), name  # every rank drawn too
        if name in ("ddp", "fsdp"):  # composed (ZeRO-1 and ShardedDDP where their lines hold: else whole)
            assert drawn["method"].startswith("composed by depth"), drawn


@pytest.mark.slow  # the default tier's: unit/plan/test_points.py (a freeze is faked whole); frozen parameters'
# predicted states (no gradient, no optimizer state): test_matrix.py's frozen rows
def test_a_deep_model_with_a_later_block_frozen_is_planned_whole():
    """Freezing blocks the shallow fakes of a composition have not got (blocks_.5.*) plans the
    model faked whole, with the frozen block holding no gradient, not a traceback."""
    rows = plan_json("model=gpt", "model.n_layers=6", "model.d_model=32", "model.n_heads=2", "model.seq_len=8",
                     "model.vocab_size=64", "trainer.freeze=[blocks_.5.*]", "plan.strategies=[ddp]",
                     "plan.world_sizes=[2]", "plan.device=cpu")["rows"]  # fmt: skip
    free = plan_json("model=gpt", "model.n_layers=6", "model.d_model=32", "model.n_heads=2", "model.seq_len=8",
                     "model.vocab_size=64", "plan.strategies=[ddp]", "plan.world_sizes=[2]", "plan.device=cpu")["rows"]  # fmt: skip
    assert not rows[0]["method"].startswith("composed") and free[0]["method"].startswith("composed")
    assert rows[0]["total_gib"] is not None
    assert rows[0]["model_states_gib"] < free[0]["model_states_gib"]  # no gradient or Adam state for the frozen block


def test_find_brackets_the_answer_in_a_few_fake_steps():
    from sharded_exp.compose import compose
    from sharded_exp.plan import points as plan

    cfg = compose(["model=hf_llama", "plan.device_memory_gib=0.1"], config_name="plan")
    found = plan.largest(cfg, "ddp", 2, "trainer.batch_size", "cpu")
    value, probes = found["value"], found["probes"]
    assert probes[value] <= 0.1 < probes[value + 1]  # the answer fits, one more does not
    assert len(probes) <= 5, probes  # was one fake step per value from the line's guess down


def test_a_plan_for_a_gpu_holds_what_cudas_kernels_hold():
    """With attention dropout the CPU runs the math path (B x H x T x T scores and a mask);
    CUDA's fused attention holds the output and a float32 log-sum-exp. The default plan is
    for a GPU (plan.device=cuda), on this CPU-only machine, and says which device it faked;
    its peak adds cuBLAS's workspace by rule and the optimizer step uses foreach."""
    model = ["model=hf_gpt2", "precision=bf16", "trainer.batch_size=2", "model.seq_len=256",
             "model.config.n_positions=256", "model.config.attn_pdrop=0.1", "plan.world_sizes=[1]",
             "plan.strategies=[ddp]"]  # fmt: skip
    cuda, cpu = plan_json(*model), plan_json(*model, "plan.device=cpu")
    assert cuda["device"] == "cuda" and "kernels CUDA chooses" in cuda["device_faked"]
    assert cpu["device"] == "cpu" and cpu["device_faked"].startswith("cpu")
    (on_gpu,), (on_cpu,) = cuda["rows"], cpu["rows"]
    layers, heads, seq, batch = 2, 4, 256, 2
    scores_mib = layers * batch * heads * seq * seq * 2 / MIB  # the bf16 probabilities alone
    saved = (on_cpu["activations_gib"] - on_gpu["activations_gib"]) * GIB / MIB
    assert saved >= scores_mib, (saved, scores_mib)
    assert on_gpu["workspace_gib"] * GIB / MIB == 32.0 and on_cpu["workspace_gib"] == 0.0
    assert on_gpu["total_gib"] - on_gpu["workspace_gib"] < on_cpu["total_gib"]


def test_the_plan_draws_its_table(tmp_path, capsys):
    """plan.plot: a line per strategy through its planned peaks, the device memory as a
    line, the points that fit filled; a file it cannot draw into is refused first."""
    from sharded_exp.output import charts
    from sharded_exp.plan import command

    path = tmp_path / "charts" / "plan.png"
    args = ["plan.params=7.5e9", "plan.world_sizes=[8,64]", "plan.format=json", "plan.device_memory_gib=40"]
    assert command.main([*args, f"plan.plot={path}"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert path.stat().st_size > 0
    ax = charts.plan_chart(rows, 40, "plan").axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    for name in {r["strategy"] for r in rows}:
        planned = [r["total_gib"] for r in sorted(rows, key=lambda r: r["world_size"]) if r["strategy"] == name]
        assert list(lines[name].get_ydata()) == planned, name
    assert any(list(line.get_ydata()) == [40, 40] for line in ax.get_lines())  # the device's memory
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8 ranks", "64 ranks"]
    fitting = sum(len(line.get_xdata()) for line in ax.get_lines() if line.get_linestyle() == "None")
    assert fitting == sum(r["fits"] for r in rows)
    assert command.main(["plan.world_sizes=[2]", f"plan.plot={tmp_path / 'plan.txt'}"]) == 2
    assert "plan.plot=" in capsys.readouterr().err and not (tmp_path / "plan.txt").exists()


@pytest.mark.slow  # the mean over ranks in the default tier: unit/plan/test_points.py (a row's mean),
# unit/predict/test_prediction.py (every rank's peak), unit/plan/test_table.py (its column)
def test_a_plan_row_shows_the_average_over_ranks_beside_the_peak(capsys):
    """ZeRO-1 cannot split one tensor: the rank that owns a large embedding's optimizer state
    peaks above the others, and the average over ranks (the seed study's figure) is below
    the peak; under DDP every rank is alike."""
    from sharded_exp.plan import command

    model = ["model=gpt", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=16",
             "model.vocab_size=4096", "trainer.batch_size=2", "plan.world_sizes=[4]", "plan.strategies=[ddp,zero1]",
             "plan.device=cpu"]  # fmt: skip
    assert command.main(["plan.format=json", *model]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["ddp"]["mean_gib"] == pytest.approx(rows["ddp"]["total_gib"], rel=1e-9)
    assert rows["zero1"]["mean_gib"] < 0.9 * rows["zero1"]["total_gib"]
    assert command.main([*model, "plan.format=csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    zero1 = next(r for r in table if r["strategy"] == "zero1")
    assert float(zero1["mean"]) == pytest.approx(rows["zero1"]["mean_gib"], rel=1e-5)  # GiB
    assert float(zero1["peak"]) == pytest.approx(rows["zero1"]["total_gib"], rel=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_a_causal_lm_is_planned_from_its_config_file_alone(kind, tmp_path):
    """``model=hf_causal model.config_file=PATH`` and nothing else about the model: the plan is
    of the file's architecture, as many parameters as its own class builds from it."""
    import transformers

    model_class, config_class, sizes = TINY_CONFIGS[kind]
    path = write_tiny_config(tmp_path, kind)
    out = plan_json("model=hf_causal", f"model.config_file={path}", "plan.world_sizes=[2]", "plan.strategies=[ddp]",
                    "trainer.batch_size=2")  # fmt: skip
    with torch.device("meta"):
        direct = getattr(transformers, model_class)(getattr(transformers, config_class)(**sizes))
    assert out["params"] == sum(p.numel() for p in direct.parameters())
    assert out["rows"] and all(r["total_gib"] > 0 for r in out["rows"])


@pytest.mark.slow  # the pool path runs in the default tier's covering plan (gpt2_large, plan.workers=2)
def test_a_plan_faked_side_by_side_gives_the_rows_one_process_gives():
    """With ``plan.workers=2`` each strategy's rows and its speed columns are two tasks in two
    processes, merged in this one: every row, its columns in the same order and the speed
    columns among them, is the one a single process makes (the seconds each fake took aside).
    Six blocks are composed by depth under both strategies; at 4 ranks DDP takes the
    allocator's drawing made at 2 (its rank holds the same tensors at every world size)."""
    from sharded_exp.compose import compose
    from sharded_exp.plan import points as plan

    args = ["model=gpt", "model.n_layers=6", "model.d_model=64", "model.n_heads=2", "model.seq_len=16",
            "plan.strategies=[ddp,fsdp]", "plan.world_sizes=[2,4]", "plan.device=cuda"]  # fmt: skip
    rows = {}
    for count in (1, 2):
        cfg = compose([*args, f"plan.workers={count}"], config_name="plan")
        rows[count] = [{k: v for k, v in r.items() if k != "seconds"} for r in plan.plan_rows(cfg, [2, 4], "cuda")]
    assert rows[2] == rows[1]
    assert [list(r) for r in rows[2]] == [list(r) for r in rows[1]]
    assert all(r["step_time_s"] and r["reserved_gib"] and r["method"].startswith("composed") for r in rows[2]), rows[2]
    ddp_at_4 = next(r for r in rows[2] if r["strategy"] == "ddp" and r["world_size"] == 4)
    assert "(as at 2 ranks: the same tensors at every world size)" in ddp_at_4["note"], ddp_at_4["note"]
