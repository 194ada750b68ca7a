"""sharded_exp.train.metrics: interval metrics (loss, accuracy, token accuracy, perplexity,
the first non-finite step, per-rank memory) over a world-size-1 gloo group; the interval log's
order; the median's 95% interval and the throughput figures."""

from __future__ import annotations

import math
import statistics
import types

import pytest
import torch

from sharded_exp.train.metrics import IntervalLog, IntervalMetrics, median_ci95, throughput_stats
from tests.helpers.unit_train import ListLogger

CPU = torch.device("cpu")


def task(metric, labels="targets"):
    def predictions(output, batch):
        return output["logits"], batch[labels]

    return types.SimpleNamespace(metric=metric, predictions=predictions)


def logits_for(predicted: list[int], classes=3):
    """Logits whose argmax is ``predicted``."""
    return torch.nn.functional.one_hot(torch.tensor(predicted), classes).float()


# --------------------------------------------------------------------------- IntervalMetrics
def test_an_interval_record_arrives_at_the_end_of_the_next_interval(gloo_group):
    m = IntervalMetrics(CPU, task("perplexity"))
    m.update(torch.tensor(1.0), None, None)
    assert m.end_interval(1) is None  # nothing before
    m.update(torch.tensor(3.0), None, None)
    record = m.end_interval(2)
    assert record["step"] == 1 and record["loss"] == 1.0
    assert m.flush()["step"] == 2
    assert m.flush() is None


def test_the_loss_is_the_intervals_mean_and_perplexity_its_exp(gloo_group):
    m = IntervalMetrics(CPU, task("perplexity"))
    for loss in (1.0, 2.0, 4.5):
        m.update(torch.tensor(loss), None, None)
    m.end_interval(3)
    record = m.flush()
    assert record["loss"] == pytest.approx(2.5)
    assert record["perplexity"] == pytest.approx(math.exp(2.5))
    assert "accuracy" not in record


def test_perplexity_of_a_huge_loss_is_inf_not_an_overflow(gloo_group):
    m = IntervalMetrics(CPU, task("perplexity"))
    m.update(torch.tensor(800.0), None, None)
    m.end_interval(1)
    assert m.flush()["perplexity"] == math.inf


def test_accuracy_counts_right_predictions_over_every_prediction_of_the_interval(gloo_group):
    m = IntervalMetrics(CPU, task("accuracy"))
    m.update(torch.tensor(1.0), {"logits": logits_for([0, 1, 2, 0])}, {"targets": torch.tensor([0, 1, 1, 1])})
    m.update(torch.tensor(1.0), {"logits": logits_for([2, 2])}, {"targets": torch.tensor([2, 2])})
    m.end_interval(2)
    assert m.flush()["accuracy"] == pytest.approx(4 / 6)


def test_token_accuracy_leaves_out_padding(gloo_group):
    m = IntervalMetrics(CPU, task("token_accuracy", labels="labels"))
    logits = logits_for([0, 1, 2, 0]).reshape(1, 4, 3)
    labels = torch.tensor([[0, -100, 2, 1]])  # 2 right of 3 real positions; the padded one is not counted
    m.update(torch.tensor(1.0), {"logits": logits}, {"labels": labels})
    m.end_interval(1)
    assert m.flush()["accuracy"] == pytest.approx(2 / 3)


def test_the_first_nonfinite_step_is_counted_from_one_across_intervals(gloo_group):
    m = IntervalMetrics(CPU, task("perplexity"))
    for step, loss in enumerate([1.0, 1.0, 1.0, float("inf"), float("nan")], start=1):
        m.update(torch.tensor(loss), None, None)
        if step in (2, 5):
            m.end_interval(step)
    m.flush()
    assert m.first_nonfinite == 4


