"""probe/__init__.py's pure parts: the strategy read from the wrappers, the precision and the
launcher, the step counting that opens and closes the memory window, the step times taken
from the marks, and a rank's figures (the prediction's relative error)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded_exp.probe import Probe, _launcher, _precision, detect_strategy


def _named(name: str, base: type = nn.Module, module: str = __name__, **attrs):
    """A class called ``name``, said to be defined in ``module`` (a wrapper's stand-in)."""
    return type(name, (base,), {"__module__": module, **attrs})


FAIRSCALE_DDP, FAIRSCALE_OSS = "fairscale.nn.data_parallel.sharded_ddp", "fairscale.optim.oss"
ZERO = "torch.distributed.optim.zero_redundancy_optimizer"


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_plain_model_without_a_group_is_single():
    model = nn.Linear(2, 2)
    name, found = detect_strategy(model, _sgd(model))
    assert name == "single" and found == {"model_wrapper": "Linear", "optimizer": "SGD"}


@pytest.mark.parametrize("model_cls, optimizer_cls, expected", [
    (("ShardedDataParallel", FAIRSCALE_DDP), ("OSS", FAIRSCALE_OSS), "sharded_ddp"),
    (("Sequential", "torch.nn"), ("OSS", FAIRSCALE_OSS), "oss"),
    (("Sequential", "torch.nn"), ("ZeroRedundancyOptimizer", ZERO), "zero1"),
    (("Sequential", "torch.nn"), ("OSS", "my_project.optim"), "single"),  # another package's OSS
])  # fmt: skip
def test_fairscale_and_zero_wrappers_are_named_by_their_class(model_cls, optimizer_cls, expected):
    model = _named(model_cls[0], module=model_cls[1])()
    model.inner = nn.Linear(2, 2)
    optimizer = _named(optimizer_cls[0], torch.optim.SGD, optimizer_cls[1])(model.parameters(), lr=0.1)
    assert detect_strategy(model, optimizer)[0] == expected


def test_an_optimizer_wrapper_is_looked_through():
    model = nn.Linear(2, 2)
    wrapper = type("AcceleratedOptimizer", (), {})()
    wrapper.optimizer = _named("ZeroRedundancyOptimizer", torch.optim.SGD, ZERO)(model.parameters(), lr=0.1)
    assert detect_strategy(model, wrapper) == ("zero1", {"model_wrapper": "Linear",
                                                         "optimizer": "ZeroRedundancyOptimizer"})  # fmt: skip


@pytest.mark.parametrize("how, expected", [
    ("ShardingStrategy.FULL_SHARD", "fsdp"), ("ShardingStrategy.SHARD_GRAD_OP", "fsdp_grad_op"),
    ("ShardingStrategy.NO_SHARD", "ddp"), ("ShardingStrategy._HYBRID_SHARD_ZERO2", "fsdp_grad_op"),
    ("ShardingStrategy.HYBRID_SHARD", "fsdp"),
])  # fmt: skip
def test_fsdp1s_sharding_strategy_says_its_zero_stage(how, expected):
    inner = _named("FullyShardedDataParallel", module="torch.distributed.fsdp.fully_sharded_data_parallel")()
    inner.sharding_strategy = how
    inner.fc = nn.Linear(2, 2)
    model = nn.Sequential(inner)
    name, found = detect_strategy(model, _sgd(model))
    assert name == expected and found["sharding_strategy"] == how.rsplit(".", 1)[-1]


def test_fsdp2s_generated_classes_are_fsdp():
    from torch.distributed.fsdp import FSDPModule

    layer = nn.Linear(2, 2)
    layer.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})  # as fully_shard makes it
    model = nn.Sequential(layer)
    assert detect_strategy(model, _sgd(model))[0] == "fsdp"


def test_ddp_is_found_with_its_bucket_view_setting(gloo_group):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(nn.Linear(2, 2), gradient_as_bucket_view=True)
    name, found = detect_strategy(model, _sgd(model))
    assert name == "ddp" and found["gradient_as_bucket_view"] is True


def test_an_unwrapped_model_among_several_ranks_is_unknown():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = nn.Linear(2, 2)
        assert detect_strategy(model, _sgd(model))[0] == "unknown"
    finally:
        dist.destroy_process_group()


def test_the_precision_is_the_parameters_dtype():
    assert _precision(nn.Linear(1, 1)) == "32"
    assert _precision(nn.Linear(1, 1).bfloat16()) == "bf16" and _precision(nn.Linear(1, 1).half()) == "16"
    assert _precision(nn.Linear(1, 1).double()) == "torch.float64" and _precision(nn.GELU()) == "32"


@pytest.mark.parametrize("env, expected", [
    ({}, "user"), ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun"), ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "slurm"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "user"), ({"SLURM_PROCID": "0"}, "user"),
])  # fmt: skip
def test_the_launcher_is_read_from_the_environment(monkeypatch, env, expected):
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _launcher() == expected


