"""The CPU memory tracker and the fake step, in this process: gradient accumulation, frozen
parameters, and a tracker that fails while the training goes on (measuring never
breaks training)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded_exp.compose import compose
from sharded_exp.measure.tracker import MemoryMeter
from tests.helpers.jobs import launch_job, tiny


def _model(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if frozen:
        model[0].requires_grad_(False)
    return model


def _step(model: nn.Module, optimizer, micro_batches: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    for m in range(micro_batches):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(m))
        (model(x).square().mean() / micro_batches).backward()
    optimizer.step()


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_tracker_measures_accumulation_and_frozen_parameters(micro_batches, frozen):
    model = _model(frozen)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    meter = MemoryMeter(torch.device("cpu"))
    meter.start(model)
    for _ in range(2):
        _step(model, optimizer, micro_batches)
        meter.step_end()
    figures = meter.stop()
    assert figures["peak_error"] is None and meter.failure is None
    params = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad) / 2**20
    breakdown = figures["peak_breakdown_mib"]
    assert breakdown["Parameter"] == pytest.approx(params)
    # Adam's two moments of the trainable parameters only, and inside its step as many
    # temporaries again at most (a frozen parameter's moments would exceed that).
    assert 2 * trainable <= breakdown["Optstate"] <= 4 * trainable + 1e-3
    assert breakdown["Gradient"] <= trainable + 1e-9
    assert figures["peak_allocated_mib"] >= params + 2 * trainable


def test_a_failing_tracker_leaves_a_null_figure_and_the_step_untouched(monkeypatch):
    """torch's tracker raising inside a hook is the measurement's failure: the step runs
    exactly as without a tracker, and the peak is null with the reason."""
    from torch.distributed._tools import mem_tracker

    reference = _model()
    ref_opt = torch.optim.Adam(reference.parameters())
    _step(reference, ref_opt, 2)

    def broken(self, args):
        raise RuntimeError("cannot follow this model")

    monkeypatch.setattr(mem_tracker.MemTracker, "_track_inputs_or_outputs", broken)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    meter = MemoryMeter(torch.device("cpu"), limit_mib=1e-6)  # a budget it cannot check either
    meter.start(model)
    _step(model, optimizer, 2)
    meter.step_end()  # no out-of-memory from a tracker that measured nothing
    figures = meter.stop()
    assert figures["peak_allocated_mib"] is None
    assert figures["peak_error"] == "the CPU memory tracker failed: RuntimeError: cannot follow this model"
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_a_tracker_that_cannot_start_is_a_null_figure():
    meter = MemoryMeter(torch.device("cpu"))
    meter.start(object())  # MemTracker refuses what it cannot follow
    assert meter.stop()["peak_error"].startswith("the CPU memory tracker could not start: TypeError")


def _fake_cfg(*overrides: str):
    return compose(tiny(["model=gpt", *overrides]))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fake_step_accumulates_and_freezes(strategy):
    from sharded_exp.predict.fake_step import fake_step

    one = fake_step(_fake_cfg(f"strategy={strategy}"), 2)
    three = fake_step(_fake_cfg(f"strategy={strategy}", "trainer.grad_accum=3"), 2)
    frozen = fake_step(_fake_cfg(f"strategy={strategy}", "trainer.freeze=[tok_emb.*,pos_emb.*]"), 2)
    assert three.method == one.method == frozen.method == "fake step"
    assert three.flops_per_step == pytest.approx(3 * one.flops_per_step, rel=0.01)
    # No optimizer state and no gradient for the frozen embeddings.
    assert frozen.breakdown_mib["optimizer"] < one.breakdown_mib["optimizer"]


def test_fake_step_names_the_tracker_not_the_model(monkeypatch):
    from torch.distributed._tools import mem_tracker

    from sharded_exp.predict.prediction import model_shapes, predict, predict_peak

    def broken(self, args):
        raise RuntimeError("cannot follow this model")

    monkeypatch.setattr(mem_tracker.MemTracker, "_track_inputs_or_outputs", broken)
    cfg = _fake_cfg()
    shapes = model_shapes(cfg.model, cfg.optimizer)
    peak = predict_peak(cfg, 2, "cpu", predict(cfg.strategy, cfg.optimizer, "32", shapes, 2), shapes)
    assert peak["per_rank_mib"] is None
    assert peak["error"] == "the memory tracker (torch MemTracker) failed: RuntimeError: cannot follow this model"


def test_a_run_whose_tracker_fails_goes_on(tmp_path):
    """A real job: rank 1's tracker breaks at step 0; the job trains to the end, ok, with rank
    1's peak null and the reason in result.json; rank 0's peak is still measured."""
    result = launch_job(
        ["trainer.grad_accum=2", "trainer.freeze=[body.0.*]"],
        tmp_path,
        env={"SHARDED_EXP_FAULT": "rank=1,step=0,kind=tracker_error"},
    )
    assert result["status"] == "ok", result.get("error")
    mem = result["memory"]
    assert mem["peak_error"] == (
        "rank 1: the CPU memory tracker failed: RuntimeError: injected tracker failure on rank 1 at step 0"
    )
    ranks = mem["per_rank"]
    assert ranks[1]["peak_allocated_mib"] is None and ranks[1]["peak_rel_error"] is None
    assert ranks[0]["peak_allocated_mib"] > 0 and ranks[0]["peak_error"] is None
    assert result["steps_done"] == 6 and result["history"][-1]["loss"] < result["history"][0]["loss"]


def test_the_cpu_window_covers_a_step_after_the_first_optimizer_step(shared_runs):
    """With trainer.warmup_steps=1 the tracked window still holds a steady step (Adam's state
    exists): the same peak as with two warm-up steps, and as predicted."""
    common = ["model=hf_bert", "model.seq_len=16", "trainer.batch_size=4", "precision=bf16", "trainer.world_size=3"]
    _, one = shared_runs(*common, "trainer.warmup_steps=1")
    _, two = shared_runs(*common, "trainer.warmup_steps=2")
    assert one["memory"]["peak_allocated_mib_max"] == pytest.approx(two["memory"]["peak_allocated_mib_max"], rel=1e-6)
    assert abs(one["memory"]["peak_rel_error_max"]) <= 0.02
    assert one["throughput"]["timed_steps"] == 4  # 6 steps, 2 tracked and untimed


def test_phase_peaks_are_read_for_the_faked_device_only():
    """A CUDA fake step also holds a few bytes on the CPU (Adam's step counters): the
    per-phase peaks used for other ranks are the faked device's, never the CPU's."""
    from types import SimpleNamespace

    from sharded_exp.predict.fake_step import _phases

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    big, tiny_ = {"Total": 100 * 2**20, "Parameter": 100 * 2**20}, {"Total": 8, "Optstate": 8}
    tracker = SimpleNamespace(
        phase_peaks={(cuda, "step"): big, (cuda, "optimizer"): big, (cpu, "step"): tiny_, (cpu, "optimizer"): tiny_}
    )
    phases = _phases(tracker, cuda)
    assert set(phases) == {"step", "optimizer"} and all(total == 100 for total, _ in phases.values())
    assert _phases(tracker, cpu)["optimizer"][0] == 8 / 2**20


def test_the_cuda_memory_history_is_guarded(monkeypatch, tmp_path):
    """CUDA's allocator history (issue 25), its calls replaced here (no GPU): a call that
    fails leaves no file and its reason, and training is not stopped; one that works
    leaves the snapshot file where result.json says. On CPU nothing is recorded, said why."""
    from sharded_exp.measure.snapshot import MemoryHistory

    cpu = MemoryHistory("always", torch.device("cpu"), None, str(tmp_path), 0)
    assert cpu.record() == {"setting": "always", "recorded": False, "path": None, "reason": cpu.reason}
    assert "on CPU" in cpu.reason
    off = MemoryHistory("auto", torch.device("cuda", 0), None, str(tmp_path), 0)  # auto without a budget
    assert not off.recorded and off.reason == "not recorded (no trainer.memory_limit_mib)"

    calls = []

    def refuse(*args, **kwargs):
        raise RuntimeError("no allocator here")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    broken = MemoryHistory("oom", torch.device("cuda", 0), None, str(tmp_path), 1)
    broken.dump()
    broken.stop()
    assert broken.record()["path"] is None and "RuntimeError: no allocator here" in broken.reason

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: open(path, "wb").write(b"x"))
    history = MemoryHistory("auto", torch.device("cuda", 0), 512.0, str(tmp_path), 2)  # a budget: recorded
    history.dump()
    history.stop()
    assert history.record()["path"] == str(tmp_path / "memory_snapshot_rank2.pickle") and history.reason is None
    assert (tmp_path / "memory_snapshot_rank2.pickle").exists()
    assert calls[0][1]["max_entries"] > 0 and calls[-1][0] == (None,)  # recorded, then stopped


def test_an_oom_without_a_breakdown_says_why_on_either_device():
    """result.json's oom_breakdown_error names the device's reason: on CUDA the snapshot's."""
    from sharded_exp.output.results import oom_memory

    cpu = {"setting": "auto", "recorded": False, "path": None,
           "reason": "no CUDA allocator to record on CPU (memory.oom_breakdown holds the CPU tracker's)"}  # fmt: skip
    cuda = {"setting": "auto", "recorded": False, "path": None, "reason": "not recorded (no trainer.memory_limit_mib)"}
    on_cpu = oom_memory([{"rank": 1, "memory_at_oom": {"oom_breakdown": None, "memory_snapshot": cpu}}])
    on_cuda = oom_memory([{"rank": 0, "memory_at_oom": {"oom_breakdown": None, "memory_snapshot": cuda}}])
    assert on_cpu["oom_breakdown_error"].startswith("the allocation failed where the CPU tracker kept no record")
    assert on_cuda["oom_breakdown_error"] == (
        "a CUDA run without a snapshot: not recorded (no trainer.memory_limit_mib) (memory.memory_snapshot)"
    )
    assert oom_memory([])["oom_breakdown_error"] == "no rank recorded its memory at the failure"


# -------------------------------------------------------------- the CUDA meter's window
def test_the_cuda_window_resets_the_accumulated_counters(monkeypatch):
    from sharded_exp.measure.tracker import MemoryMeter

    calls = []
    for name in ("synchronize", "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: calls.append(_n))
    MemoryMeter(torch.device("cuda", 0), None).start()
    assert calls == ["synchronize", "reset_peak_memory_stats", "reset_accumulated_memory_stats"]


def test_a_tensor_another_thread_frees_is_live_until_then_and_named():
    """A collective's buffer is freed by gloo's worker thread when it drops it last: live
    until that moment (the tracker's sums stay right, from either thread), and the largest
    such tensor is a figure of the run (the slack a measured peak may hold over program order)."""
    import threading

    from sharded_exp.measure.tracker import peak_tracker

    tracker = peak_tracker()
    handed, dropped = [], threading.Event()

    def worker():
        dropped.wait(timeout=60)  # bounded, and a daemon: a failed assertion below leaves no thread waiting
        handed.clear()  # the last reference goes here, in another thread

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    with tracker:
        buffer = torch.ones(1024)  # 4 KiB
        small = torch.ones(16)
        handed.append(buffer)
        del buffer
        assert tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"] == 4096 + 64
        dropped.set()
        thread.join(timeout=60)
        assert tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"] == 64
        del small  # freed here, by the training thread: not a figure
    assert tracker.freed_off_thread_max == 4096
