"""probe/fake.py: a batch kept as shapes and made again on fake tensors, the loss found in a
model's output, what is unwrapped or refused, DDP's extra copies by its rule, and the fake
step's peak of a small model (at least its states; the real model untouched)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from sharded_exp.probe import fake

MIB = 2**20


def test_a_batch_is_kept_as_specs_in_its_own_containers_and_made_again_on_fake_tensors():
    batch = {"x": torch.zeros(2, 3), "pair": (torch.ones(4, dtype=torch.int64), [torch.zeros(1)]), "n": 7}
    spec = fake.describe(batch)
    assert isinstance(spec["x"], fake.Spec) and spec["x"].shape == (2, 3) and spec["n"] == 7
    assert isinstance(spec["pair"], tuple) and isinstance(spec["pair"][1], list)
    with FakeTensorMode():
        made = fake.materialize(spec)
    assert isinstance(made["x"], FakeTensor) and made["x"].shape == (2, 3)
    assert made["pair"][0].dtype == torch.int64 and made["pair"][1][0].shape == (1,) and made["n"] == 7


def test_a_mapping_that_is_no_dict_becomes_a_dict_and_a_namedtuple_is_kept_as_is():
    class Encoding:  # Hugging Face's BatchEncoding: keys() and [] but no dict
        def keys(self):
            return ["input_ids"]

        def __getitem__(self, key):
            return torch.zeros(2, 5, dtype=torch.int64)

    spec = fake.describe(Encoding())
    assert list(spec) == ["input_ids"] and spec["input_ids"].shape == (2, 5)
    pair = namedtuple("Pair", "a b")(torch.zeros(1), 2)
    assert fake.describe(pair) is pair


def test_the_loss_is_the_tensor_its_loss_attribute_or_key_or_its_first_item():
    t = torch.tensor(1.0)
    assert fake.loss_of(t) is t
    assert fake.loss_of({"loss": t, "logits": None}) is t
    assert fake.loss_of(namedtuple("Out", "logits loss")(None, t)) is t
    assert fake.loss_of((t, torch.zeros(2))) is t
    with pytest.raises(TypeError, match="cannot find the loss in a dict"):
        fake.loss_of({"logits": t})
    with pytest.raises(TypeError, match="in a list"):
        fake.loss_of([])


def test_the_default_step_calls_the_model_by_keyword_positionally_or_with_the_batch():
    seen = []

    class Echo(nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((args, kwargs))
            return torch.tensor(0.0)

    fake.call_model(Echo(), {"a": 1})
    fake.call_model(Echo(), (1, 2))
    fake.call_model(Echo(), 3)
    assert seen == [((), {"a": 1}), ((1, 2), {}), ((3,), {})]


def test_the_model_name_skips_fsdp2s_generated_classes():
    class Net(nn.Linear):
        pass

    fsdp_net = type("FSDPNet", (Net,), {})
    assert fake.model_name(Net(1, 1)) == "Net" and fake.model_name(fsdp_net(1, 1)) == "Net"


def test_fsdp1_and_fairscale_models_are_refused_with_the_reason():
    fsdp1 = type("FullyShardedDataParallel", (nn.Module,), {})()
    fsdp1.module = nn.Linear(1, 1)
    model, why = fake.unwrap(fsdp1)
    assert model is fsdp1.module and "sharded by FSDP1" in why
    sharded = type("ShardedDataParallel", (nn.Module,), {})()
    sharded.module = nn.Linear(1, 1)
    inner, why = fake.unwrap(sharded)
    assert inner is sharded.module and "ShardedDataParallel" in why
    plain = nn.Linear(1, 1)
    assert fake.unwrap(plain) == (plain, None)


def test_ddp_is_unwrapped_and_its_bucket_view_setting_read(gloo_group):
    from torch.nn.parallel import DistributedDataParallel

    net = nn.Linear(2, 2)
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    assert fake.unwrap(model) == (net, None) and fake.model_name(model) == "Linear"
    assert fake.ddp_of(model) == (True, True) and fake.ddp_of(net) == (False, False)
    assert fake.ddp_of(DistributedDataParallel(nn.Linear(2, 2))) == (True, False)
    # the buckets beside the gradients, from DDP's reducer: none where the gradients are views into them
    assert fake.ddp_buckets_mib(DistributedDataParallel(nn.Linear(16, 8))) == (16 * 8 + 8) * 4 / MIB
    assert fake.ddp_buckets_mib(model) == 0.0 and fake.ddp_buckets_mib(net) == 0.0
    # the module DDP wraps, said to be under DDP (the Trainer's callbacks get that one): DDP's rule
    assert fake.ddp_buckets_mib(nn.Linear(16, 8), (True, False)) == (16 * 8 + 8) * 4 / MIB


def test_trainable_mib_counts_the_trainable_parameters_bytes():
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 4).double())
    model[0].bias.requires_grad_(False)
    assert fake.trainable_mib(model) == (256 * 512 * 4 + (512 * 4 + 4) * 8) / MIB


def test_ddp_adds_two_gradient_copies_one_of_them_the_bucket_only_where_it_is_seen():
    """Filed as a run's tracker files them: the bucket as Bucket, the backward's copy as Temp."""
    assert fake.ddp_extra_parts(3.0, (True, False), buckets_seen=True) == {"Temp": 3.0, "Bucket": 3.0}
    assert fake.ddp_extra_parts(3.0, (True, False), buckets_seen=False) == {"Temp": 3.0}
    assert fake.ddp_extra_parts(3.0, (True, True), buckets_seen=True) == {}
    assert fake.ddp_extra_parts(3.0, (False, False), buckets_seen=True) == {}


def _step(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_the_fake_steps_peak_holds_at_least_params_grads_and_adams_two_states():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    out = fake.predict_peak(model, optimizer, (torch.randn(8, 256), torch.randint(0, 4, (8,))), _step)
    states = 4 * fake.trainable_mib(model)  # params, grads, exp_avg, exp_avg_sq
    assert out["error"] is None and states <= out["peak_mib"] < states + 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not optimizer.state


def test_ddps_copies_are_added_to_the_fake_steps_peak_and_its_breakdown():
    model = nn.Linear(64, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2, 64), torch.randint(0, 4, (2,)))
    alone = fake.predict_peak(model, optimizer, batch, _step)
    under = fake.predict_peak(model, optimizer, batch, _step, ddp=(True, False))
    grads = fake.trainable_mib(model)
    # in a run's names, as the measurement's torch names map to them: Bucket, Temp
    assert under["breakdown_mib"]["buckets"] == grads and "buckets" not in alone["breakdown_mib"]
    assert under["breakdown_mib"]["temporaries"] == pytest.approx(
        alone["breakdown_mib"].get("temporaries", 0.0) + grads
    )
    assert not {"Bucket", "Temp", "Parameter"} & set(under["breakdown_mib"])
    assert under["peak_mib"] == pytest.approx(alone["peak_mib"] + 2 * grads)
    assert "DDP's gradient copies" in under["method"]


def test_the_probes_prediction_is_charted_split_as_a_runs_is():
    """The report's breakdown chart reads a prediction in a run's names: the probe's, under DDP,
    fills the parameters', gradients', optimizer's and buckets' bars, not only the last one."""
    from sharded_exp.report.figures import predicted_parts

    model = nn.Linear(64, 4)
    optimizer = torch.optim.Adam(model.parameters())
    under = fake.predict_peak(
        model, optimizer, (torch.randn(2, 64), torch.randint(0, 4, (2,))), _step, ddp=(True, False)
    )
    chart = predicted_parts({"peak_prediction": under})
    grads = fake.trainable_mib(model)
    assert chart["parameters"] == chart["gradients"] == chart["communication buckets"] == pytest.approx(grads)
    assert chart["optimizer state"] >= 2 * grads
    assert sum(chart.values()) == pytest.approx(under["peak_mib"])


def test_a_step_that_reads_a_value_has_no_prediction_and_says_why():
    model = nn.Linear(4, 1)

    def reads(m, batch):
        loss = m(batch).sum()
        if loss.item() > 0:  # a value fake tensors do not have
            return loss
        return -loss

    out = fake.predict_peak(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4), reads)
    assert out["peak_mib"] is None and out["error"].startswith("the step could not run on fake tensors")


def test_a_fresh_optimizer_keeps_the_class_the_defaults_and_each_groups_settings():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    original = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.01, betas=(0.8, 0.9))
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
              for g in original.param_groups]  # fmt: skip
    copy = fake._like(original, groups)
    assert type(copy) is torch.optim.AdamW and copy is not original
    assert [g["lr"] for g in copy.param_groups] == [0.01, 0.5] and copy.defaults["betas"] == (0.8, 0.9)


def test_a_lightning_modules_logging_is_silenced_during_the_fake_step_only():
    calls = []

    class Lit(nn.Linear):
        def log(self, *a, **k):
            calls.append("log")

        def log_dict(self, *a, **k):
            calls.append("log_dict")

    module = Lit(1, 1)
    with fake._quiet(module):
        module.log("x", 1)
        module.log_dict({})
    module.log("x", 1)
    assert calls == ["log"]


def test_lightnings_order_runs_the_forward_beside_the_previous_steps_gradients():
    """Lightning zeroes the gradients between training_step and backward: its forward holds the
    last step's gradients too, which a plain loop (zero_grad after the step) has dropped."""
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(256, 512), torch.randint(0, 4, (256,)))
    plain = fake.predict_peak(model, optimizer, batch, _step)
    lightning = fake.predict_peak(model, optimizer, batch, _step, zero_grad_after_forward=True)
    one_activation = 256 * 512 * 4 / MIB
    assert lightning["breakdown_mib"]["grads"] == pytest.approx(fake.trainable_mib(model))  # all of them
    assert lightning["breakdown_mib"]["activations"] >= 4 * one_activation  # the batch, two linears, one relu
    assert lightning["peak_mib"] > plain["peak_mib"] + one_activation
