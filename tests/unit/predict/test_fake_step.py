"""sharded_exp.predict.fake_step: the tracker's categories and devices read into our
breakdown, FSDP's lazy chunks, gloo's reduce-scatter rule, the fake process group, the
error naming (which part failed, whose code raised), the fallbacks of ``fake_step``
(here around a stub ``_run``) and one real fake step of a tiny MLP (an FSDP one takes
about a second: the integration tests hold it)."""

from __future__ import annotations

import contextlib
from enum import Enum
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo  # noqa: F401 -- FakeTensorMode imports it; paid at collection, not in a test
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sharded_exp.predict import fake_step as module
from sharded_exp.predict.fake_step import (
    MIB,
    FakeStepError,
    GlooReduceScatter,
    _blame,
    _Chunks,
    _data_dependent,
    _on,
    _parts,
    _phases,
    _probe,
    _short,
    fake_process_group,
    fake_step,
)
from sharded_exp.strategies import STRATEGIES

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture
def base_cfg(tiny_job):
    return tiny_job


def job(base, strategy: str = "ddp", grad_clip: float = 0.0, **fields):
    cfg = base.copy()
    cfg.strategy = OmegaConf.structured(STRATEGIES.config_class(strategy)(**fields))
    cfg.trainer.grad_clip = grad_clip
    return cfg


# --------------------------------------------------------------- breakdown by category
class Kind(Enum):
    UNSHARDED = "Unsharded Param"


def test_parts_files_torchs_categories_under_ours_in_mib():
    values = {
        "Parameter": 1 * MIB,
        "Sharded Param": 2 * MIB,
        Kind.UNSHARDED: 3 * MIB,  # torch's enum keys: read by their value
        "Gradient": 4 * MIB,
        "OptState": 5 * MIB,
        "Inputs": 6 * MIB,
        "Bucket": 7 * MIB,
        "Something new": 8 * MIB,
        "Total": 100 * MIB,
    }
    total, parts = _parts(values)
    assert total == 100.0  # the tracker's own total, not the sum of the parts
    assert parts["params"] == 3.0 and parts["gathered"] == 3.0 and parts["grads"] == 4.0
    assert parts["optimizer"] == 5.0 and parts["activations"] == 6.0 and parts["buckets"] == 7.0
    assert parts["other"] == 8.0  # an unknown category is "other"
    assert parts["temporaries"] == parts["communication"] == 0.0


def test_on_picks_the_devices_snapshot_or_the_first_of_its_type():
    snapshots = {CPU: {"Total": 1}, CUDA0: {"Total": 2}}
    assert _on(snapshots, torch.device("cuda")) == {"Total": 2}
    assert _on(snapshots, CPU) == {"Total": 1}
    assert _on(snapshots, CUDA1) == {}
    assert _on({CPU: {"Total": 1}}, torch.device("cuda")) == {}


def test_phases_of_a_device_without_index_are_its_types_first_devices():
    tracker = SimpleNamespace(
        phase_peaks={
            (CPU, "step"): {"Total": 8},
            (CUDA1, "step"): {"Total": MIB},
            (CUDA1, "optimizer"): {"Total": 2 * MIB},
        }
    )
    phases = _phases(tracker, torch.device("cuda"))
    assert {k: v[0] for k, v in phases.items()} == {"step": 1.0, "optimizer": 2.0}
    assert _phases(SimpleNamespace(phase_peaks={}), CPU) == {}


# ------------------------------------------------------------------ FSDP's lazy chunks
@pytest.mark.parametrize(
    "shape, n, dim", [((5, 3), 4, 0), ((8, 2), 3, 0), ((2, 7), 3, 1), ((1,), 4, 0), ((4, 0), 2, 0)]
)
def test_lazy_chunks_are_fsdps_padded_chunks_piece_by_piece(shape, n, dim):
    tensor = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).float()
    eager = list(torch.chunk(tensor, n, dim=dim))
    eager += [eager[0].new_empty(0)] * (n - len(eager))  # FSDP2's _chunk_with_empty
    lazy = _Chunks(tensor, n, dim)
    assert len(lazy) == n
    assert [p.shape for p in lazy] == [p.shape for p in eager]
    assert lazy[-1].shape == eager[-1].shape
    for got, want in zip(lazy, eager):
        if want.numel():
            assert torch.equal(got, want) and got.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


