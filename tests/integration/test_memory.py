"""Memory: measured per rank from the real tensors, against the analytic prediction."""

from __future__ import annotations

import pytest
import torch

from sharded_exp.compose import compose
from sharded_exp.models import build_model
from sharded_exp.optim import optimizer_spec
from sharded_exp.predict.memory_model import zero_paper_bytes_per_param
from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.residency import greedy_partition
from sharded_exp.strategies.sharded_ddp import resident_grad_numel
from tests.helpers.jobs import launch_job, tiny
from tests.helpers.runs import rank_errors

ADAM_FP32 = ["optimizer=adam", "precision=32", "trainer.steps=4"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    cache = {}

    def get(strategy: str, *extra: str):
        key = (strategy, *extra)
        if key not in cache:
            out = tmp_path_factory.mktemp(strategy)
            result = launch_job([f"strategy={strategy}", "model=gpt", *ADAM_FP32, *extra], out)
            assert result["status"] == "ok", result.get("error")
            cache[key] = result
        return cache[key]

    return get


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        "oss",
        "sharded_ddp",
        "sharded_ddp strategy.reduce_buffer_size=2000",
        "zero1",
        "fsdp",
        "fsdp_grad_op",
        "fsdp trainer.world_size=3",  # dims not divisible by 3: padded shards
    ],
)
def test_model_states_match_prediction_within_2_percent(strategy, measured):
    result = measured(*strategy.split())
    mem = result["memory"]
    assert mem["source"] == "torch_mem_tracker"
    assert len(mem["per_rank"]) == result["world_size"]
    for entry in mem["per_rank"]:
        measured_total = sum(entry["model_states_mib"].values())
        predicted_total = sum(entry["predicted_model_states_mib"].values())
        assert abs(predicted_total - measured_total) <= 0.02 * measured_total, entry
        for part in ("params", "grads", "optimizer"):
            assert entry["predicted_model_states_mib"][part] == pytest.approx(entry["model_states_mib"][part], rel=0.02)
        # the peak counts everything live, model states included
        assert entry["peak_allocated_mib"] > measured_total
        # at the peak FSDP also holds gathered (unsharded) parameters, the others exactly theirs
        assert entry["peak_breakdown_mib"]["Parameter"] >= entry["model_states_mib"]["params"] * (1 - 1e-9)
    assert mem["model_states_rel_error_max"] <= 0.02
    # gathered parameters at the peak (FSDP's units; none for the others), as predicted;
    # 5%: the all-gather pads dims that world_size does not divide, which is not modelled
    assert mem["transient_params_mib_max"] == pytest.approx(mem["predicted_transient_params_mib"], rel=0.05, abs=1e-6)


def test_oss_optimizer_state_is_about_one_nth_of_ddp(measured):
    ddp = measured("ddp")["memory"]["per_rank"]
    oss = measured("oss")["memory"]["per_rank"]
    full = ddp[0]["model_states_mib"]["optimizer"]
    shards = [r["model_states_mib"]["optimizer"] for r in oss]
    assert sum(shards) == pytest.approx(full, rel=1e-6)  # nothing lost, nothing duplicated
    for shard in shards:
        assert shard == pytest.approx(full / 2, rel=0.10)  # greedy by size: close to 1/N


