"""sharded_exp.train.evaluate: the evaluation metrics in plain torch against torchmetrics' own
(the package does not import torchmetrics; its tests hold it to it): random logits and labels
with -100 padding and classes that never occur, split over simulated ranks, summed as
torchmetrics' sync sums them; the sums over a real (one-rank) gloo group."""

from __future__ import annotations

import pytest
import torch
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from torchmetrics.text import Perplexity

from sharded_exp.train.evaluate import Sums, add_ranks


def synced(per_rank):
    """torchmetrics' metrics of several ranks as its sync leaves them: each state gathered in rank
    order, stacked and reduced (sum), into rank 0's metric."""
    first = per_rank[0]
    for name, reduce in first._reductions.items():
        setattr(first, name, reduce(torch.stack([getattr(m, name) for m in per_rank])))
    return first


def batches(seed, ranks, per_rank, shape, classes, absent=(), pad=0.2):
    """Per rank, ``per_rank`` batches of (logits, labels, loss): labels avoid ``absent``
    (which the logits also never favour for some of them), a share ``pad`` of them -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ranks):
        mine = []
        for _ in range(per_rank):
            logits = torch.randn(*shape, classes, generator=g)
            labels = torch.randint(0, classes, shape, generator=g)
            for c in absent:
                labels[labels == c] = (c + 1) % classes
                logits[..., c] -= 100.0
            labels[torch.rand(shape, generator=g) < pad] = -100
            loss = torch.rand((), generator=g) * 3
            mine.append((logits, labels, loss))
        out.append(mine)
    return out


def ours(metric, classes, data):
    ranks = []
    for mine in data:
        sums = Sums(metric, classes)
        for logits, labels, loss in mine:
            sums.update(logits, labels, loss)
        ranks.append(sums.state)
    return Sums(metric, classes).values(add_ranks(ranks))


def theirs(make, data, inputs):
    per_rank = []
    for mine in data:
        m = make()
        for logits, labels, loss in mine:
            m.update(*inputs(logits, labels, loss))
        per_rank.append(m)
    return float(synced(per_rank).compute())


def argmax(logits, labels, loss):
    return logits.argmax(-1), labels


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_accuracy_and_macro_f1_are_torchmetrics(seed, ranks):
    classes = 9
    data = batches(seed, ranks, 3, (4, 13), classes, absent=(2, 7))
    values = ours("token_accuracy", classes, data)
    acc = theirs(lambda: MulticlassAccuracy(classes, average="micro", ignore_index=-100, validate_args=False),
                 data, argmax)  # fmt: skip
    f1 = theirs(lambda: MulticlassF1Score(classes, average="macro", ignore_index=-100, validate_args=False),
                data, argmax)  # fmt: skip
    assert values["eval/accuracy"] == acc and values["eval/f1"] == f1
    # the absent classes are left out of the average: with them it would be lower
    assert 0 < values["eval/f1"] < 1


def test_f1_leaves_out_classes_never_labelled_nor_predicted_but_counts_a_predicted_one():
    # class 2 never occurs; class 3 is predicted once and never labelled (F1 0, still averaged)
    logits = torch.nn.functional.one_hot(torch.tensor([[0, 1, 1, 3]]), 4).float()
    labels = torch.tensor([[0, 1, 0, -100]])
    labels_scored = torch.tensor([[0, 1, 0, 1]])
    for lab in (labels, labels_scored):
        sums = Sums("token_accuracy", 4)
        sums.update(logits, lab, torch.tensor(1.0))
        ref = MulticlassF1Score(4, average="macro", ignore_index=-100, validate_args=False)
        ref.update(logits.argmax(-1), lab)
        assert sums.compute()["eval/f1"] == float(ref.compute())
    # by hand for the unpadded labels: class 0 F1 2/3, class 1 1/2 (1 right of 2 predicted, 2 labelled), class 3 0
    assert sums.compute()["eval/f1"] == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)


@pytest.mark.parametrize("ranks", [1, 3])
def test_classifier_accuracy_scores_every_label(ranks):
    data = batches(5, ranks, 2, (16,), 5, pad=0.0)
    acc = theirs(lambda: MulticlassAccuracy(5, average="micro", validate_args=False), data, argmax)
    assert ours("accuracy", 5, data)["eval/accuracy"] == acc


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_perplexity_is_torchmetrics(seed, ranks):
    data = batches(seed, ranks, 3, (3, 11), 50, absent=(4,), pad=0.3)
    ppl = theirs(lambda: Perplexity(ignore_index=-100), data, lambda logits, labels, loss: (logits, labels))
    assert ours("perplexity", 0, data)["eval/perplexity"] == ppl


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_loss_is_mean_metric_over_every_batch_of_every_rank(ranks):
    data = batches(3, ranks, 5, (2,), 3)
    data[-1][1] = (*data[-1][1][:2], torch.tensor(float("nan")))  # MeanMetric leaves a NaN out
    with pytest.warns(UserWarning, match="nan"):
        loss = theirs(MeanMetric, data, lambda logits, labels, loss: (loss,))
    assert ours("accuracy", 3, data)["eval/loss"] == loss


def test_no_scored_label_gives_zero_as_torchmetrics_does():
    logits, labels = torch.randn(2, 5, 4), torch.full((2, 5), -100)
    sums = Sums("token_accuracy", 4)
    sums.update(logits, labels, torch.tensor(2.0))
    values = sums.compute()
    assert values == {"eval/accuracy": 0.0, "eval/f1": 0.0, "eval/loss": 2.0}
    assert list(values) == ["eval/accuracy", "eval/f1", "eval/loss"]  # the order result.json had


def test_sums_over_a_gloo_group_are_the_local_ones(gloo_group):
    (mine,) = batches(7, 1, 2, (3, 6), 5)
    local, synced_ = Sums("token_accuracy", 5), Sums("token_accuracy", 5)
    for logits, labels, loss in mine:
        local.update(logits, labels, loss)
        synced_.update(logits, labels, loss)
    total = synced_.total()
    assert {k: v.dtype for k, v in total.items()} == {k: v.dtype for k, v in local.state.items()}
    assert all(torch.equal(total[k], local.state[k]) for k in total)
    assert synced_.compute() == local.values(local.state)


def test_bad_input_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="'bleu'.*known: \\['accuracy', 'perplexity', 'token_accuracy'\\]"):
        Sums("bleu", 3)
    with pytest.raises(ValueError, match="num_classes >= 1, got 0"):
        Sums("token_accuracy", 0)
    with pytest.raises(ValueError, match="labels from 0 to 5: a 3-class task takes 0..2 and -100"):
        Sums("token_accuracy", 3).update(torch.randn(1, 2, 3), torch.tensor([[0, 5]]), torch.tensor(1.0))