def test_lazy_chunks_refuse_an_index_out_of_range():
    lazy = _Chunks(torch.zeros(4), 2, 0)
    with pytest.raises(IndexError):
        lazy[2]
    with pytest.raises(IndexError):
        lazy[-3]


# --------------------------------------------------------------- the fake process group
def test_the_fake_process_group_is_up_inside_and_gone_after():
    work = torch._C._distributed_c10d.FakeWork
    never = work.is_completed
    with fake_process_group(4, 3):
        assert dist.is_initialized() and dist.get_world_size() == 4 and dist.get_rank() == 3
        assert work.is_completed(None) is True  # a fake collective is complete once issued
        with pytest.raises(RuntimeError, match="needs a process without a process group"):
            with fake_process_group(2, 0):
                pass
        assert dist.is_initialized()
    assert not dist.is_initialized() and work.is_completed is never


def test_glooss_reduce_scatter_holds_a_copy_of_its_input_while_it_runs():
    """On any torch: the function every reduce-scatter goes through (``reduce_scatter_single``
    since 2.13, ``reduce_scatter_tensor`` before) is the one the rule wraps, by ``dist.`` and
    inside c10d alike, and put back after."""
    from torch.distributed import distributed_c10d

    from sharded_exp.measure.tracker import peak_breakdown_mib

    name = GlooReduceScatter.NAME
    assert name == ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor")
    saved = (getattr(dist, name), getattr(distributed_c10d, name))
    inp, out = torch.zeros(2 * 1024), torch.zeros(1024)  # 8 KiB in, 4 KiB out
    with fake_process_group(2, 0):
        plain = peak_breakdown_mib(lambda: getattr(dist, name)(out, inp), device=CPU)
        with GlooReduceScatter() as rule:
            held = peak_breakdown_mib(lambda: getattr(dist, name)(out, inp), device=CPU)
            dist.reduce_scatter_tensor(out, inp)  # FSDP2's call (2.13: looked up inside c10d): the same rule
    assert rule.count == 2
    assert (held["Total"] - plain["Total"]) * MIB == inp.numel() * 4  # a copy of the input on top
    assert (getattr(dist, name), getattr(distributed_c10d, name)) == saved


# ------------------------------------------------------------------ naming a failure
def test_a_fake_step_error_names_its_part_and_keeps_its_cause():
    cause = ValueError("no shapes\n  for you")
    err = FakeStepError("the model cannot be built under FakeTensorMode", cause)
    assert str(err) == "the model cannot be built under FakeTensorMode: ValueError: no shapes for you"
    assert err.part.startswith("the model") and err.cause is cause
    assert str(FakeStepError("the tracker failed", cause, detail="KeyError: x")) == "the tracker failed: KeyError: x"


def test_short_joins_the_lines_and_cuts_long_messages():
    assert _short(RuntimeError("Error in call to target:\n\n  the real reason ")) == (
        "RuntimeError: Error in call to target: the real reason"
    )
    assert _short(ValueError("x" * 1000)) == "ValueError: " + "x" * 400
    inner = FakeStepError("part", ValueError("v"))
    assert _short(inner) == "part: ValueError: v"


def test_data_dependent_failures_are_recognised_also_inside_a_fake_step_error():
    from torch._subclasses.fake_tensor import DataDependentOutputException

    assert _data_dependent(RuntimeError("Data-dependent branching in forward"))
    assert _data_dependent(FakeStepError("step", DataDependentOutputException(torch.ops.aten.item.default)))
    assert not _data_dependent(ValueError("shape mismatch"))
    assert not _data_dependent(FakeStepError("step", ValueError("shape mismatch")))


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)  # raises inside torch: the deepest frame outside torch is here


def raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no exception")


def test_blame_names_the_model_when_its_own_code_raised():
    model = Broken()
    exc = raised(lambda: model(torch.zeros(2, 5)))
    assert _blame(exc, model) == "the model cannot run under FakeTensorMode"


