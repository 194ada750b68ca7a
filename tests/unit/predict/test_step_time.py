"""A step's predicted time: the trace priced per unit, the strategy's collectives scheduled."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sharded_exp.predict.op_trace import Trace
from sharded_exp.predict.prediction import ModelShapes
from sharded_exp.predict.step_time import (
    Machine,
    StepCompute,
    predict_step_time,
    run_step_time,
    split_backward,
    step_compute,
)
from sharded_exp.speed import collectives
from sharded_exp.speed.profiles import load_device, load_link, network_link
from sharded_exp.strategies import STRATEGIES

H100 = load_device("h100_sxm")


def record(op, flops, phase, unit=None, nbytes=1e6):
    return {"op": op, "flops": flops, "input_bytes": nbytes, "output_bytes": nbytes, "dtype": "bf16",
            "backward": phase == "backward", "unit": unit}  # fmt: skip


def trace(units=2):
    """An embedding, one matmul per unit, the head; the backward twice the forward; a step."""
    records = [record("aten.embedding.default", 0, "forward")]
    records += [record("aten.mm.default", 1e12, "forward", u) for u in range(units)]
    records += [record("aten.mm.default", 1e12, "forward")]
    records += [record("aten.mm.default", 2e12, "backward") for _ in range(units + 1)]
    records += [record("aten.add_.Tensor", 0, "forward")]  # after the last backward op: the optimizer's
    return Trace(records, units)


def test_the_forward_is_per_unit_with_the_root_at_both_ends_and_the_backward_in_proportion():
    compute = step_compute(trace(), H100, 6e12)
    matmul = 1e12 / H100.matmul_flops_per_s("bf16")
    assert compute.forward_s[0] == pytest.approx(matmul + 2e6 / H100.memory_bandwidth_Bps)  # + the embedding
    assert compute.forward_s[1] == pytest.approx(2 * matmul)  # its unit and the head
    assert sum(compute.backward_s) == pytest.approx(6 * matmul)
    # the matmuls' backward follows the matmuls' forward (1 : 2), not all ops' (the embedding's too)
    assert compute.backward_s[0] / compute.backward_s[1] == pytest.approx(1 / 2)
    assert compute.optimizer_s == pytest.approx(2e6 / H100.memory_bandwidth_Bps)


def test_each_op_class_backward_follows_its_own_forward():
    """A unit whose forward is all attention gets all of attention's backward, none of the
    matmuls' (a layer's backward is a larger multiple of its forward than the head's)."""
    backward = {"matmul": 6.0, "attention": 4.0, "other": 0.0}
    forward = {"matmul": [1.0, 0.0, 2.0], "attention": [0.0, 1.0, 0.0], "other": [0.0, 0.0, 0.0]}
    assert split_backward(backward, forward, 3) == pytest.approx((2.0, 4.0, 4.0))
    # a class with no forward at all (nothing to follow) is spread evenly
    assert split_backward({"other": 3.0}, {"other": [0.0, 0.0, 0.0]}, 3) == pytest.approx((1.0, 1.0, 1.0))


def test_the_hosts_cost_per_op_adds_on_a_cpu_and_overlaps_on_a_gpu():
    from dataclasses import replace

    kernel = step_compute(trace(), H100, 6e12)
    host = {"fp32": 1e-3, "bf16": 2e-3}
    cpu = step_compute(trace(), replace(H100, step_op_overhead_s=host), 6e12, "bf16")
    gpu = step_compute(trace(), replace(H100, step_op_overhead_s=host, asynchronous=True), 6e12, "bf16")
    assert cpu.forward_s[0] == pytest.approx(
        kernel.forward_s[0] + 2 * 2e-3
    )  # the embedding and a matmul, each + bf16's
    assert cpu.optimizer_s == pytest.approx(kernel.optimizer_s + 1e-3)  # the optimizer's op pays fp32's
    # launched ahead: the embedding (launched at 2 ms, a kernel of microseconds), then unit 0's
    # matmul (launched at 4 ms; its kernel, m = 1.26 ms, ends at 4 ms + m): the unit's share
    matmul = 1e12 / H100.matmul_flops_per_s("bf16")
    step = 2e6 / H100.memory_bandwidth_Bps  # the optimizer op's kernel
    assert 1e-3 < matmul < 2e-3
    assert gpu.forward_s[0] == pytest.approx(4e-3 + matmul)
    # the forward's matmuls launch every 2 ms and end before the next (m < 2 ms); the backward's
    # three (2m each, launched at 10, 12 and 14 ms) queue behind each other from 10 ms (2m > 2
    # ms), and the optimizer's op, launched at 15 ms, after them: the step ends at 10 ms + 6m + its kernel
    total = sum(gpu.forward_s) + sum(gpu.backward_s) + gpu.optimizer_s
    assert total == pytest.approx(10e-3 + 6 * matmul + step)
    assert gpu.optimizer_s == pytest.approx(step)  # its launch hidden under the backward