# ------------------------------------------------------------------ the probe's counting
class Meter:
    """Stands for MemoryMeter: records when the window opens and closes."""

    source = "stub"
    failure = None

    def __init__(self):
        self.tracking, self.calls = False, []

    def start(self, *external):
        self.tracking = True
        self.calls.append("start")

    def stop(self):
        self.tracking = False
        self.calls.append("stop")
        return {"peak_allocated_mib": 10.0}


def _probe(**kw):
    model = nn.Linear(2, 2)
    p = Probe(model, _sgd(model), "unused", **kw)
    p.meter = Meter()
    return p


@pytest.mark.parametrize("warmup, track", [(0, 2), (2, 0)])
def test_a_probe_needs_a_warmup_and_a_tracked_step(warmup, track):
    with pytest.raises(ValueError, match="must be >= 1"):
        _probe(warmup_steps=warmup, track_steps=track)


def test_the_memory_window_opens_after_the_warmup_and_timing_starts_when_it_closes():
    p = _probe(warmup_steps=2, track_steps=3)
    calls_after = []
    for _ in range(7):
        p.step(torch.tensor(1.0, requires_grad=True) * 2)
        calls_after.append(list(p.meter.calls))
    assert calls_after[0] == [] and calls_after[1] == ["start"] and calls_after[3] == ["start"]
    assert calls_after[4] == ["start", "stop"] and calls_after[6] == ["start", "stop"]
    assert p._timed_from == 5 and p.steps == 7 and len(p.losses) == 1 and not p.losses[0].requires_grad


def test_step_times_are_the_gaps_from_the_mark_before_the_first_timed_step():
    p = _probe()
    p._step_marks = [0.0, 1.0, 3.0, 6.0, 10.0]
    p._timed_from = 2  # steps 3, 4 and 5 are timed: from the 2nd mark on
    assert p._step_times() == [2.0, 3.0, 4.0]
    p._timed_from = 5
    assert p._step_times() == []
    p._timed_from = None
    assert p._step_times() == []


def test_a_ranks_figures_carry_the_predictions_relative_error_and_no_build_figures():
    p = _probe()
    p._memory = {"peak_allocated_mib": 10.0, "build_peak_mib": 3.0}
    p.prediction = {"peak_mib": 11.0}
    figures = p._rank_figures()
    assert figures["peak_rel_error"] == pytest.approx(0.1) and "build_peak_mib" not in figures
    assert figures["buckets_added_mib"] == 0.0  # not under DDP
    assert figures["model_states_mib"]["params"] == 6 * 4 / 2**20
    p._memory, p.prediction = {"peak_allocated_mib": 10.0}, {"peak_mib": None}
    assert p._rank_figures()["peak_rel_error"] is None


def test_a_probe_that_saw_too_few_steps_has_no_peak_and_says_why():
    p = _probe(warmup_steps=3, track_steps=2)
    p.step()
    figures = p._rank_figures()
    assert figures["peak_allocated_mib"] is None
    assert "saw 1 step(s)" in figures["peak_error"] and "warmup_steps=3 + track_steps=2" in figures["peak_error"]


def test_without_an_example_there_is_no_prediction_and_the_reason_is_given():
    p = _probe()
    assert p.prediction == {"peak_mib": None, "error": "no example batch was given (example=)"}
    assert p.strategy == "single" and p.precision == "32" and p.ddp == (False, False)


def _train(model, optimizer, p, steps: int, calls_per_step: int = 1, fail_at: int | None = None):
    for i in range(steps):
        if i == fail_at:
            raise RuntimeError(f"boom at step {i}")
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for _ in range(calls_per_step):
            p.step(loss)


def test_a_second_step_call_for_one_optimizer_step_is_not_a_step(tmp_path, capsys):
    """step() called twice per step would count twice the steps at half the time each."""
    import json

    model = nn.Linear(8, 8)
    optimizer = _sgd(model)
    with Probe(model, optimizer, str(tmp_path), warmup_steps=1, track_steps=1, samples_per_step=4) as p:
        _train(model, optimizer, p, steps=6, calls_per_step=2)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 6 and result["config"]["ignored_step_calls"] == 6
    assert len(p._step_times()) == 6 - 2  # warm-up and tracked steps are not timed
    assert "step() called again with no optimizer step" in capsys.readouterr().err


def test_a_loop_that_raises_inside_the_probe_is_a_failed_result(tmp_path):
    import json

    model = nn.Linear(8, 8)
    optimizer = _sgd(model)
    with pytest.raises(RuntimeError, match="boom at step 9"):
        with Probe(model, optimizer, str(tmp_path), warmup_steps=1, track_steps=1) as p:
            _train(model, optimizer, p, steps=12, fail_at=9)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and result["steps_done"] == 9
    assert result["error"] == "rank 0: RuntimeError: boom at step 9"


def test_a_loop_that_ends_normally_is_ok_and_counts_every_step(tmp_path):
    import json

    model = nn.Linear(8, 8)
    optimizer = _sgd(model)
    with Probe(model, optimizer, str(tmp_path), warmup_steps=1, track_steps=1) as p:
        _train(model, optimizer, p, steps=5)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == 5 and result["config"]["ignored_step_calls"] == 0