def test_blame_names_the_strategy_or_the_step_by_the_deepest_file():
    namespace: dict = {}
    exec(compile("def step():\n    raise RuntimeError('x')\n", "/pkg/strategies/mine.py", "exec"), namespace)
    strategy = _blame(raised(namespace["step"]), Broken())
    assert strategy.format("oss") == "strategy=oss cannot run its step under FakeTensorMode"
    exec(compile("def step():\n    raise RuntimeError('x')\n", "/pkg/train/step.py", "exec"), namespace)
    assert _blame(raised(namespace["step"]), Broken()) == "the training step cannot run under FakeTensorMode"
    assert _blame(raised(namespace["step"]), None) == "the training step cannot run under FakeTensorMode"


# ----------------------------------------------------------- fake_step's fallbacks
@pytest.fixture
def runs(monkeypatch):
    """_run replaced: ``outcome(cfg, clip)`` returns a result or raises; the calls are recorded."""
    calls = []

    def install(outcome):
        def stub(cfg, world_size, rank, device_type, grad_clip, flops, trace=None, memory=True):
            calls.append((cfg.strategy.name, grad_clip, cfg.strategy.get("cpu_offload")))
            return outcome(cfg, grad_clip)

        monkeypatch.setattr(module, "_run", stub)
        return calls

    return install


RESULT = (10.0, {"params": 4.0, "grads": 4.0, "optimizer": 2.0}, 99, {"phases": {}})


def test_a_step_that_runs_is_a_fake_step_with_its_clipping(base_cfg, runs):
    calls = runs(lambda cfg, clip: RESULT)
    est = fake_step(job(base_cfg, grad_clip=0.5), 2, 1)
    assert calls == [("ddp", 0.5, None)]
    assert (est.rank, est.peak_mib, est.flops_per_step, est.method, est.note) == (1, 10.0, 99, "fake step", "")


def test_clipping_that_reads_values_is_faked_without_it_from_the_start(base_cfg, runs):
    calls = runs(lambda cfg, clip: RESULT)
    est = fake_step(job(base_cfg, "oss", grad_clip=1.0), 2, 0)
    assert calls == [("oss", 0.0, None)]
    assert est.method == "fake step without clipping"
    assert est.note == "oss's clipping branches on the norm's value: step faked without it"


def test_a_data_dependent_clipping_is_retried_without_it(base_cfg, runs):
    def outcome(cfg, clip):
        if clip:
            raise RuntimeError("data-dependent branch in clip")
        return RESULT

    calls = runs(outcome)
    est = fake_step(job(base_cfg, grad_clip=1.0), 2, 0)
    assert [c[1] for c in calls] == [1.0, 0.0]
    assert est.method == "fake step without clipping"
    assert "on a value (RuntimeError: data-dependent branch in clip)" in est.note


def test_another_failure_of_ddp_is_raised_without_a_retry(base_cfg, runs):
    def outcome(cfg, clip):
        raise TypeError("cannot fake")

    calls = runs(outcome)
    with pytest.raises(TypeError, match="cannot fake"):
        fake_step(job(base_cfg, grad_clip=1.0), 2, 0)
    assert len(calls) == 1


def test_a_strategy_that_cannot_run_fake_gets_its_analytic_states_over_ddps_step(base_cfg, runs):
    def outcome(cfg, clip):
        if cfg.strategy.name != "ddp":
            raise TypeError("wrapper refuses fake tensors")
        return (20.0, {"params": 4.0, "grads": 4.0, "optimizer": 8.0, "activations": 4.0}, 77, {})

    runs(outcome)
    states = {
        "ddp": {"params": 4.0, "grads": 4.0, "optimizer": 8.0},
        "zero1": {"params": 4.0, "grads": 4.0, "optimizer": 4.0},
    }
    est = fake_step(job(base_cfg, "zero1"), 2, 1, states_mib=states.__getitem__)
    assert est.method == "ddp fake step + analytic states"
    assert est.peak_mib == pytest.approx(20.0 - 16.0 + 12.0)
    assert est.breakdown_mib == {"params": 4.0, "grads": 4.0, "optimizer": 4.0, "activations": 4.0}
    assert est.flops_per_step == 77 and est.rank == 1
    assert est.note == "zero1 cannot run under FakeTensorMode (TypeError: wrapper refuses fake tensors)"