def test_each_ranks_memory_rides_along_in_the_record(gloo_group):
    m = IntervalMetrics(CPU, task("perplexity"), probe=lambda: (1.5, 2.5, -1.0))
    m.update(torch.tensor(1.0), None, None)
    m.end_interval(1)
    record = m.flush()
    assert record["memory/per_rank/0/allocated_mib"] == 1.5
    assert record["memory/per_rank/0/peak_allocated_mib"] == 2.5
    assert "memory/per_rank/0/reserved_mib" not in record  # -1: no caching allocator
    assert record["memory/allocated_mib_max"] == 1.5
    m = IntervalMetrics(CPU, task("perplexity"), probe=lambda: (1.0, 2.0, 3.0))
    m.update(torch.tensor(1.0), None, None)
    m.end_interval(1)
    assert m.flush()["memory/per_rank/0/reserved_mib"] == 3.0


# ------------------------------------------------------------------------------- IntervalLog
def test_interval_log_publishes_everything_up_to_the_records_step_in_step_order():
    logger, bar = ListLogger(), types.SimpleNamespace(set_postfix=lambda **kw: None)
    log = IntervalLog(logger)
    log.add(2, {"throughput/a": 2.0})
    log.add(1, {"throughput/a": 1.0})
    log.add(3, {"throughput/a": 3.0})
    log.publish({"step": 2, "loss": 0.5}, bar)
    assert [s for s, _ in logger.logged] == [1, 2, 2]
    assert logger.logged[-1] == (2, {"loss": 0.5})  # the record's own values, without its step
    assert log.history == [{"step": 2, "loss": 0.5}]
    log.flush()
    assert [s for s, _ in logger.logged] == [1, 2, 2, 3]


def test_interval_log_ignores_a_missing_record():
    logger = ListLogger()
    log = IntervalLog(logger)
    log.add(1, {"a": 1.0})
    log.publish(None, None)
    assert logger.logged == [] and log.history == []


# --------------------------------------------------------------------- median_ci95, throughput
def test_median_ci95_has_no_interval_under_six_values():
    assert median_ci95([1.0, 2.0, 3.0, 4.0, 5.0]) is None


def test_median_ci95_takes_the_order_statistics_of_the_binomial_rank():
    # j: the largest with P(B(n, 1/2) < j) <= 2.5%, computed here by its definition
    for n in (6, 9, 13, 20, 40):
        cdf = lambda j: sum(math.comb(n, i) for i in range(j)) / 2**n  # noqa: E731 -- P(B < j)
        j = max(k for k in range(n + 1) if cdf(k) <= 0.025)
        values = [float(v) for v in range(100, 100 + n)][::-1]  # unsorted input
        assert median_ci95(values) == (100.0 + j - 1, 100.0 + n - j), n


def test_throughput_stats_are_empty_without_a_timed_step():
    assert throughput_stats([], 8, 0, None) == {}


def test_throughput_stats_from_the_median_step():
    times = [0.4, 0.1, 0.2, 0.3, 0.25, 0.35]
    stats = throughput_stats(times, samples_per_step=32, tokens_per_step=512, loop_time_s_per_step=0.5,
                             data_times=[0.01, 0.03, 0.02])  # fmt: skip
    median = statistics.median(times)
    assert stats["step_time_s_median"] == median
    assert stats["samples_per_s"] == pytest.approx(32 / median)
    assert stats["tokens_per_s"] == pytest.approx(512 / median)
    q = statistics.quantiles(times, n=4)
    assert stats["step_time_s_iqr"] == pytest.approx(q[2] - q[0])
    assert stats["step_time_s_mean"] == pytest.approx(sum(times) / 6)
    assert (stats["step_time_s_ci95_low"], stats["step_time_s_ci95_high"]) == (0.1, 0.4)
    assert stats["samples_per_s_ci95_low"] == pytest.approx(32 / 0.4)  # the slow end
    assert stats["samples_per_s_ci95_high"] == pytest.approx(32 / 0.1)
    assert stats["timed_steps"] == 6 and stats["step_times_s"] == times
    assert stats["loop_time_s_per_step"] == 0.5
    assert stats["data_time_s_per_step"] == 0.02


def test_throughput_stats_of_one_step_have_no_spread_and_no_interval():
    stats = throughput_stats([0.2], 4, 0, None)
    assert stats["step_time_s_iqr"] == 0.0
    assert stats["step_time_s_ci95_low"] is None and stats["samples_per_s_ci95_high"] is None
    assert "tokens_per_s" not in stats and "loop_time_s_per_step" not in stats and "data_time_s_per_step" not in stats