def test_a_float_loss_is_taken_as_it_is(tmp_path):
    import json

    model = nn.Linear(8, 8)
    optimizer = _sgd(model)
    with Probe(model, optimizer, str(tmp_path), warmup_steps=1, track_steps=1) as p:
        for _ in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            p.step(loss.item())  # a float, as many loops log it
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_loss"] == pytest.approx(loss.item())


def test_an_earlier_result_in_the_run_dir_is_archived_not_overwritten(tmp_path):
    import json

    for n in range(2):
        model = nn.Linear(8, 8)
        optimizer = _sgd(model)
        with Probe(model, optimizer, str(tmp_path), warmup_steps=1, track_steps=1) as p:
            _train(model, optimizer, p, steps=3 + n)
    assert json.loads((tmp_path / "result.json").read_text())["steps"] == 4
    assert json.loads((tmp_path / "attempts" / "1" / "result.json").read_text())["steps"] == 3


def test_a_run_dir_that_cannot_be_written_leaves_the_result_elsewhere_and_says_where(tmp_path, capsys):
    import json

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model = nn.Linear(8, 8)
    optimizer = _sgd(model)
    with Probe(model, optimizer, str(blocker / "run"), warmup_steps=1, track_steps=1) as p:
        _train(model, optimizer, p, steps=3)
    err = capsys.readouterr().err
    assert f"run_dir={blocker / 'run'} cannot be written" in err
    where = err.split("the result is in ")[1].split()[0]
    assert json.loads(open(where).read())["steps"] == 3
    __import__("shutil").rmtree(where.rsplit("/", 1)[0])


def test_a_model_made_on_meta_and_materialised_later_is_measured_where_it_trains(tmp_path):
    import json

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    p = Probe(model, _sgd(model), str(tmp_path), warmup_steps=1, track_steps=1)  # made before storage exists
    model.to_empty(device="cpu")
    for m in model:
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    optimizer = _sgd(model)  # over the materialised parameters
    for _ in range(4):
        model(torch.randn(4, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        p.step()
    p.close()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["device"]["type"] == "cpu"
    assert result["memory"]["per_rank"][0]["peak_allocated_mib"] > 0


def _accumulating_run(tmp_path, accum: int, told: int) -> dict:
    """A loop of ``accum`` micro-batches per optimizer step whose activations outweigh its
    parameters (the peak is a later micro-batch's backward, beside the gradients held), its
    probe told ``grad_accum=told``."""
    import json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = _sgd(model)
    batch = {"inputs": torch.randn(256, 64)}

    def step_fn(m, b):
        return m(b["inputs"]).pow(2).mean()

    with Probe(model, optimizer, str(tmp_path), warmup_steps=1, track_steps=2, example=batch, step_fn=step_fn,
               grad_accum=told) as p:  # fmt: skip
        for _ in range(3):
            for _ in range(accum):
                (step_fn(model, batch) / accum).backward()
            optimizer.step()
            optimizer.zero_grad()
            p.step()
    return json.loads((tmp_path / "result.json").read_text())["memory"]["per_rank"][0]


def test_the_prediction_of_an_accumulating_loop_fakes_a_micro_batch_beside_held_gradients(tmp_path):
    told = _accumulating_run(tmp_path / "told", accum=4, told=4)
    assert abs(told["peak_rel_error"]) <= 0.05, told  # measured beside it, by the probe's own tracker
    untold = _accumulating_run(tmp_path / "untold", accum=4, told=1)
    assert untold["peak_rel_error"] < -0.10, untold  # one micro-batch faked: the held gradients missed


@pytest.mark.parametrize("as_view", [False, True])
def test_ddps_buckets_made_before_the_cpu_window_are_added_to_the_measured_peak(gloo_group, as_view):
    """DDP allocates its buckets when it wraps the model, before the probe's tracker starts:
    they are added (from DDP's reducer) under Bucket, as a run files them; with
    gradient_as_bucket_view the tracker sees them as the gradients, and nothing is added."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(nn.Linear(64, 32), gradient_as_bucket_view=as_view)
    p = Probe(model, _sgd(model), "unused")
    p.meter = Meter()
    p._memory = {"peak_allocated_mib": 10.0, "peak_breakdown_mib": {"Parameter": 1.0}}
    p.prediction = {"peak_mib": 11.0}
    figures = p._rank_figures()
    buckets = 0.0 if as_view else (64 * 32 + 32) * 4 / 2**20
    assert figures["buckets_added_mib"] == pytest.approx(buckets)
    assert figures["peak_allocated_mib"] == pytest.approx(10.0 + buckets)
    assert figures["peak_breakdown_mib"].get("Bucket", 0.0) == pytest.approx(buckets)
    assert figures["peak_rel_error"] == pytest.approx((11.0 - 10.0 - buckets) / (10.0 + buckets))