def test_without_analytic_states_a_strategys_failure_is_raised(base_cfg, runs):
    def outcome(cfg, clip):
        raise TypeError("wrapper refuses fake tensors")

    runs(outcome)
    with pytest.raises(TypeError):
        fake_step(job(base_cfg, "zero1"), 2, 0)


def test_a_trace_only_step_of_a_strategy_that_cannot_run_fake_is_raised_not_drawn_from_ddps(base_cfg, runs):
    """The fallback is a memory figure (analytic states over DDP's activations): a step
    without memory tracking has nothing to take from it, so the failure is raised."""

    def outcome(cfg, clip):
        raise TypeError("wrapper refuses fake tensors")

    calls = runs(outcome)
    states = {"ddp": {"params": 4.0}, "zero1": {"params": 4.0}}
    with pytest.raises(TypeError, match="wrapper refuses"):
        fake_step(job(base_cfg, "zero1"), 2, 0, states_mib=states.__getitem__, trace=True, memory=False)
    assert [c[0] for c in calls] == ["zero1"]


def test_cpu_offload_is_faked_on_the_device_and_the_callers_config_kept(base_cfg, runs):
    calls = runs(lambda cfg, clip: RESULT)
    cfg = job(base_cfg, "fsdp", cpu_offload=True)
    fake_step(cfg, 2, 0)
    assert calls == [("fsdp", 0.0, False)]
    assert cfg.strategy.cpu_offload is True


# ------------------------------------------------------------------ real fake steps
MLP_PARAMS = (64 * 16 + 16) + 2 * 16 + (16 * 16 + 16) + 2 * 16 + (16 * 10 + 10)  # Linear, LayerNorm, ..., head


def test_the_probe_is_one_sample_on_meta_made_once_per_config(base_cfg):
    probe = _probe(base_cfg.data, base_cfg.model)
    sample, padded = probe
    assert sample["inputs"].shape == (1, 64) and sample["inputs"].device.type == "meta"
    assert sample["targets"].dtype == torch.int64
    assert padded is True  # the teacher's batches say nothing of padding: the default
    assert _probe(base_cfg.data, base_cfg.model) is probe


def test_a_ddp_fake_step_holds_the_whole_model_and_counts_the_mlps_flops(base_cfg):
    est = fake_step(job(base_cfg), 2, 0)
    assert est.method == "fake step" and est.rank == 0
    assert est.breakdown_mib["params"] * MIB == MLP_PARAMS * 4
    assert est.breakdown_mib["grads"] * MIB == MLP_PARAMS * 4
    assert est.breakdown_mib["buckets"] * MIB == MLP_PARAMS * 4  # DDP's gradient bucket, not a view
    # 2 FLOPs per multiply-add forward, twice that backward, but no gradient of the input
    macs = 64 * 16 + 16 * 16 + 16 * 10
    assert est.flops_per_step == 4 * (6 * macs - 2 * 64 * 16)
    assert set(est.extra["phases"]) == {"step", "optimizer"} and est.extra["gloo_reduce_scatters"] == 0


TINY_GPT = ["model=gpt", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=8",
            "model.vocab_size=64", "trainer.batch_size=2", "trainer.activation_checkpointing=full"]  # fmt: skip


@pytest.mark.parametrize(
    "model, strategy, device_type",
    [("mlp", "ddp", "cpu"), ("gpt", "ddp", "cuda")],  # a CPU step; CUDA's kernels, AC and the allocator
)
def test_a_trace_only_step_records_the_same_ops_and_flops_without_tracking_memory(
    base_cfg, monkeypatch, model, strategy, device_type
):
    """The speed columns' step (memory=False) runs the same steps as the full one and records
    the same ops and FLOPs, but makes no memory tracker and records nothing for the allocator
    (their figures it would throw away)."""
    from sharded_exp.compose import compose

    made = {"trackers": 0, "recordings": 0}

    def counted(fn, key):
        def call(*args, **kwargs):
            made[key] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(module, "peak_tracker", counted(module.peak_tracker, "trackers"))
    monkeypatch.setattr(module, "recording", counted(module.recording, "recordings"))
    cfg = job(base_cfg, strategy) if model == "mlp" else job(compose(TINY_GPT), strategy)
    full = fake_step(cfg, 1, 0, device_type, trace=True)
    assert made == {"trackers": 1, "recordings": 1}  # the full step tracks: the counters count
    only = fake_step(cfg, 1, 0, device_type, trace=True, memory=False)
    assert made == {"trackers": 1, "recordings": 1}  # none made for the trace-only step
    assert only.extra["trace"].records == full.extra["trace"].records and len(full.extra["trace"].records) > 50
    assert only.extra["trace"].units == full.extra["trace"].units
    assert only.flops_per_step == full.flops_per_step > 0 and only.method == full.method == "fake step"
    assert only.breakdown_mib == {} and only.peak_mib != only.peak_mib  # NaN: no memory figure
    assert "alloc_events" not in only.extra and ("alloc_events" in full.extra) == (device_type == "cuda")