@pytest.mark.parametrize("strategy", ["oss", "zero1"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_real_partition_is_the_predicted_one(strategy, model, tmp_path):
    """The library's own partition, read on each rank, equals the strategy's predicted one."""
    result = launch_job([f"model={model}", f"strategy={strategy}", "trainer.world_size=3", "trainer.steps=3"], tmp_path)
    cfg = compose(tiny([f"model={model}"]))
    with torch.device("meta"):
        module = build_model(cfg.model)
    groups = [[p.numel() for p in g["params"]] for g in optimizer_spec(cfg.optimizer, module).param_groups]
    numels = [n for g in groups for n in g]
    owners = STRATEGIES.builder(strategy).memory.partition(groups, 3)
    predicted = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(3)]
    assert [e["optimizer_shard_numel"] for e in result["memory"]["per_rank"]] == predicted


def test_sharded_ddp_keeps_full_gradients_in_its_buckets(measured):
    """fairscale's default 2**23-element buckets hold every gradient on every rank."""
    default = measured("sharded_ddp")["memory"]["per_rank"]
    small = measured("sharded_ddp", "strategy.reduce_buffer_size=2000")["memory"]["per_rank"]
    ddp = measured("ddp")["memory"]["per_rank"]
    assert default[0]["model_states_mib"]["grads"] == pytest.approx(ddp[0]["model_states_mib"]["grads"])
    assert small[0]["model_states_mib"]["grads"] < 0.6 * ddp[0]["model_states_mib"]["grads"]


def test_greedy_partition_and_bucket_rule():
    assert greedy_partition([[10, 1, 1], [5]], 2) == [0, 1, 1, 1]
    # no buckets: each rank keeps only the gradients it owns
    assert resident_grad_numel(0, [10, 1, 1, 5], [0, 1, 1, 1], rank=0, world_size=2) == 10
    # buckets big enough for everything: every rank keeps every gradient
    assert resident_grad_numel(2**23, [10, 1, 1, 5], [0, 1, 1, 1], rank=0, world_size=2) == 17


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam."""
    psi, n = 7.5e9, 64
    gb = [zero_paper_bytes_per_param(stage, n) * psi / 1e9 for stage in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_prediction_is_on_disk_before_any_rank_starts(tmp_path, monkeypatch, measured):
    """The parent predicts once and writes it (status "running") before it starts the ranks;
    the run's final figures carry the same prediction."""
    import json

    from sharded_exp.launch import parent

    final = measured("fsdp")["memory"]  # the same job, run for real (before the ranks are faked below)
    seen = {}

    def instead_of_the_ranks(job, layout, release=None):
        seen.update(json.loads((tmp_path / "result.json").read_text()))
        raise RuntimeError("no ranks in this test")

    monkeypatch.setattr(parent, "run_ranks", instead_of_the_ranks)
    result = parent.launch(compose(tiny(["strategy=fsdp", "model=gpt", *ADAM_FP32])), str(tmp_path))
    assert result.status == "failed" and "no ranks in this test" in result.error
    assert seen["status"] == "running"
    assert seen["memory"]["predicted_model_states_mib_max"] == final["predicted_model_states_mib_max"]
    assert seen["memory"]["predicted_transient_params_mib"] == final["predicted_transient_params_mib"]
    assert [e["predicted_model_states_mib"] for e in seen["memory"]["per_rank"]] == [
        e["predicted_model_states_mib"] for e in final["per_rank"]
    ]


# ------------------------------------------------- what trainer.memory_limit_mib bounds
def test_the_memory_limit_says_what_it_bounds_and_caps_cuda_before_the_build(tmp_path, monkeypatch, capsys):
    from sharded_exp.measure.tracker import MemoryMeter
    from sharded_exp.models import build_model

    result = launch_job(["trainer.memory_limit_mib=1000", "trainer.steps=2"], tmp_path / "cpu")
    assert result["memory"]["memory_limit_applies_to"].startswith("live tensors the CPU memory tracker counts")
    free = launch_job(["trainer.steps=2"], tmp_path / "none")
    assert free["memory"]["memory_limit_applies_to"] is None
    # A budget between the model states and the step's peak: crossed inside a step.
    mem = free["memory"]
    limit = (mem["model_states_mib_max"] + mem["peak_allocated_mib_max"]) / 2
    capsys.readouterr()
    oom = launch_job(
        [f"trainer.memory_limit_mib={limit}", "trainer.steps=2"], tmp_path / "oom"
    )  # over it: said there too
    assert oom["status"] == "oom" and oom["memory"]["memory_limit_applies_to"].startswith("live tensors")
    # What was live when the budget was first exceeded, on the rank that failed first.
    b = oom["memory"]["oom_breakdown"]
    assert b is not None and oom["memory"]["oom_breakdown_error"] is None, oom["memory"]
    assert b["step"] in (0, 1) and b["phase"] in ("forward", "backward", "optimizer", "other")
    assert limit < b["tracked_mib"] <= mem["peak_allocated_mib_max"] + 1e-9
    assert sum(b["by_category_mib"].values()) == pytest.approx(b["tracked_mib"])
    # Every live byte is filed under one module (or none): the attribution adds up.
    filed = sum(b["top_modules_mib"].values()) + b["other_modules_mib"] + b["outside_modules_mib"]
    assert filed == pytest.approx(b["tracked_mib"])
    states = free["memory"]["per_rank"][b["rank"]]["model_states_mib"]
    assert b["by_category_mib"]["Parameter"] == pytest.approx(states["params"])  # the same model, measured apart
    names = {n for n, _ in build_model(compose(tiny([])).model).named_modules()}
    assert b["top_modules_mib"] and set(b["top_modules_mib"]) <= names, b["top_modules_mib"]
    assert b["rank"] in {f["rank"] for f in rank_errors(tmp_path / "oom") if f["memory_at_oom"]}
    printed = capsys.readouterr().out
    assert f"out of memory on rank {b['rank']} at step {b['step']} ({b['phase']})" in printed
    assert next(iter(b["top_modules_mib"])) in printed
    # ... and the report's row for the point says it in one cell.
    from sharded_exp.report.rows import point_row

    cell = point_row(oom)["oom_breakdown"]
    assert cell.startswith(f"rank {b['rank']} step {b['step']} ({b['phase']}): {b['tracked_mib']:.2f} MiB over {limit}")
    assert next(iter(b["top_modules_mib"])) in cell and "Parameter" in cell
    # On CUDA the cap is set when the meter is made, before the model and optimizer are built.
    capped = []
    props = type("Props", (), {"total_memory": 80 * 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    meter = MemoryMeter(torch.device("cuda", 0), 8 * 1024)
    assert capped == [(0.1, torch.device("cuda", 0))] and meter.LIMIT_APPLIES_TO["cuda"].startswith("reserved bytes")


def test_the_end_of_a_run_digests_without_a_copy_of_any_tensor():
    """The parameter digest sums in float64 where the tensors are, with no copy: a point that
    fitted its budget in training does not run out at the end (a float64 copy of the largest
    tensor did: fsdp at 1 rank in 3.3 MiB). The sum is bit for bit the one over a copy, the
    sum of squares within 1e-9."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from sharded_exp.train.trainer import _sums

    tensors = [torch.randn(1_000_000), torch.randn(300, dtype=torch.bfloat16), torch.arange(5)]
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker:
        total, sq = _sums(tensors)
    held = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**20
    assert peak - held < 0.01  # MiB beyond the tensors themselves: none to speak of
    copies = [t.to(torch.float64) for t in tensors]
    assert total == sum(c.sum().item() for c in copies)
    assert sq == pytest.approx(sum(c.pow(2).sum().item() for c in copies), rel=1e-9)