def test_a_host_that_launches_ahead_hides_its_launches_under_a_long_kernel():
    """A 100 us matmul, then three 5 us ops, each op 25 us of host: the matmul runs 25-125 us,
    the next three launch at 50, 75 and 100 us and run after it, 5 us each: 140 us, where each
    op's larger figure summed says 175. A launch-bound run is the host's costs summed, a
    compute-bound one its kernels' after the first launch."""
    from sharded_exp.predict.step_time import launched_ahead

    shares = launched_ahead([25e-6] * 4, [100e-6, 5e-6, 5e-6, 5e-6])
    assert shares == pytest.approx([125e-6, 5e-6, 5e-6, 5e-6]) and sum(shares) == pytest.approx(140e-6)
    assert sum(launched_ahead([10e-6] * 5, [1e-6] * 5)) == pytest.approx(50e-6 + 1e-6)
    assert sum(launched_ahead([1e-6] * 5, [10e-6] * 5)) == pytest.approx(1e-6 + 50e-6)
    # the host waits for the device (130 us) before launching op 2 (a value read back): op 2
    # launches at 155 and ends at 160, op 3 launches at 180 and ends at 185
    waited = launched_ahead([25e-6] * 4, [100e-6, 5e-6, 5e-6, 5e-6], waits={2})
    assert waited == pytest.approx([125e-6, 5e-6, 30e-6, 25e-6])


def test_precision_16_waits_for_the_backward_before_its_optimizer_step():
    """GradScaler reads its inf check from the device before stepping: the optimizer's op is
    launched once the backward has ended (10 ms + 6m), 1 ms of host later, not hidden under it."""
    from dataclasses import replace

    from sharded_exp.predict.step_time import waits_before_step

    assert [waits_before_step(OmegaConf.create({"precision": {"name": p}})) for p in ("16", "bf16", "32")] == [
        True, False, False]  # fmt: skip
    device = replace(H100, step_op_overhead_s={"fp32": 1e-3, "bf16": 2e-3}, asynchronous=True)
    free = step_compute(trace(), device, 6e12, "bf16")
    waits = step_compute(trace(), device, 6e12, "bf16", waits_before_step=True)
    assert waits.optimizer_s == pytest.approx(free.optimizer_s + 1e-3)  # its host cost, no longer hidden
    assert waits.forward_s == free.forward_s and waits.backward_s == free.backward_s
    cpu = replace(device, asynchronous=False)  # on a CPU every op waits anyway: no change
    assert step_compute(trace(), cpu, 6e12, "bf16", waits_before_step=True) == step_compute(trace(), cpu, 6e12, "bf16")


def test_a_step_of_fsdp2_sharded_parameters_pays_the_sharded_host_cost_per_op():
    from dataclasses import replace

    device = replace(H100, step_op_overhead_s={"fp32": 1e-3, "bf16": 1e-3}, sharded_step_op_overhead_s={"bf16": 5e-3})
    plain = step_compute(trace(), device, 6e12, "bf16")
    sharded = step_compute(trace(), device, 6e12, "bf16", sharded_parameters=True)
    assert sharded.forward_s[0] == pytest.approx(plain.forward_s[0] + 2 * 4e-3)  # two ops, 4 ms more each
    assert sharded.optimizer_s == pytest.approx(plain.optimizer_s)  # fp32 was not measured sharded: the plain figure


@pytest.mark.parametrize(
    "strategy, sharded", [("ddp", False), ("zero1", False), ("fsdp", True), ("fsdp_grad_op", True)]
)
def test_fsdp2_strategies_are_the_ones_priced_as_sharded_parameters(strategy, sharded):
    from sharded_exp.predict.step_time import shards_parameters

    assert shards_parameters(OmegaConf.create({"strategy": {"name": strategy}})) is sharded