def test_a_step_that_tracks_no_memory_must_trace(base_cfg):
    with pytest.raises(ValueError, match="memory=False, trace=False.*pass trace=True"):
        fake_step(job(base_cfg), 1, 0, memory=False)


# ------------------------------------------------------- a parameter made in forward
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_parameter_made_in_forward_is_refused_naming_it(tiny_job, strategy):
    """Under ddp such a parameter is silently never trained; under fsdp the ranks die with
    torch's "mixed torch.Tensor and DTensor". Both are refused from the fake step."""
    from sharded_exp.compose import compose
    from sharded_exp.errors import ConfigError

    cfg = compose(["model=custom", "model._target_=tests.helpers.user_models.build_parameter_in_forward",
                   f"strategy={strategy}", "trainer.batch_size=4"])  # fmt: skip
    with pytest.raises(ConfigError, match=rf"model=custom: its forward creates the parameter late_scale .*"
                                          rf"strategy={strategy} it is never trained"):  # fmt: skip
        fake_step(cfg, 2, 0, states_mib=lambda name: {})  # no fallback hides it either


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_model_failing_in_its_forward_is_blamed_for_its_own_error(tiny_job, strategy):
    """Not for parameters its forward created: under fsdp, a unit's gathered parameters stand
    in for its sharded ones while its forward runs, and the failure leaves them there."""
    from sharded_exp.compose import compose

    cfg = compose(["model=custom", "model._target_=tests.helpers.user_models.build_fails",
                   f"strategy={strategy}", "trainer.batch_size=4"])  # fmt: skip
    with pytest.raises(FakeStepError, match="the model cannot run under FakeTensorMode: ValueError: cannot handle"):
        fake_step(cfg, 2, 0)


def test_refusing_parameters_made_in_forward_names_every_new_one_and_passes_the_built_ones():
    from sharded_exp.errors import ConfigError
    from sharded_exp.predict.fake_step import refuse_parameters_made_in_forward

    model = nn.Sequential(nn.Linear(2, 2))
    known = {name: id(param) for name, param in model.named_parameters()}
    refuse_parameters_made_in_forward(model, known, "mine", "ddp")  # nothing new: passes
    built = model[0].weight
    model[0].weight = nn.Parameter(torch.ones(2, 2))  # a new one under a built one's name
    with pytest.raises(ConfigError, match=r"model=mine: its forward creates the parameter 0.weight \(not"):
        refuse_parameters_made_in_forward(model, known, "mine", "ddp")  # after a step that ran
    # after a step that failed inside an FSDP2 unit, whose gathered parameters stand in: passes
    refuse_parameters_made_in_forward(model, known, "mine", "fsdp", failed=True)
    model[0].weight = built
    model.a = nn.Parameter(torch.ones(1))
    model[0].b = nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match=r"model=mine: its forward creates the parameters a, 0.b \(not"):
        refuse_parameters_made_in_forward(model, known, "mine", "ddp")


def test_the_fake_step_quiets_only_mod_trackers_file_a_bug_warning():
    import warnings

    from torch.distributed._tools.mod_tracker import ModTracker

    class Twice(nn.Module):
        """Enters itself again before it leaves: ModTracker's warning."""

        def forward(self, x, again=True):
            return self(x, again=False) if again else x * 2

    def run(quiet) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet, ModTracker():
                Twice()(torch.ones(2, requires_grad=True))
                warnings.warn("another warning", UserWarning)
        return [str(w.message) for w in seen]

    formatwarning = warnings.formatwarning
    # torch still warns on its own (and replaces the format)
    assert any("Please file a bug to PyTorch" in m for m in run(contextlib.nullcontext()))
    warnings.formatwarning = formatwarning
    assert run(module._mod_tracker_warning_quiet()) == ["another warning"]
    assert warnings.formatwarning is formatwarning


