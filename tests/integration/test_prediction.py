"""The peak predicted by one fake step before a run starts, against the peak its ranks
measure; FLOPs and utilisation; the planner built on the same step."""

from __future__ import annotations

import os

import pytest
import torch

from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError
from sharded_exp.predict.fake_step import fake_step
from tests.helpers.jobs import ROOT, STRATEGY_NAMES, launch_job, run_cli, tiny

# The CPU tracker measures over the warm-up steps: two, like the fake step.
TWO_STEPS = ["trainer.steps=3", "trainer.warmup_steps=2", "trainer.eval_batches=0"]
HF_GPT2 = ["model=hf_gpt2", "model.seq_len=32", "model.config.n_embd=64", "model.config.n_layer=2"]


def check_peaks(result: dict) -> None:
    assert result["status"] == "ok", result.get("error")
    mem = result["memory"]
    assert mem["peak_prediction"]["error"] is None
    assert mem["peak_prediction"]["method"].startswith("fake step"), mem["peak_prediction"]
    for entry in mem["per_rank"]:
        predicted, measured = entry["predicted_peak_mib"], entry["peak_allocated_mib"]
        # On CPU a collective's buffer is freed, now and then, by gloo's worker thread after
        # the training thread moved on: the measured peak may hold that one buffer on top.
        late = entry["freed_off_thread_max_mib"] if measured > predicted else 0.0
        assert abs(predicted - measured) <= 0.10 * measured + late, (entry["rank"], predicted, measured, late)
        assert entry["peak_rel_error"] == pytest.approx((predicted - measured) / measured)
    assert mem["predicted_peak_mib_max"] == max(e["predicted_peak_mib"] for e in mem["per_rank"])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4])  # 2 and 3 ranks: test_matrix.py holds every strategy x family there
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize("family", ["ours", "hugging_face"])
def test_predicted_peak_within_10_percent(family, strategy, world_size, tmp_path):
    model = ["model=gpt"] if family == "ours" else HF_GPT2
    overrides = [*model, f"strategy={strategy}", f"trainer.world_size={world_size}", *TWO_STEPS]
    check_peaks(launch_job(overrides, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_predicted_peak_of_your_model_within_10_percent(strategy, world_size, tmp_path):
    """A user's own model (a _target_ factory, built whole), in this process's launcher: the
    command line that imports a user's module is test_models.py's."""
    overrides = ["model=custom", "model._target_=tests.helpers.user_models.build", "+model.hidden=64",
                 f"strategy={strategy}", f"trainer.world_size={world_size}", *TWO_STEPS]  # fmt: skip
    check_peaks(launch_job(overrides, tmp_path))


def test_flops_and_utilisation_are_reported(tmp_path):
    """An MLP's FLOPs are known exactly: 2 per multiply-add forward, twice that backward
    (except for the first layer's input, whose gradient nobody needs)."""
    result = launch_job(["model.in_features=64", "model.hidden=32", "model.depth=2", *TWO_STEPS], tmp_path)
    tp = result["throughput"]
    b, layers = 8, [(64, 32), (32, 32), (32, 10)]  # body: depth 2, then the head
    macs = sum(i * o for i, o in layers)
    expected = b * (2 * macs + 4 * macs - 2 * 64 * 32)
    assert tp["model_flops_per_step_per_rank"] == expected
    assert tp["model_flops_per_step"] == expected * result["world_size"]
    assert tp["achieved_flops_per_s"] == pytest.approx(expected / tp["step_time_s_median"])
    assert 0 < tp["mfu_pct"] < 100 and tp["peak_flops_source"].startswith("measured: matmul on this CPU")
    assert tp["mfu_pct"] == pytest.approx(100 * tp["achieved_flops_per_s"] / tp["peak_flops_per_s"])
    # one denominator: the peak the run's own step-time prediction (and the planner) divided by
    assert tp["peak_flops_per_s"] == tp["step_time_prediction"]["peak_flops_per_s"]
    assert tp["peak_flops_source"].endswith(
        "the best size of the `this` profile (the run's own step-time prediction's peak)"
    )


def test_a_model_that_cannot_run_fake_says_why(tmp_path, monkeypatch):
    """No silent number: the run goes on, its result names why there is no prediction."""
    from sharded_exp.predict import fake_step as module

    def refuse(*args, **kwargs):
        raise RuntimeError("data-dependent branch in forward")

    monkeypatch.setattr(module, "_run", refuse)
    result = launch_job(["trainer.steps=2"], tmp_path)
    mem = result["memory"]
    assert result["status"] == "ok"
    assert mem["predicted_peak_mib_max"] is None and all(e["predicted_peak_mib"] is None for e in mem["per_rank"])
    assert "data-dependent branch in forward" in mem["peak_prediction"]["error"]
    assert "data-dependent branch in forward" in mem["peak_prediction"]["error"]


def test_a_strategy_that_cannot_run_fake_falls_back_and_says_so(monkeypatch):
    """The fallback is the strategy's analytic states plus DDP's fake-step activations."""
    from sharded_exp.predict import fake_step as module

    real = module._run

    def only_ddp(cfg, *args):
        if cfg.strategy.name != "ddp":
            raise TypeError("this wrapper cannot take fake tensors")
        return real(cfg, *args)

    monkeypatch.setattr(module, "_run", only_ddp)
    cfg = compose(tiny(["model=gpt", "strategy=zero1"]))
    ddp = real(compose(tiny(["model=gpt"])), 2, 0, "cpu", 1.0, False)
    states = {
        "ddp": {"params": 1.0, "grads": 1.0, "optimizer": 2.0},
        "zero1": {"params": 1.0, "grads": 1.0, "optimizer": 1.0},
    }
    est = fake_step(cfg, 2, 0, "cpu", states_mib=states.__getitem__, flops=False)
    assert est.method == "ddp fake step + analytic states"
    assert "zero1 cannot run under FakeTensorMode (TypeError: this wrapper cannot take fake tensors)" in est.note
    assert est.peak_mib == pytest.approx(ddp[0] - 1.0)


def test_fairscale_clipping_is_faked_without_its_branch_and_says_so():
    cfg = compose(tiny(["model=gpt", "strategy=oss", "trainer.grad_clip=1.0"]))
    est = fake_step(cfg, 2, 0, flops=False)
    assert est.method == "fake step without clipping"
    assert "clipping branches on the norm's value" in est.note
    no_clip = fake_step(compose(tiny(["model=gpt", "strategy=oss", "trainer.grad_clip=0"])), 2, 0, flops=False)
    assert no_clip.method == "fake step" and no_clip.peak_mib == pytest.approx(est.peak_mib)


# ------------------------------------------------------- MFU never above 100%
@pytest.mark.parametrize(
    "name, bf16_tflops",
    [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 NVL", 835), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989),
     ("NVIDIA H200 NVL", 835), ("NVIDIA GH200 480GB", 989), ("NVIDIA A100-SXM4-80GB", 312),
     ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("Tesla V100-SXM2-16GB", None)],
)  # fmt: skip
def test_gpu_peaks_are_matched_by_model_not_substring(name, bf16_tflops):
    from sharded_exp.measure.flops import TERA, gpu_peak

    peak, source = gpu_peak(name, "bf16")
    assert (peak / TERA if peak else None) == bf16_tflops, source
    if peak is None:
        assert "MIG slice" in source or "unknown device" in source


def test_an_mfu_that_cannot_be_trusted_is_null_with_the_reason(monkeypatch):
    import torch

    from sharded_exp.measure import flops

    cpu = torch.device("cpu")
    half = flops.utilisation(1e9, 0.01, cpu, "16")  # an emulated fp16 matmul is no peak for autocast
    assert half["mfu_pct"] is None and "no trustworthy CPU peak at precision 16" in half["peak_flops_source"]
    monkeypatch.setattr(flops, "cpu_peak", lambda precision: 1e9)  # a peak below what the step achieves
    over = flops.utilisation(1e9, 0.01, cpu, "32")
    assert over["mfu_pct"] is None and "is above it: peak not trusted" in over["peak_flops_source"]
    monkeypatch.setattr(flops, "cpu_peak", lambda precision: 1e12)
    assert flops.utilisation(1e9, 0.01, cpu, "32")["mfu_pct"] == pytest.approx(10)


# ----------------------------------------- one optimizer implementation, run and fake step
def test_the_fake_step_and_the_run_use_the_same_adam_on_each_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sharded_exp.optim import optimizer_spec

    cfg = compose(["optimizer=adam"]).optimizer
    real_cpu = optimizer_spec(cfg, torch.nn.Linear(4, 4)).build()
    on_meta = torch.nn.Linear(4, 4, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_cpu = optimizer_spec(cfg, torch.nn.Linear(4, 4)).build()
        fake_cuda = optimizer_spec(cfg, on_meta.to_empty(device="cuda")).build()
    assert [g["foreach"] for g in real_cpu.param_groups] == [g["foreach"] for g in fake_cpu.param_groups] == [False] * 2
    assert [g["foreach"] for g in fake_cuda.param_groups] == [True, True]  # as a real CUDA run's Adam


def test_preflight_for_a_gpu_run_never_starts_cuda_in_the_parent(monkeypatch, tmp_path):
    """CUDA mocked present: the pre-flight decides cuda and predicts the peak (a fake step
    with CUDA's kernels on fake CPU tensors) without one call that would start a context."""
    from sharded_exp.launch import preflight

    def started(*args, **kwargs):
        raise AssertionError("the parent started CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("_lazy_init", "init", "get_device_properties", "get_device_capability", "is_bf16_supported",
                 "is_current_stream_capturing", "current_stream"):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, started)
    # what an optimizer's step asks first (is a CUDA graph being captured?), as a GPU machine answers it
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_stream", started)
    cfg = compose(["model=gpt", "precision=bf16", "trainer.accelerator=gpu", "trainer.world_size=2"])
    checked = preflight.check(cfg, str(tmp_path))
    peak = checked.prediction["peak"]
    assert checked.device_type == "cuda" and peak["error"] is None, peak
    assert "CUDA's kernel choices" in peak["kernels"] and "workspace" in peak["rules"]
    assert not torch.cuda.is_initialized()


def test_cuda_predictions_add_cublas_workspace_by_rule(monkeypatch):
    from sharded_exp.measure.cuda_kernels import cublas_workspace_mib
    from sharded_exp.predict.prediction import model_shapes, predict, predict_peak

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace_mib()[0] == 32.0 and "assumed" in cublas_workspace_mib()[1]
    assert cublas_workspace_mib((8, 0))[0] == 8.125 and cublas_workspace_mib((9, 0))[0] == 32.0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_workspace_mib((8, 0)) == (32.0, "CUBLAS_WORKSPACE_CONFIG=:4096:8")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    cfg = compose(["model=mlp", "model.hidden=64"])
    shapes = model_shapes(cfg.model, cfg.optimizer)
    prediction = predict(cfg.strategy, cfg.optimizer, "32", shapes, 2)
    cpu, cuda = (predict_peak(cfg, 2, device, prediction, shapes, flops=False) for device in ("cpu", "cuda"))
    assert cpu["rules"] == {} and cpu["breakdown_mib"]["workspace"] == 0.0
    assert (
        cuda["rules"] == {"workspace": "CUBLAS_WORKSPACE_CONFIG=:16:8"} and cuda["breakdown_mib"]["workspace"] == 0.125
    )
    # An MLP has no attention and a per-tensor vs foreach Adam of a tiny model peaks alike:
    # the CUDA peak is the CPU one plus the workspace.
    assert cuda["per_rank_mib"] == pytest.approx([m + 0.125 for m in cpu["per_rank_mib"]], abs=0.05)


def test_a_fake_step_for_a_gpu_runs_cudas_adam_and_counts_fused_attention():
    """Planned for CUDA, the optimizer step holds foreach's group-sized temporaries (its
    phase peaks higher than the per-tensor loop's), and attention's FLOPs are counted by
    torch's formulas although no aten attention op runs."""
    cfg = compose(["model=gpt", "precision=bf16"])
    cpu, cuda = fake_step(cfg, 2, 0, "cpu"), fake_step(cfg, 2, 0, "cuda")
    cpu_opt, cuda_opt = cpu.extra["phases"]["optimizer"], cuda.extra["phases"]["optimizer"]
    # (MemTracker files what the step allocates inside optimizer.step() as optimizer state)
    assert cuda_opt[1]["optimizer"] > cpu_opt[1]["optimizer"] and cuda_opt[0] > cpu_opt[0]
    assert cuda.flops_per_step >= cpu.flops_per_step


# ---------------------------------------- host memory before spawn, and a float64 model
def test_a_cpu_job_predicted_beyond_host_memory_is_refused_before_spawn(tmp_path, monkeypatch):
    from sharded_exp.launch import preflight

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    assert 0 < preflight.available_host_mib() <= total  # read from /proc/meminfo (or the cgroup)
    monkeypatch.setattr(preflight, "available_host_mib", lambda: 500.0)  # a small machine
    with pytest.raises(ConfigError, match=r"the job needs about [\d,]+ MiB of host memory \(2 rank\(s\).*"
                                          r"500 MiB are available here.*trainer.host_memory_check=false"):  # fmt: skip
        launch_job(["trainer.accelerator=cpu", "trainer.steps=2"], tmp_path / "run")
    assert not (tmp_path / "run").exists()
    result = launch_job(
        ["trainer.accelerator=cpu", "trainer.steps=2", "trainer.host_memory_check=false"], tmp_path / "run"
    )
    assert result["status"] == "ok"


HOST_MIB = """
import sharded_exp.measure.machine_memory as memory
memory.available_mib = lambda: {mib!r}
"""


def test_a_job_whose_peak_does_not_fit_host_memory_is_refused_after_its_ranks_start_before_they_step(tmp_path):
    # `python -m sharded_exp` starts the ranks once the config is checked, while its check
    # predicts the peak (launch/parent.py): a host that holds the model states but not the
    # peak refuses the job then, its ranks stopped before their first step, and nothing is
    # left behind, as a refusal before they started leaves nothing
    from sharded_exp.launch import preflight

    overrides = ["trainer.accelerator=cpu", "trainer.batch_size=512", "logger=none"]
    spec = preflight.check(compose(overrides), str(tmp_path / "x"))
    states = max(sum(p.values()) for p in spec.prediction["model_states_mib"])
    peak = max(spec.prediction["peak"]["per_rank_mib"])
    assert peak > states + 1  # the activations of a batch of 512: room for a host between the two
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOST_MIB.format(mib=2 * (preflight.RANK_OVERHEAD_MIB + (states + peak) / 2)))
    run = tmp_path / "run"  # a run directory that holds an earlier attempt's result
    run.mkdir()
    (run / "result.json").write_text('{"status": "ok"}')
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    proc = run_cli([*overrides, f"hydra.run.dir={run}"], cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: the job needs about" in proc.stderr and "(2 rank(s): predicted" in proc.stderr, proc.stderr
    # as it was found: the earlier result where it was, nothing of this job's (no .hydra, no
    # "running" result, no rank's error record: the ranks never stepped), its log empty
    assert (run / "result.json").read_text() == '{"status": "ok"}'
    assert sorted(p.name for p in run.iterdir() if p.stat().st_size or p.is_dir()) == ["result.json"]


def test_a_float64_model_is_measured_and_predicted_in_its_own_dtype(tmp_path):
    from sharded_exp.predict.fake_step import _short

    result = launch_job(
        ["model=custom", "model._target_=tests.helpers.user_models.build_double", "trainer.steps=3"], tmp_path
    )
    memory = result["memory"]
    assert result["status"] == "ok" and memory["peak_prediction"]["error"] is None
    assert memory["predicted_model_states_mib_max"] == pytest.approx(memory["model_states_mib_max"], rel=1e-6)
    assert memory["predicted_peak_mib_max"] == pytest.approx(memory["peak_allocated_mib_max"], rel=0.1)
    # a wrapped error's second line (what went wrong) is kept
    assert _short(RuntimeError("Error in call to target 'x':\nValueError('the cause')")).endswith("the cause')")


# ------------------------------------------------------- gloo's reduce-scatter, a rule
def _measure_reduce_scatter(rank: int, store: str, out_dir: str) -> None:
    """A gloo rank: the tracker's peak over one reduce-scatter of 2 x 1,000 floats."""
    import json

    import torch.distributed as dist

    from sharded_exp.measure.tracker import peak_tracker

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        tracker = peak_tracker()
        with tracker:
            inputs, output = torch.ones(2000), torch.empty(1000)
            dist.reduce_scatter_tensor(output, inputs)  # FSDP2's call (on torch 2.13 through reduce_scatter_single)
            del inputs, output
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(peak, f)
    finally:
        dist.destroy_process_group()


def test_a_fake_reduce_scatter_holds_what_gloos_holds(tmp_path):
    """gloo reduces a copy of a reduce-scatter's input (GlooReduceScatter's rule): real
    ranks measure input + output + the copy, and a fake step's reduce-scatter the same."""
    import json

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sharded_exp.measure.spawned import run_spawned
    from sharded_exp.measure.tracker import peak_tracker
    from sharded_exp.predict.fake_step import GlooReduceScatter, fake_process_group

    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    # never waited for forever: ranks stuck tearing gloo down once they wrote are killed
    run_spawned(_measure_reduce_scatter, (str(tmp_path / "store"), str(tmp_path)), 2,
                lambda: all(f.exists() for f in files), "the real reduce-scatter", limit_s=300)  # fmt: skip
    real = [json.loads(f.read_text()) for f in files]
    assert real == [8000 + 4000 + 8000] * 2  # input, output, and gloo's copy of the input

    from torch.distributed import distributed_c10d

    name = GlooReduceScatter.NAME  # reduce_scatter_single on torch 2.13, reduce_scatter_tensor before
    originals = getattr(dist, name), getattr(distributed_c10d, name)
    with fake_process_group(2, 0), FakeTensorMode(allow_non_fake_inputs=True), GlooReduceScatter() as rule:
        tracker = peak_tracker()
        with tracker:
            inputs, output = torch.ones(2000), torch.empty(1000)
            getattr(dist, name)(output, inputs)
            del inputs, output
        assert tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] == real[0]
        assert rule.count == 1
        # every Python entry point holds one copy per collective
        inputs, output = torch.ones(2000), torch.empty(1000)
        dist.reduce_scatter_tensor(output, inputs)
        assert rule.count == 2
        dist.distributed_c10d._reduce_scatter_base(output, inputs)
        assert rule.count == 3
    assert (getattr(dist, name), getattr(distributed_c10d, name)) == originals  # put back


def test_a_cpu_fsdp_prediction_holds_gloos_copy_at_its_peak(monkeypatch):
    """Where FSDP's backward reduce-scatter is the peak (an MLP of 128 x 2, batch 8), a CPU
    run's peak holds gloo's copy of the larger unit's whole gradient; a GPU run's (NCCL)
    does not."""
    from sharded_exp.models.mlp import MLP, MLPConfig
    from sharded_exp.predict.fake_step import MIB, GlooReduceScatter

    cfg = compose(["strategy=fsdp", "model=mlp", "model.hidden=128", "model.depth=2", "trainer.batch_size=8"])
    held = fake_step(cfg, 2, 0, "cpu", flops=False)
    gpu = fake_step(cfg, 2, 0, "cuda", flops=False)
    monkeypatch.setattr(GlooReduceScatter, "MODULES", ())
    without = fake_step(cfg, 2, 0, "cpu", flops=False)
    copy = sum(p.numel() for p in MLP(MLPConfig(hidden=128, depth=2)).body[1].parameters()) * 4 / MIB  # 16,768 floats
    # The peak moves to that reduce-scatter: higher, by at most the copy; live there are its
    # input (the unit's whole gradient), gloo's copy of it and this rank's half, the output.
    assert without.peak_mib < held.peak_mib <= without.peak_mib + copy
    assert held.breakdown_mib["temporaries"] >= 2.5 * copy > without.breakdown_mib["temporaries"]
    assert held.extra["gloo_reduce_scatters"] == 6  # three units, two steps
    assert gpu.extra["gloo_reduce_scatters"] == 0 and without.extra["gloo_reduce_scatters"] == 0


ISSUE_37_SHAPES = {
    "mlp_128x2": ["model.hidden=128", "model.depth=2"],
    "param_dtype_bf16_at_32": ["strategy.param_dtype=bfloat16", "precision=32", "model.hidden=256", "model.depth=3"],
    "flat_custom_at_16": ["model=custom", "model._target_=tests.helpers.user_models.build_flat", "precision=16"],
}
"""FSDP runs whose peak is a backward reduce-scatter, predicted 6-23% low before the rule."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ISSUE_37_SHAPES))
def test_fsdp_runs_peaking_in_a_reduce_scatter_are_predicted_within_5_percent(case, tmp_path):
    overrides = ["strategy=fsdp", *ISSUE_37_SHAPES[case], "trainer.steps=8", "trainer.warmup_steps=4",
                 "trainer.eval_batches=0"]  # fmt: skip
    result = launch_job(overrides, tmp_path)
    assert result["status"] == "ok", result.get("error")
    assert "gloo_reduce_scatter" in result["memory"]["peak_prediction"]["rules"]
    for entry in result["memory"]["per_rank"]:
        predicted, measured = entry["predicted_peak_mib"], entry["peak_allocated_mib"]
        # gloo's worker thread now and then frees the copy after the training thread moved on
        late = entry["freed_off_thread_max_mib"] if measured > predicted else 0.0
        assert abs(predicted - measured) <= 0.05 * measured + late, (entry["rank"], predicted, measured, late)