def test_a_deep_model_repeats_the_middle_units_and_scales_its_flops():
    shallow = StepCompute((1.0, 2.0, 2.0, 1.5), (2.0, 4.0, 4.0, 3.0), 0.5, 100.0)
    deep = shallow.at_depth(6)
    assert deep.forward_s == (1.0, 2.0, 2.0, 2.0, 2.0, 1.5) and deep.backward_s[1:5] == (4.0,) * 4
    assert deep.model_flops == pytest.approx(100.0 * 10.5 / 6.5)
    assert shallow.optimizer_scaled(0.25).optimizer_s == 0.125
    # with the trace's FLOPs per unit, a deep model's FLOPs follow them, not the seconds: a
    # memory-bound root (long, few FLOPs) does not stand in for the blocks' FLOPs
    counted = StepCompute((1.0, 2.0, 2.0, 1.5), (2.0, 4.0, 4.0, 3.0), 0.5, 100.0, (10.0, 40.0, 40.0, 10.0))
    assert counted.at_depth(6).model_flops == pytest.approx(100.0 * 180.0 / 100.0)
    assert counted.at_depth(6).forward_flops == (10.0, 40.0, 40.0, 40.0, 40.0, 10.0)
    # step_compute fills them from the trace's records (the root's with the first and last unit)
    assert step_compute(trace(), H100, 6e12).forward_flops == (1e12, 2e12)  # unit 1 and the head


def cfg(strategy="ddp", batch=4, seq=128):
    return OmegaConf.create({"strategy": OmegaConf.structured(STRATEGIES.config_class(strategy)()),
                             "precision": {"name": "bf16"}, "trainer": {"batch_size": batch, "grad_accum": 2},
                             "model": {"seq_len": seq}, "data": {}})  # fmt: skip


SHAPES = ModelShapes([[(10**9,)]], [4 * 10**8, 4 * 10**8], 2 * 10**8, {})


def machine(per_node=8):
    return Machine(H100, load_link("nvlink4"), network_link(100), per_node)


def test_a_point_has_its_step_its_exposed_communication_throughput_and_mfu():
    compute = step_compute(trace(), H100, 6e12)
    one = predict_step_time(cfg(), 1, compute, SHAPES, machine())
    eight = predict_step_time(cfg(), 8, compute, SHAPES, machine())
    assert one["exposed_comm_s"] == pytest.approx(0.0, abs=1e-12) and one["comm_s"] == 0.0
    assert eight["step_time_s"] > one["step_time_s"] and eight["exposed_comm_s"] > 0
    assert eight["tokens_per_s_per_device"] == pytest.approx(4 * 2 * 128 / eight["step_time_s"])
    assert one["mfu_pct"] == pytest.approx(100 * 6e12 / (one["step_time_s"] * H100.peak_flops_per_s("bf16")))
    # across nodes over 100 Gb/s the all-reduce is slower than over NVLink
    assert predict_step_time(cfg(), 16, compute, SHAPES, machine(per_node=8))["comm_s"] > eight["comm_s"]


def test_a_model_without_a_sequence_has_samples_not_tokens():
    out = predict_step_time(cfg(seq=None), 2, step_compute(trace(), H100, 6e12), SHAPES, machine())
    assert out["tokens_per_s_per_device"] is None and out["samples_per_s_per_device"] > 0


def test_a_run_without_a_trace_gets_null_and_why():
    class Est:
        extra, method, flops_per_step = {}, "fake step", 0

    for device in ("cpu", "cuda"):
        assert run_step_time(cfg(), 2, device, Est(), SHAPES, {}) == {
            "step_time_s": None,
            "error": "no op trace (fake step)",
        }