# ------------------------------------------- a Hugging Face model's attention, real and fake
class SdpaCalls:
    """Each ``F.scaled_dot_product_attention`` call's (is_causal, the mask's shape or None),
    while the context is entered: a wrapper put in ``torch.nn.functional`` (transformers looks
    the function up there at each call).

    Not a torch-function mode: every gloo work issued under a Python mode keeps the thread
    state it was issued in, the mode among it, and gloo's own thread needs the GIL to let it
    go. Recording a real step so, this test hung CI (stop 55): the DDP model's destructor
    destroyed the group and joined gloo's thread while holding the GIL that thread waited for."""

    def __init__(self):
        self.calls: list[tuple[bool, tuple | None]] = []
        self._real = None

    def __enter__(self):
        self._real = real = F.scaled_dot_product_attention

        def recorded(*args, **kwargs):
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
            self.calls.append((causal, None if mask is None else tuple(mask.shape)))
            return real(*args, **kwargs)

        F.scaled_dot_product_attention = recorded
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._real


SMALL_HF = {
    "hf_llama": ["model.config.num_hidden_layers=1", "model.config.hidden_size=32", "model.config.intermediate_size=64"],
    "hf_gpt2": ["model.config.n_layer=1", "model.config.n_embd=32"],
    "hf_bert": ["model.config.num_hidden_layers=1", "model.config.hidden_size=32", "model.config.intermediate_size=64"],
}  # fmt: skip
"""One-block Hugging Face models of each kind: two causal LMs on batches without padding
(data=causal_lm) and a token classifier on padded batches (data=token_classification)."""


def _real_sdpa_calls(cfg, steps: int) -> list:
    """The attention calls of ``steps`` real CPU training steps of ``cfg`` (world size 1)."""
    from sharded_exp.train.build import build_run
    from sharded_exp.train.step import train_step

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = build_run(cfg, torch.device("cpu"))
        recorder = SdpaCalls()
        with recorder:
            for step in range(steps):
                train_step(run.strategy, [run.task(step, 0, 0)], run.autocast, 0.0)
        del run  # the DDP model goes while the group is registered: destroying it then destroys no group
    finally:
        dist.destroy_process_group()
    return recorder.calls


