"""What the loop measures: interval metrics (loss, accuracy or perplexity) and throughput."""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from sharded_exp.vocabulary.wandb_names import across_ranks, per_rank_key


class IntervalMetrics:
    """Loss and accuracy (classifiers, token classifiers) or perplexity (language models)
    per log interval; which one is the task's to say (``Task.metric``), not a tensor shape's.

    Kept on the device every step: the detached loss and, for classifiers, the count of
    correct predictions (padding excluded). Nothing else: on a small model each tiny op
    costs a visible share of the step (benchmarks/harness/overhead.py), so everything else happens
    once per interval. At its end one vector -- every step's loss and count, then host
    numbers -- is all-reduced *asynchronously* and read at the end of the next interval,
    when the reduction finished long ago: a blocking collective every interval made ranks
    wait for each other's scheduling noise and cost 6-10% of a 12 ms step on 2 CPU cores.
    Perplexity is exp of the mean token loss over the interval (every step has the same
    number of tokens).

    Each rank's memory at the end of the interval rides along in the same reduction (its
    own three slots of a per-rank vector, zeros elsewhere: a sum is then a gather), so
    rank 0 logs every rank's ``memory/per_rank/{r}/allocated_mib``, ``peak_allocated_mib`` and
    (CUDA) ``reserved_mib`` without a collective of its own. ``probe() -> (allocated,
    peak, reserved or -1)`` in MiB reads this rank's memory (``MemoryMeter.now``).
    """

    def __init__(self, device: torch.device, task, probe=None):
        self.device = device
        self.task = task
        self.probe = probe
        self.name = "perplexity" if task.metric == "perplexity" else "accuracy"
        self.losses: list[torch.Tensor] = []  # detached, one per step: no op on the hot path
        self.correct: list[torch.Tensor] = []
        self.predictions: int | torch.Tensor = 0
        self._in_flight: tuple | None = None
        self.first_nonfinite = -1
        """The first step (counted from 1) whose loss was not finite on this rank; -1: none."""

    @property
    def updates(self) -> int:
        return len(self.losses)

    def update(self, loss: torch.Tensor, output, batch) -> None:
        self.losses.append(loss.detach())
        if self.name == "accuracy":
            logits, labels = self.task.predictions(output, batch)
            right = logits.detach().argmax(-1) == labels
            if self.task.metric == "token_accuracy":
                counted = labels != -100  # padding is not a prediction
                self.correct.append((right & counted).sum())
                self.predictions = self.predictions + counted.sum()
            else:
                self.correct.append(right.sum())
                self.predictions += labels.numel()

    def end_interval(self, step: int) -> dict[str, float] | None:
        """Collective (every rank, same step): start reducing this interval; returns the
        previous interval's record, if there is one.

        The reduced vector: the interval's n losses, then (classifiers) n correct counts
        and the number of predictions, then this rank's memory slots."""
        previous = self.flush()
        n = len(self.losses)
        own = torch.stack(self.losses)  # this rank's losses: its first non-finite one, below
        parts, host = [own], []
        if self.name == "accuracy":
            parts.append(torch.stack(self.correct))
            if torch.is_tensor(self.predictions):
                parts.append(self.predictions.reshape(1))
            else:
                host.append(float(self.predictions))
        if self.probe is not None:
            rank, world_size = dist.get_rank(), dist.get_world_size()
            memory = [0.0] * (3 * world_size)
            memory[3 * rank : 3 * rank + 3] = self.probe()
            host += memory
        # One op makes the vector (cat promotes every part to the host part's float64).
        sums = torch.cat([*parts, torch.tensor(host, dtype=torch.float64, device=self.device)])
        self._in_flight = (step, n, own, sums, dist.all_reduce(sums, async_op=True))
        self.losses, self.correct, self.predictions = [], [], 0
        return previous

    def flush(self) -> dict[str, float] | None:
        """The record of the interval in flight (waiting for it), if any."""
        if self._in_flight is None:
            return None
        step, n, own, sums, work = self._in_flight
        self._in_flight = None
        if self.first_nonfinite < 0:
            bad = [i for i, v in enumerate(own.tolist()) if not math.isfinite(v)]
            if bad:
                self.first_nonfinite = step - n + 1 + bad[0]  # the interval's steps are consecutive
        work.wait()
        values = sums.tolist()
        loss = sum(values[:n]) / (n * dist.get_world_size())
        record = {"step": step, "loss": loss}
        if self.name == "accuracy":
            record["accuracy"] = sum(values[n : 2 * n]) / values[2 * n] if values[2 * n] else math.nan
            values = values[2 * n + 1 :]
        else:
            record["perplexity"] = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float
            values = values[n:]
        for r in range(len(values) // 3):
            allocated, peak, reserved = values[3 * r : 3 * r + 3]
            record[per_rank_key(r, "allocated_mib")] = allocated
            record[per_rank_key(r, "peak_allocated_mib")] = peak
            if reserved >= 0:
                record[per_rank_key(r, "reserved_mib")] = reserved
        record.update(across_ranks("allocated_mib", values[0::3]))
        return record


class IntervalLog:
    """The history of interval records, sent to the logger in step order (a record arrives
    one interval late, after the per-step throughput points of its interval)."""

    def __init__(self, logger):
        self.logger = logger
        self.history: list[dict[str, float]] = []
        self._pending: list[tuple[int, dict[str, float]]] = []

    def add(self, step: int, values: dict[str, float]) -> None:
        self._pending.append((step, values))

    def flush(self) -> None:
        """Everything still pending, in step order (at the end of the loop)."""
        for log_step, values in sorted(self._pending, key=lambda e: e[0]):
            self.logger.log(values, step=log_step)
        self._pending = []

    def publish(self, record: dict[str, float] | None, bar) -> None:
        """A finished interval: into the history, and everything up to its step to the logger."""
        if record is None:
            return
        self.history.append(record)
        # under the names the history in result.json has (one name per figure)
        values = {k: v for k, v in record.items() if k != "step"}
        self._pending.append((record["step"], values))
        ready = sorted((e for e in self._pending if e[0] <= record["step"]), key=lambda e: e[0])
        self._pending = [e for e in self._pending if e[0] > record["step"]]
        for log_step, values in ready:
            self.logger.log(values, step=log_step)
        bar.set_postfix(loss=f"{record['loss']:.4f}")


def median_ci95(values: list[float]) -> tuple[float, float] | None:
    """A 95% confidence interval of the median, from order statistics (no assumption on
    the distribution: step times are skewed by the machine's other work): the ``j``-th
    smallest and ``j``-th largest value, ``j`` the largest rank with
    P(Binomial(n, 1/2) < j) <= 2.5%. None under 6 values, where no such ``j`` exists."""
    n = len(values)
    below, j = 0.0, 0
    while True:  # P(B < j+1) = P(B <= j)
        below += math.comb(n, j) / 2**n
        if below > 0.025:
            break
        j += 1
    if j == 0:
        return None
    ordered = sorted(values)
    return ordered[j - 1], ordered[n - j]


def throughput_stats(
    step_times: list[float],
    samples_per_step: int,
    tokens_per_step: int,
    loop_time_s_per_step: float | None,
    data_times: list[float] = (),
) -> dict[str, float]:
    """result.json's ``throughput`` from the timed steps' durations (empty when none was timed)."""
    if not step_times:  # stopped by a signal during the warm-up
        return {}
    median = statistics.median(step_times)
    q = statistics.quantiles(step_times, n=4) if len(step_times) > 1 else [median, median, median]
    ci = median_ci95(step_times)
    stats = {
        "samples_per_s": samples_per_step / median,
        "step_time_s_median": median,
        "step_time_s_iqr": q[2] - q[0],
        # the median's 95% interval: a speed figure with its noise (None under 6 timed steps)
        "step_time_s_ci95_low": ci[0] if ci else None,
        "step_time_s_ci95_high": ci[1] if ci else None,
        "samples_per_s_ci95_low": samples_per_step / ci[1] if ci else None,
        "samples_per_s_ci95_high": samples_per_step / ci[0] if ci else None,
        "step_time_s_mean": statistics.fmean(step_times),
        "timed_steps": len(step_times),
        "step_times_s": list(step_times),  # every timed step, in order
    }
    if tokens_per_step:
        stats["tokens_per_s"] = tokens_per_step / median
    if loop_time_s_per_step is not None:
        stats["loop_time_s_per_step"] = loop_time_s_per_step
    if data_times:  # waiting for the step's batches (prefetched) plus their copy to the device
        stats["data_time_s_per_step"] = statistics.median(data_times)
    return stats