def test_a_gpu_run_is_priced_on_its_measured_gpu_and_its_sourced_link(monkeypatch):
    from sharded_exp.measure import machine as this

    class Est:
        extra, method, flops_per_step = {"trace": trace()}, "fake step", 6e12

    gpu = H100.__class__(**{**H100.__dict__, "name": "this", "title": "this machine (NVIDIA H100 80GB HBM3)"})
    monkeypatch.setattr(this, "this_cuda_profile", lambda remeasure=False: gpu)
    monkeypatch.setattr(this, "this_cuda_host_link", lambda remeasure=False: None)
    one = run_step_time(cfg(), 1, "cuda", Est(), SHAPES, {})
    two = run_step_time(cfg(), 2, "cuda", Est(), SHAPES, {})
    assert one["error"] is None and one["comm_s"] == 0.0 and one["profile"] == "this"
    assert two["comm_s"] > 0  # over the H100 SXM's NVLink 4, as its profile states
    unknown = H100.__class__(**{**H100.__dict__, "title": "this machine (Some GPU)"})
    monkeypatch.setattr(this, "this_cuda_profile", lambda remeasure=False: unknown)
    assert run_step_time(cfg(), 1, "cuda", Est(), SHAPES, {})["error"] is None  # one GPU needs no link
    refused = run_step_time(cfg(), 2, "cuda", Est(), SHAPES, {})
    assert refused["step_time_s"] is None and "no sourced link profile for this machine (Some GPU)" in refused["error"]