@pytest.mark.parametrize("model", list(SMALL_HF))
def test_a_hugging_face_models_fake_step_calls_attention_as_its_real_step_does(model):
    """transformers reads the attention_mask's values to choose SDPA's path: on a batch with
    no padding a causal LM gets is_causal=True and no mask, on a padded one a batch x 1 x seq
    x seq mask. A fake mask has no values: the fake step must still take the real run's path
    (before it did not: non-causal with a mask, for every causal LM). Checked on CPU, and in a
    step faked for CUDA by the causal flag its op trace prices attention with."""
    from sharded_exp.compose import compose

    cfg = compose([f"model={model}", "model.seq_len=16", *SMALL_HF[model], "trainer.batch_size=2"])
    real = _real_sdpa_calls(cfg, steps=2)  # the fake step's two
    assert real, "the model calls no SDPA: nothing compared"
    fake = SdpaCalls()
    with fake:
        fake_step(cfg, 1, 0, "cpu", flops=False)
    assert fake.calls == real
    traced = fake_step(cfg, 1, 0, "cuda", flops=False, trace=True).extra["trace"].records
    forwards = [r["causal"] for r in traced if r["op"] == "attention.forward"]
    assert forwards == [causal for causal, _ in real[: len(real) // 2]]  # the steady (second) step's
    assert all(causal == (mask is None) for causal, mask in real)  # causal exactly where there is no mask
    assert any(mask is None for _, mask in real) == (model != "hf_bert")  # one path of each kind held


def test_unpadded_masks_answer_transformers_mask_rule_only_for_a_fake_mask_of_a_task_that_never_pads():
    from transformers import masking_utils

    real_ones, fake_zeros = torch.ones(2, 8, dtype=torch.bool), None
    with FakeTensorMode():
        fake_zeros = torch.zeros(2, 8, dtype=torch.bool)
    rule = masking_utils._ignore_causal_mask_sdpa
    assert rule(fake_zeros, 8, 8, 0, 0) is False  # transformers cannot read a fake mask: it builds one
    with module.unpadded_masks(padded=True):
        assert masking_utils._ignore_causal_mask_sdpa(fake_zeros, 8, 8, 0, 0) is False
    with module.unpadded_masks(padded=False):
        assert masking_utils._ignore_causal_mask_sdpa(fake_zeros, 8, 8, 0, 0) is True
        assert masking_utils._ignore_causal_mask_sdpa(fake_zeros, 4, 8, 4, 0) is False  # its own rule decides the rest
        assert masking_utils._ignore_causal_mask_sdpa(fake_zeros, 8, 8, 0, 0, local_attention_size=4) is False
        assert masking_utils._ignore_bidirectional_mask_sdpa(fake_zeros, 8) is True
        assert bool(masking_utils._ignore_causal_mask_sdpa(~real_ones, 8, 8, 0, 0)) is False  # a real mask: its values
    assert masking_utils._ignore_causal_mask_sdpa is rule


def _strict_attention_formulas(monkeypatch) -> None:
    """torch's attention FLOP formulas made as strict as before torch 2.13: key/value heads as
    many as the query's, else an AssertionError (2.11's message)."""
    from torch.utils import flop_counter

    def strict(formula):
        def count(*shapes):
            if len({shape[1] for shape in shapes}) > 1:
                raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
            return formula(*shapes)

        return count

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", strict(flop_counter.sdpa_flop_count))
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", strict(flop_counter.sdpa_backward_flop_count))


def test_grouped_query_attention_is_counted_as_torch_2_13_counts_it_where_torch_refuses_it(monkeypatch):
    """Before torch 2.13 the attention FLOP formulas refuse fewer key/value heads than query
    heads (every fake step of a Llama with grouped-query attention failed). Simulated: the
    formulas made strict as they were; inside the fake step's rule they count the heads
    broadcast, the FLOPs 2.13's own formulas give, and are put back after."""
    from torch.utils import flop_counter

    from sharded_exp.predict.fake_step import _gqa_attention_flops, _gqa_refused

    q, kv = (2, 8, 16, 32), (2, 2, 16, 32)  # 8 query heads share 2 key/value heads
    forward, backward = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count
    expected = (forward(q, q, q), backward(q, q, q, q))  # the key/value heads repeated
    if not _gqa_refused():  # torch 2.13 on: its own formulas, aware of the groups, count the same
        assert (forward(q, kv, kv), backward(q, q, kv, kv)) == expected

    _strict_attention_formulas(monkeypatch)
    refused = flop_counter.sdpa_flop_count
    with pytest.raises(AssertionError):
        flop_counter.sdpa_flop_count(q, kv, kv)
    with _gqa_attention_flops():
        assert (
            flop_counter.sdpa_flop_count(q, kv, kv),
            flop_counter.sdpa_backward_flop_count(q, q, kv, kv),
        ) == expected
    assert flop_counter.sdpa_flop_count is refused


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_grouped_query_models_fake_step_counts_its_flops_where_torchs_formulas_refuse_it(monkeypatch, device):
    """A Llama whose 4 query heads share 2 key/value heads, its step's FLOPs counted (the
    speed columns' trace too) with torch's attention formulas made as strict as before torch
    2.13: the same count as with them as they are. Every place that counts attention goes
    through the rule: FlopCounterMode's registry, the CPU's fused attention's formulas
    (sharded_exp.measure.flops) and CUDA's emulated kernels."""

    from sharded_exp.compose import compose

    cfg = compose(["model=hf_llama", "model.seq_len=16", "model.config.num_key_value_heads=2", "trainer.batch_size=2"])
    expected = fake_step(cfg, 1, 0, device, flops=True).flops_per_step

    _strict_attention_formulas(monkeypatch)
    assert expected > 0 and fake_step(cfg, 1, 0, device, flops=True).flops_per_step == expected
    traced = fake_step(cfg, 1, 0, device, flops=False, trace=True, memory=False).extra["trace"].records
    assert sum(r["flops"] for r in traced) > 0