def test_a_cpu_step_pays_for_the_pages_of_each_block_glibc_maps_anew(monkeypatch):
    """Blocks of at least the rank's mmap threshold are new pages every step, priced at the
    profile's measured cost of a new page; smaller ones come from the heap and cost nothing."""
    from dataclasses import replace

    from sharded_exp.predict import step_time

    monkeypatch.setattr(step_time, "mapped_from", lambda rule: (4 if rule == "fixed" else 32) * 2**20)
    fresh = trace()
    fresh.records[1]["fresh_bytes"] = (8 * 2**20, 2**20)  # unit 0's matmul: one block mapped, one from the heap
    page = 1e-6
    plain = step_compute(fresh, H100, 6e12)
    priced = step_compute(fresh, replace(H100, fresh_page_s=page), 6e12, malloc="fixed")
    pages = -(-(8 * 2**20 + 16) // step_time.mmap.PAGESIZE)
    assert priced.forward_s[0] == pytest.approx(plain.forward_s[0] + pages * page)
    assert priced.forward_s[1:] == plain.forward_s[1:] and priced.optimizer_s == plain.optimizer_s
    # trainer.host_mmap_threshold=reuse (the default) or dynamic: glibc maps anew only above 32 MiB, so the 8 MiB block is free
    dynamic = step_compute(fresh, replace(H100, fresh_page_s=page), 6e12)
    assert dynamic.forward_s == plain.forward_s
    on_gpu = step_compute(fresh, replace(H100, fresh_page_s=page, asynchronous=True), 6e12, malloc="fixed")
    assert on_gpu.forward_s == step_compute(fresh, replace(H100, asynchronous=True), 6e12).forward_s


def test_a_cpu_run_records_the_pages_it_prices(monkeypatch):
    """``fresh_pages_per_step`` is the count the step is priced for: the pages of each block at
    or above the threshold in force, none below it; None where glibc's rule is not modelled."""
    from sharded_exp.predict import step_time

    monkeypatch.setattr(step_time, "mapped_from", lambda rule: (4 if rule == "fixed" else 32) * 2**20)
    fresh = trace()
    fresh.records[1]["fresh_bytes"] = (8 * 2**20, 2**20)
    fresh.records[2]["fresh_bytes"] = (40 * 2**20,)
    page = step_time.mmap.PAGESIZE
    assert step_time.fresh_pages(fresh, "fixed") == -(-(8 * 2**20 + 16) // page) + -(-(40 * 2**20 + 16) // page)
    assert (
        step_time.fresh_pages(fresh, "reuse")
        == step_time.fresh_pages(fresh, "dynamic")
        == -(-(40 * 2**20 + 16) // page)
    )
    monkeypatch.setattr(step_time, "mapped_from", lambda rule: None)  # not glibc
    assert step_time.fresh_pages(fresh, "fixed") is None


def test_accumulated_micro_batches_gather_each_time_and_reduce_once():
    """grad_accum 2 against one micro-batch of the same samples (the same trace): FSDP2
    gathers every unit's parameters in each micro-batch (forward and, resharded, backward)
    and reduce-scatters once, so its link carries two more gathers a unit; DDP all-reduces
    once, its buckets hidden under the last micro-batch's backward only."""
    compute = step_compute(trace(), H100, 6e12)
    single = lambda name: OmegaConf.merge(cfg(name, batch=8), {"trainer": {"grad_accum": 1}})
    fsdp, fsdp_one = (predict_step_time(c, 8, compute, SHAPES, machine()) for c in (cfg("fsdp"), single("fsdp")))
    topology = machine().fabric(8).topology  # each unit's gather in bf16: unit 0 holds the root's 2e8
    gathers = sum(collectives.group_time("all_gather", n * 2.0, 8, topology) for n in (6 * 10**8, 4 * 10**8))
    assert fsdp["comm_s"] == pytest.approx(fsdp_one["comm_s"] + 2 * gathers)
    assert fsdp["compute_s"] == pytest.approx(fsdp_one["compute_s"])
    ddp, ddp_one = (predict_step_time(c, 8, compute, SHAPES, machine()) for c in (cfg("ddp"), single("ddp")))
    assert ddp["comm_s"] == pytest.approx(ddp_one["comm_s"]) and ddp["exposed_comm_s"] > ddp_one["exposed_comm_s"]


def test_on_a_cpus_shared_cores_every_collective_is_exposed():
    """A CPU machine (its ranks' threads fill the cores): the same FSDP2 step exposes all its
    communication, where the GPU's streams hide most of it under the compute."""
    from dataclasses import replace

    compute = step_compute(trace(), H100, 6e12)
    gpu = predict_step_time(cfg("fsdp"), 8, compute, SHAPES, machine())
    cpu = predict_step_time(cfg("fsdp"), 8, compute, SHAPES, replace(machine(), shared_cores=True))
    assert gpu["exposed_comm_s"] < gpu["comm_s"]
    assert cpu["exposed_comm_s"] == pytest.approx(cpu["comm_s"]) and cpu["comm_s"] == pytest.approx(gpu["comm_s"])
    assert cpu["step_time_s"] == pytest.approx(cpu["compute_s"] + cpu["comm_s"])


def test_frozen_parameters_carry_no_gradient_over_the_link():
    """Unit 0 and the root frozen (trainer.freeze): DDP all-reduces unit 1's 4e8 gradients,
    not all 1e9 parameters' (the reduce is bandwidth-bound at this size: 0.4 of the time)."""
    compute = step_compute(trace(), H100, 6e12)
    frozen = ModelShapes([[(4 * 10**8,)]], SHAPES.blocks, SHAPES.root, {}, trainable_blocks=[0, 4 * 10**8],
                         trainable_root=0)  # fmt: skip
    one = OmegaConf.merge(cfg("ddp"), {"trainer": {"grad_accum": 1}})
    all_ = predict_step_time(one, 8, compute, SHAPES, machine())["comm_s"]
    assert predict_step_time(one, 8, compute, frozen, machine())["comm_s"] == pytest.approx(0.4 * all_, rel=0.01)


def test_a_run_across_nodes_is_not_priced():
    """torchrun or SLURM over 2 nodes: a run does not know the link between them (nor, on CPU,
    the other node's cores), so it says so instead of pricing one node's links."""

    class Est:
        extra, method, flops_per_step = {"trace": trace()}, "fake step", 6e12

    for device in ("cpu", "cuda"):
        across = run_step_time(cfg(), 4, device, Est(), SHAPES, {}, local_world_size=2)
        assert across["step_time_s"] is None and "4 ranks, 2 on this node" in across["error"]
        assert "plan.inter_node_gbps" in across["error"]


def _optimizer(grad_clip=0.0, **settings):
    from sharded_exp.config import OptimizerConfig

    return OmegaConf.create({"optimizer": OmegaConf.structured(OptimizerConfig(**settings)),
                             "trainer": {"grad_clip": grad_clip}})  # fmt: skip


@pytest.mark.parametrize(
    "settings, in_place, out_of_place, new",
    [({"name": "adamw", "foreach": False}, 60, 16, 8),
     ({"name": "adamw", "weight_decay": 0.1, "foreach": False}, 68, 16, 8),
     ({"name": "adam", "weight_decay": 0.1, "foreach": False}, 60, 28, 12), ({"name": "sgd", "foreach": False}, 12, 0, 0),
     ({"name": "sgd", "momentum": 0.9, "foreach": False}, 32, 0, 0),
     ({"name": "adamw", "weight_decay": 0.01, "grad_clip": 1.0}, 76, 20, 8),
     ({"name": "adamw", "weight_decay": 0.01, "grad_clip": 1.0, "foreach": True}, 84, 12, 4)],
)  # fmt: skip
def test_the_host_step_counts_the_optimizers_own_ops_per_element(settings, in_place, out_of_place, new):
    """fp32 bytes per element (inputs read plus the tensor written) of torch's loops, the steady
    step. Per tensor (``_single_tensor_adamw``), in place: exp_avg.lerp_(grad) 12,
    exp_avg_sq.mul_(beta2) 8, .addcmul_(grad, grad) 16, denom.add_(eps) 8,
    param.addcdiv_(exp_avg, denom) 16 = 60; out of place: exp_avg_sq.sqrt() 8, the bias
    correction's div 8 = 16. AdamW's decay param.mul_ 8 more in place; Adam's grad.add(param)
    12 more out of place. SGD: param.add_(grad) 12; with momentum buf.mul_ 8, buf.add_(grad)
    12, param.add_(buf) 12 = 32. As an offloaded run builds it (per tensor, torch's choice for
    host tensors), with decay and clipping (the default): the norm reads the gradient (4 out of
    place), the clip's mul_ 8 in place: 76 and 20. Foreach: the clip's _foreach_mul_ and the
    bias correction's _foreach_div_ in place (8 moved from out of place): 84 and 12. Written
    into new tensors: the square root's and the division's 4 each (8), Adam's decayed gradient
    4 more (12); foreach divides in place (4); SGD none."""
    from sharded_exp.predict.step_time import HostStepBytes, host_step_bytes

    assert host_step_bytes(_optimizer(**settings)) == HostStepBytes(in_place, out_of_place, new)


def test_an_offloaded_point_is_priced_with_its_copies_and_its_host_step():
    """fsdp with cpu_offload on the H100's sourced host memory: 563.2 GB/s over 2 sockets, each
    serving 4 of the node's 8 GPUs: 70.4 GB/s a rank in place, 46.9 (2/3 of it) for a copy.
    1.25e8 trainable elements a rank (1e9 / 8), AdamW without clipping, per tensor (60 bytes
    in place, 16 out): 0.1066 + 0.0426 = 0.1491 s, in place of the device's step, after the
    last gradient's copy. Without the host's figures: null, and why."""
    from dataclasses import replace

    offload = OmegaConf.merge(cfg("fsdp"), _optimizer(name="adamw", foreach=False))
    offload.strategy.cpu_offload = True
    compute = step_compute(trace(), H100, 6e12)
    host = Machine(H100, load_link("nvlink4"), network_link(100), 8, load_link("pcie5"), H100.host_memory)
    out = predict_step_time(offload, 8, compute, SHAPES, host)
    on_device = predict_step_time(cfg("fsdp"), 8, compute, SHAPES, host)
    assert out["error"] is None
    rank = 563.2e9 / 2 / 4
    assert out["optimizer_s"] == pytest.approx(1.25e8 * (60 / rank + 16 / (rank * 2 / 3)))
    assert out["optimizer_s"] == pytest.approx(0.1491, abs=1e-4)
    assert out["step_time_s"] > on_device["step_time_s"] - on_device["optimizer_s"] + out["optimizer_s"]
    missing = predict_step_time(offload, 8, compute, SHAPES, replace(host, host_memory=None))
    assert missing["step_time_s"] is None and "host's memory bandwidth" in missing["error"]


def test_a_gpu_run_with_offload_is_priced_on_its_measured_host(monkeypatch):
    """A CUDA run's prediction under CPU offload takes its host's measured figures (a copy and
    an in-place update on 1 GiB, the pinned copies); without them it is null, and says why.
    Frozen parameters have no optimizer step: half the elements frozen, half the host step."""
    from dataclasses import replace

    from sharded_exp.measure import machine as this
    from sharded_exp.speed.profiles import Figure, HostMemory, Source

    class Est:
        extra, method, flops_per_step = {"trace": trace()}, "fake step", 6e12

    measured = Source("measured", "here", "cache")
    host = HostMemory(Figure(200.0, measured), Figure(300.0, measured))  # GB/s on the whole node
    gpu = replace(H100, name="this", title="this machine (NVIDIA H100 80GB HBM3)", host_memory=host)
    monkeypatch.setattr(this, "this_cuda_profile", lambda remeasure=False: gpu)
    monkeypatch.setattr(this, "this_cuda_host_link", lambda remeasure=False: load_link("pcie5"))
    offload = OmegaConf.merge(cfg("fsdp"), _optimizer(name="sgd", foreach=False))  # 12 bytes in place
    offload.strategy.cpu_offload = True
    out = run_step_time(offload, 2, "cuda", Est(), SHAPES, {})
    assert out["error"] is None  # 2 ranks share the host: 150 GB/s in place each, 5e8 elements a rank
    assert out["optimizer_s"] == pytest.approx(5e8 * 12 / 150e9)
    frozen = ModelShapes([[(10**9,)]], [4 * 10**8, 4 * 10**8], 2 * 10**8, {}, trainable_blocks=[4 * 10**8, 0],
                         trainable_root=10**8)  # fmt: skip
    assert run_step_time(offload, 2, "cuda", Est(), frozen, {})["optimizer_s"] == pytest.approx(2.5e8 * 12 / 150e9)
    monkeypatch.setattr(this, "this_cuda_profile", lambda remeasure=False: replace(gpu, host_memory=None))
    missing = run_step_time(offload, 2, "cuda", Est(), SHAPES, {})
    assert missing["step_time_s"] is None and "host's memory bandwidth" in missing["error"]


def test_a_cpu_run_is_priced_on_the_machine_at_hand(monkeypatch):
    """A CPU run's prediction through its real machine (every rank on this CPU, sharing its
    cores), not null: a regression put a float where the machine's host memory goes, and every
    CPU run's prediction came back null with an AttributeError."""
    from sharded_exp.measure import machine as this

    class Est:
        extra, method, flops_per_step = {"trace": trace()}, "fake step", 6e12

    monkeypatch.setattr(this, "this_profile", lambda threads, remeasure=False: (H100, load_link("pcie4")))
    out = run_step_time(cfg(), 2, "cpu", Est(), SHAPES, {})
    assert out["error"] is None and out["step_time_s"] > 0 and out["comm_s"] > 0


def test_the_host_step_counter_reads_what_each_op_writes_from_its_schema():
    """1,000 fp32 elements a tensor (4,000 bytes): ``torch.mul(a, 2, out=b)`` writes b (a and b
    passed, b written: 12,000 in place); a view moves nothing; ``_foreach_mul_([a, b], 2)``
    writes both tensors of its list and returns nothing (8,000 read, 8,000 written); ``a.sqrt()``
    writes a new tensor (8,000 out of place)."""
    import torch

    from sharded_exp.predict.step_time import _HostBytes

    a, b = torch.ones(1000), torch.ones(1000)
    with _HostBytes() as moved:
        torch.mul(a, 2.0, out=b)
        a.view(10, 100)
        torch._foreach_mul_([a, b], 2.0)
        a.sqrt()
    assert (moved.in_place, moved.out_of_place) == (12_000 + 16_000, 8_000)


def test_the_optimizers_ops_and_the_gradients_zeroing_pay_the_optimizers_host_cost_per_op():
    """On a CPU profile that measured it apart: the optimizer's op at its figure, a zero_ the
    trace marks forward (zero_grad's, at the step's start) too; a forward op at bf16's."""
    from dataclasses import replace

    records = [record("aten.zero_.default", 0, "forward"), *trace().records]
    zeroed = Trace(records, 2)
    kernel = step_compute(zeroed, H100, 6e12)
    cpu = replace(H100, step_op_overhead_s={"fp32": 1e-3, "bf16": 2e-3}, optimizer_op_overhead_s=0.25e-3)
    priced = step_compute(zeroed, cpu, 6e12, "bf16")
    assert priced.optimizer_s == pytest.approx(kernel.optimizer_s + 0.25e-3)
    # unit 0's forward: the zero_ (0.25 ms), the embedding and its matmul (2 ms each)
    assert priced.forward_s[0] == pytest.approx(kernel.forward_s[0] + 0.25e-3 + 2 * 2e-3)
