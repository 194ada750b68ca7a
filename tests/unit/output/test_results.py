"""sharded_exp.output.results: result.json's sections built from hand-written rank records
(the training part and its status, the memory section over ranks, what an out-of-memory
leaves, the profile), the end-of-run summary table and the lines printed under it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from sharded_exp.job.result import PartialResult, Result
from sharded_exp.output import results as res


def outcome(**kw):
    base = dict(stopped=False, steps_done=4, checkpoint=None, history=[{"loss": 1.0}, {"loss": 0.5}],
                throughput={"samples_per_s": 10.0}, evals=[], first_step_unix=100.0, last_step_unix=110.0)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def training(out=None, per_rank=None, final_loss=0.5, signal=None):
    per_rank = per_rank if per_rank is not None else [{"rank": 0, "nonfinite_params": False}]
    return res.training_result(
        out or outcome(), per_rank, {"sum": 2.0, "l2": 1.0}, final_loss, start=0, world_size=2, resumed_from=None,
        resume_changes=[], params=10, signal=signal, memory={}, timeline={"rank_start": 1.0},
    )  # fmt: skip


def job(**fields) -> Result:
    """A result with what every result.json holds, and ``fields``."""
    what = {"status": "ok", "strategy": "ddp", "precision": "32", "model": "mlp", "optimizer": "adam",
            "world_size": 2, "params": 10, "output_dir": "/out", "config": {}}  # fmt: skip
    return Result.of({**what, **fields})


# ------------------------------------------------------------------------ the training part
def test_base_result_reads_the_config():
    cfg = {"trainer": {"world_size": 4, "accelerator": "cpu", "steps": 7}, "strategy": {"name": "fsdp"},
           "precision": {"name": 32}, "model": {"name": "mlp"}, "optimizer": {"name": "adamw"}}  # fmt: skip
    r = res.base_result(cfg, 123, "/out", sweep_id="s1")
    assert r.status == "running" and r.error is None and r.precision == "32" and r.world_size == 4 and r.steps == 7
    assert (r.strategy, r.model, r.optimizer, r.params, r.output_dir, r.sweep_id) == (
        "fsdp",
        "mlp",
        "adamw",
        123,
        "/out",
        "s1",
    )
    assert r.config == cfg
    refused = res.base_result(cfg, None, "/out", "failed", "config: bad")
    assert (refused.status, refused.error, refused.params) == ("failed", "config: bad", None)


def test_a_finished_run_is_ok_with_its_last_metrics_and_timeline():
    r = training()
    assert r.status == "ok" and r.error is None and r.first_nonfinite_step is None and r.signal is None
    assert r.final_metrics == {"loss": 0.5}
    assert r.timeline == {"rank_start": 1.0, "first_step": 100.0, "last_step": 110.0}
    assert r.eval is None and r.profile is None


def test_a_non_finite_loss_is_a_divergence_at_the_first_bad_step_of_any_rank():
    per_rank = [{"rank": 0, "nonfinite_params": False, "first_nonfinite_step": 5},
                {"rank": 1, "nonfinite_params": True, "first_nonfinite_step": 3},
                {"rank": 2, "nonfinite_params": True, "first_nonfinite_step": -1}]  # fmt: skip
    r = training(per_rank=per_rank, final_loss=float("nan"))
    assert r.status == "diverged" and r.first_nonfinite_step == 3
    assert r.error == "diverged: final loss nan, loss first non-finite at step 3, non-finite parameters on rank(s) 1, 2"


def test_non_finite_parameters_alone_are_a_divergence():
    r = training(per_rank=[{"rank": 0, "nonfinite_params": True}], final_loss=0.25)
    assert r.status == "diverged" and r.first_nonfinite_step is None
    assert r.error == "diverged: final loss 0.25, loss finite at every step, non-finite parameters on rank(s) 0"


def test_a_stopped_run_is_stopped_even_when_diverged_and_keeps_its_signal():
    r = training(out=outcome(stopped=True), final_loss=float("inf"), signal=15)
    assert r.status == "stopped" and r.signal == 15
    assert training(signal=15).signal is None  # not stopped: no signal recorded


def test_the_eval_section_keeps_the_last_pass_and_sums_the_time():
    evals = [{"eval/loss": 2.0, "eval/accuracy": 0.5, "step": 2, "seconds": 0.25},
             {"eval/loss": 1.0, "eval/accuracy": 0.75, "step": 4, "seconds": 0.5}]  # fmt: skip
    section = training(out=outcome(evals=evals)).eval
    assert section.final == {"eval/loss": 1.0, "eval/accuracy": 0.75}
    assert section.history == [{"eval/loss": 2.0, "eval/accuracy": 0.5, "step": 2},
                                  {"eval/loss": 1.0, "eval/accuracy": 0.75, "step": 4}]  # fmt: skip
    assert section.seconds == 0.75


def test_a_finished_result_lays_rank_zeros_payload_over_the_base_and_joins_the_timelines():
    base = job(status="running", timeline={"main": 1.0})
    payload = PartialResult.build(status="ok", steps_done=4, timeline={"first_step": 3.0})
    done = res.finished_result(base, payload, {"main": 1.0, "launch": 2.0})
    assert done.steps_done == 4 and isinstance(done, Result) and not isinstance(done, PartialResult)
    assert done.status == "ok" and done.strategy == "ddp"
    assert done.timeline == {"main": 1.0, "launch": 2.0, "first_step": 3.0}
    assert res.finished_result(base, None, {"main": 1.0}).status == "ok"  # a torchrun rank other than 0


def test_a_finished_result_records_the_wait_from_the_jobs_start_to_its_first_step():
    base = job(status="running")
    payload = PartialResult.build(status="ok", throughput={"samples_per_s": 10.0}, timeline={"first_step": 3.5})
    done = res.finished_result(base, payload, {"main": 1.0, "launch": 2.0})
    assert done.throughput.first_step_after_start_s == 2.5
    assert done.throughput.samples_per_s == 10.0  # the rest of rank 0's section as it was
    # no start (not from __main__) or no loop (no training part): no figure, not a wrong one
    assert res.finished_result(base, payload, {"main": None}).throughput.first_step_after_start_s is None
    assert res.finished_result(base, None, {"main": 1.0}).throughput is None


# ------------------------------------------------------------------------ the end-of-run table
def test_format_table_right_aligns_each_column_to_its_widest_cell():
    assert res.format_table([["a", "12345"]], ["name", "n"]).splitlines() == [
        "name      n",
        "----  -----",
        "   a  12345",
    ]


def _cells(table: str) -> dict[str, str]:
    """Each heading of a folded one-row table and its cell (blocks: heading line, dashes, row)."""
    out = {}
    for block in table.split("\n\n"):
        head, dashes, row = block.splitlines()
        for dash in re.finditer(r"-+", dashes):  # each column's extent, right-aligned within it
            out[head[dash.start() : dash.end()].strip()] = row[dash.start() : dash.end()].strip()
    return out


def test_format_table_folds_columns_into_blocks_that_fit_the_width_keeping_each_group_whole():
    header = ["aaaa", "bbbb", "cccc", "dddd", "eeee"]
    table = res.format_table([["1", "2", "3", "4", "5"]], header, width=10, groups=[2, 1, 2])
    assert table.split("\n\n") == ["aaaa  bbbb\n----  ----\n   1     2", "cccc\n----\n   3",
                                   "dddd  eeee\n----  ----\n   4     5"]  # fmt: skip
    # a group wider than the width is folded column by column; two groups that fit share a block
    table = res.format_table([["1", "2", "3", "4", "5"]], header, width=15, groups=[3, 2])
    assert [b.splitlines()[0] for b in table.split("\n\n")] == ["aaaa  bbbb", "cccc", "dddd  eeee"]
    table = res.format_table([["1", "2", "3", "4", "5"]], header, width=22, groups=[1, 2, 2])
    assert [b.splitlines()[0] for b in table.split("\n\n")] == ["aaaa  bbbb  cccc", "dddd  eeee"]


def test_the_summary_table_prints_each_figure_in_its_unit():
    result = job(
        strategy="fsdp", precision="bf16", world_size=2, model="mlp", params=1234567, final_loss=0.123456,
        throughput={"samples_per_s": 123.45, "step_time_s_median": 0.0125, "mfu_pct": 3.21,
                    "predicted_step_time_s": 0.0111},
        memory={"peak_allocated_mib_max": 3.456, "peak_allocated_mib_mean": 3.0, "predicted_peak_mib_max": None,
                "model_states_mib_max": 1.0, "predicted_model_states_mib_max": 1.01},
        eval={"final": {"eval/accuracy": 0.91234, "eval/f1": 0.88}, "history": [], "seconds": 0.21},
    )  # fmt: skip
    assert _cells(res.summary_table(result)) == {
        "strategy": "fsdp", "precision": "bf16", "world_size": "2", "model": "mlp", "params": "1,234,567",
        "final_loss": "0.1235", "eval": "acc 0.912 f1 0.88 (0.21 s)", "status": "ok",
        "samples/s": "123.5", "step_ms": "12.5", "pred_step_ms": "11.1", "mfu_pct": "3.2",
        "peak_MiB": "3.46", "peak_mean_MiB": "3.00", "pred_peak_MiB": "-", "states_MiB": "1.00", "pred_states_MiB": "1.01",
    }  # fmt: skip


def test_the_summary_table_fits_the_terminal_for_a_wide_run_and_keeps_every_column():
    """A 7B CUDA run (reserved columns too) with a long model name and evaluation: each line
    within 100 characters: the run folded where it is too wide, its speed beside its end, its
    memory in a block of its own."""
    result = job(
        model="hf_bert_base_multilingual", params=6_738_415_616, final_loss=10.5, strategy="fsdp_grad_op",
        throughput={"samples_per_s": 12345.6, "step_time_s_median": 12.5, "mfu_pct": 45.6,
                    "predicted_step_time_s": 11.1},
        memory={"peak_allocated_mib_max": 76543.21, "peak_allocated_mib_mean": 76000.0,
                "predicted_peak_mib_max": 77000.0, "peak_reserved_mib_max": 80000.0,
                "predicted_peak_reserved_mib_max": 81000.0, "model_states_mib_max": 50000.0,
                "predicted_model_states_mib_max": 50001.0},
        eval={"final": {"eval/accuracy": 0.91234, "eval/f1": 0.88, "eval/perplexity": 123.4}, "history": [],
              "seconds": 1234.5},
    )  # fmt: skip
    table = res.summary_table(result)
    assert max(len(line) for line in table.splitlines()) <= 100
    cells = _cells(table)
    assert len(cells) == 19 and cells["reserved_MiB"] == "80000.00" and cells["status"] == "ok"
    assert [b.splitlines()[0].split()[0] for b in table.split("\n\n")] == ["strategy", "eval", "peak_MiB"]


def test_the_summary_table_of_a_cuda_run_shows_reserved_measured_and_predicted():
    result = job(
        memory={"peak_allocated_mib_max": 3.0, "peak_reserved_mib_max": 4.0, "predicted_peak_reserved_mib_max": 4.5},
        throughput={},
    )
    cells = _cells(res.summary_table(result))
    names = list(cells)
    at = names.index("pred_peak_MiB")
    assert names[at + 1 : at + 3] == ["reserved_MiB", "pred_reserved_MiB"]
    assert (cells["reserved_MiB"], cells["pred_reserved_MiB"]) == ("4.00", "4.50")


def test_the_summary_table_of_a_run_that_never_trained():
    result = job(status="oom", throughput={})  # {}: no step was timed
    cells = _cells(res.summary_table(result))
    assert [cells[k] for k in ("strategy", "precision", "world_size", "model", "params", "status")] == [
        "ddp", "32", "2", "mlp", "10", "oom"]  # fmt: skip
    assert {v for k, v in cells.items() if k not in ("strategy", "precision", "world_size", "model", "params",
                                                      "status")} == {"-"}  # fmt: skip


def test_the_eval_cell_of_a_pass_without_the_named_metrics_or_of_no_pass():
    assert res._eval_cell(job(eval={"final": {"eval/perplexity": 12.3456}, "history": [], "seconds": 0.5})) == (
        "ppl 12.3 (0.50 s)"
    )
    assert res._eval_cell(job(eval={"final": {"eval/loss": 1.0}, "history": [], "seconds": 0.5})) == "-"
    assert res._eval_cell(job()) == "-"


# ------------------------------------------------------------------------ the memory section
def test_the_predicted_section_holds_the_largest_and_mean_prediction():
    prediction = {
        "model_states_mib": [{"params": 1.0, "grads": 1.0, "optimizer": 2.0}, {"params": 1.0, "grads": 2.0, "optimizer": 2.0}],
        "transient_params_mib": 0.5,
        "peak": {"per_rank_mib": [6.0, 8.0], "method": "fake step", "breakdown_mib": {"params": 1.0}},
    }  # fmt: skip
    section = res.predicted_section(prediction, "live tensors")
    assert section["predicted_model_states_mib_max"] == 5.0
    assert section["predicted_peak_mib_max"] == 8.0 and section["predicted_peak_mib_mean"] == 7.0
    assert section["per_rank"][1] == {"rank": 1, "predicted_model_states_mib": prediction["model_states_mib"][1],
                                      "predicted_peak_mib": 8.0}  # fmt: skip
    assert section["peak_prediction"]["method"] == "fake step" and section["memory_limit_applies_to"] == "live tensors"
    no_peak = res.predicted_section({**prediction, "peak": None})
    assert no_peak["predicted_peak_mib_max"] is None and no_peak["peak_prediction"] is None
    assert "predicted_peak_mib" not in no_peak["per_rank"][0]


@pytest.mark.parametrize(
    ("peaks", "smallest", "median"), [([3.0, 1.0, 2.0], 1.0, 2.0), ([4.0, 1.0, 3.0, 2.0], 1.0, 2.5)]
)
def test_the_band_over_ranks_is_the_smallest_and_the_median(peaks, smallest, median):
    figures = res.largest_and_mean([{"rank": i, "peak_allocated_mib": p} for i, p in enumerate(peaks)])
    assert figures["peak_allocated_mib_min"] == smallest and figures["peak_allocated_mib_median"] == median
    assert figures["peak_allocated_mib_max"] == max(peaks)
    assert figures["peak_allocated_mib_mean"] == sum(peaks) / len(peaks)


def test_the_largest_prediction_error_keeps_its_sign():
    per_rank = [{"rank": 0, "peak_rel_error": 0.02}, {"rank": 1, "peak_rel_error": -0.04}, {"rank": 2}]
    figures = res.largest_and_mean(per_rank)
    assert figures["peak_rel_error_max"] == -0.04
    assert figures["peak_allocated_mib_max"] is None and figures["peak_allocated_mib_min"] is None
    assert figures["model_states_mib_max"] is None


def test_a_rank_that_could_not_measure_is_named():
    per_rank = [
        {"rank": 0, "peak_allocated_mib": 1.0},
        {"rank": 1, "peak_allocated_mib": None, "peak_error": "no tracker"},
    ]
    figures = res.largest_and_mean(per_rank)
    assert figures["peak_error"] == "rank 1: no tracker"
    assert figures["peak_allocated_mib_mean"] is None  # a rank without a figure: no mean


def test_the_memory_section_sets_each_ranks_prediction_and_its_signed_error():
    states = [{"params": 2.0, "grads": 2.0, "optimizer": 4.0}, {"params": 1.0, "grads": 1.0, "optimizer": 2.0}]
    per_rank = [
        {"rank": 0, "peak_allocated_mib": 10.0, "model_states_mib": states[0],
         "peak_breakdown_mib": {"Parameter": 3.0}},
        {"rank": 1, "peak_allocated_mib": 5.0, "model_states_mib": states[1],
         "peak_breakdown_mib": {"Parameter": 1.5}},
    ]  # fmt: skip
    prediction = {"model_states_mib": [{"params": 2.0, "grads": 2.0, "optimizer": 4.4}, states[1]],
                  "transient_params_mib": 0.75, "peak": {"per_rank_mib": [9.0, 6.0]}}  # fmt: skip
    section = res.memory_section(prediction, per_rank, "cpu tracker")
    assert per_rank[0]["peak_rel_error"] == pytest.approx((9.0 - 10.0) / 10.0)  # below zero: too low
    assert per_rank[1]["peak_rel_error"] == pytest.approx((6.0 - 5.0) / 5.0)
    assert per_rank[0]["model_states_rel_error"] == pytest.approx(0.4 / 8.0)
    assert section["peak_rel_error_max"] == pytest.approx(0.2)  # the largest by size: rank 1's
    assert section["model_states_mib_max"] == 8.0 and section["predicted_model_states_mib_max"] == pytest.approx(8.4)
    assert section["predicted_peak_mib_max"] == 9.0 and section["predicted_peak_mib_mean"] == 7.5
    assert section["transient_params_mib_max"] == pytest.approx(max(3.0 - 2.0, 1.5 - 1.0))
    assert section["peak_allocated_mib_max"] == 10.0 and section["peak_allocated_mib_mean"] == 7.5
    assert section["source"] == "cpu tracker" and section["memory_snapshot"] is None


def test_the_memory_section_without_a_peak_prediction():
    per_rank = [{"rank": 0, "peak_allocated_mib": 4.0, "model_states_mib": {"params": 1.0}}]
    section = res.memory_section({"model_states_mib": [{"params": 1.0}], "transient_params_mib": 0.0}, per_rank, "x")
    assert section["predicted_peak_mib_max"] is None and per_rank[0]["peak_rel_error"] is None
    assert section["peak_rel_error_max"] is None and section["transient_params_mib_max"] is None


def test_a_cuda_prediction_gives_each_rank_a_reserved_peak_beside_the_measured_one():
    states = [{"params": 1.0}, {"params": 1.0}]
    allocator = {"reserved_extra_mib": 2.5, "allocated_extra_mib": 0.1}
    prediction = {"model_states_mib": states, "transient_params_mib": 0.0,
                  "peak": {"per_rank_mib": [9.0, 6.0], "kernels": "cuda: ...", "allocator": allocator}}  # fmt: skip
    per_rank = [{"rank": r, "peak_allocated_mib": 8.0, "peak_reserved_mib": 10.0 + r, "model_states_mib": states[r]}
                for r in range(2)]  # fmt: skip
    section = res.memory_section(prediction, per_rank, "cuda_allocator")
    assert [r["predicted_peak_reserved_mib"] for r in per_rank] == [11.5, 8.5]
    assert section["predicted_peak_reserved_mib_max"] == 11.5 and section["peak_reserved_mib_max"] == 11.0
    assert section["predicted_peak_reserved_error"] is None
    assert res.predicted_section(prediction)["predicted_peak_reserved_mib_max"] == 11.5


def test_a_cpu_prediction_has_no_reserved_peak_and_says_why():
    prediction = {"model_states_mib": [{"params": 1.0}], "transient_params_mib": 0.0,
                  "peak": {"per_rank_mib": [9.0], "kernels": "cpu: ...", "allocator": None}}  # fmt: skip
    per_rank = [{"rank": 0, "peak_allocated_mib": 8.0, "model_states_mib": {"params": 1.0}}]
    section = res.memory_section(prediction, per_rank, "torch_mem_tracker")
    assert per_rank[0]["predicted_peak_reserved_mib"] is None and section["predicted_peak_reserved_mib_max"] is None
    assert "CPU run has no caching allocator" in section["predicted_peak_reserved_error"]
    assert "no predicted peak" in res.predicted_reserved({"peak": {"error": "the model cannot run fake"}})[1]


def test_relative_error_over_the_three_states_together():
    assert res.relative_error({"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 2.0}) == pytest.approx(0.25)
    assert res.relative_error({"a": 5.0}, {"a": 4.0}) == pytest.approx(0.25)
    assert res.relative_error({"a": 1.0}, {"a": 0.0}) == 0.0


# ------------------------------------------------------------------------ out of memory, snapshots, profile
def test_snapshot_summary_lists_the_files_or_says_why_none():
    assert res.snapshot_summary([]) is None
    rec = lambda path, recorded: {"setting": "auto", "recorded": recorded, "path": path, "reason": "no CUDA allocator"}  # noqa: E731
    assert res.snapshot_summary([rec(None, False), rec("/a.pickle", True)]) == {
        "setting": "auto",
        "recorded": True,
        "files": ["/a.pickle"],
        "reason": None,
    }
    assert res.snapshot_summary([rec(None, False)])["reason"] == "no CUDA allocator"


def test_oom_memory_keeps_the_first_ranks_breakdown():
    failures = [
        {"rank": 1, "memory_at_oom": {"oom_breakdown": {"tracked_mib": 3.0}}},
        {"rank": 0, "memory_at_oom": {"oom_breakdown": {"tracked_mib": 4.0}}},
        {"rank": 2},
    ]
    found = res.oom_memory(failures)
    assert found["oom_breakdown"] == {"rank": 1, "tracked_mib": 3.0} and found["oom_breakdown_error"] is None


@pytest.mark.parametrize(
    ("failures", "reason"),
    [
        ([{"rank": 0, "memory_at_oom": {"memory_snapshot": {"setting": "on", "recorded": True, "path": "/s", "reason": None}}}],
         "a CUDA run: the allocator's snapshot (memory.memory_snapshot) holds what was live"),
        ([{"rank": 0, "memory_at_oom": {"memory_snapshot": {"setting": "on", "recorded": False, "path": None,
                                                             "reason": "disabled"}}}],
         "a CUDA run without a snapshot: disabled (memory.memory_snapshot)"),
        ([{"rank": 0, "memory_at_oom": {"memory_snapshot": {"setting": "auto", "recorded": False, "path": None,
                                                             "reason": "no CUDA allocator here"}}}],
         "the allocation failed where the CPU tracker kept no record (not over trainer.memory_limit_mib)"),
        ([{"rank": 0}], "no rank recorded its memory at the failure"),
    ],
)  # fmt: skip
def test_oom_memory_says_why_there_is_no_breakdown(failures, reason):
    found = res.oom_memory(failures)
    assert found["oom_breakdown"] is None and found["oom_breakdown_error"] == reason


def test_the_profile_section_compares_a_profiled_step_with_the_timed_ones():
    record = lambda path, size, err=None: {"path": path, "size_mib": size, "steps": [3, 4], "step_time_s": [0.3, 0.1, 0.2],  # noqa: E731
                                           "export_s": 0.5 if path else None, "note": "n", "error": err}  # fmt: skip
    per_rank = [{"profile": record("/t0.json", 2.0)}, {"profile": record(None, None, "failed")}]
    section = res.profile_section(per_rank, {"step_time_s_median": 0.1})
    assert section["files"] == ["/t0.json"] and section["size_mib_per_rank"] == 2.0 and section["steps"] == [3, 4]
    assert section["step_time_s_median"] == pytest.approx(0.2) and section["cost_ratio"] == pytest.approx(2.0)
    assert section["export_s"] == 0.5 and section["error"] == "rank 1: failed"
    assert res.profile_section([{}], {}) is None
    assert res.profile_section(per_rank[:1], None)["cost_ratio"] is None


def test_memory_lines_name_the_oom_breakdown_snapshots_and_traces():
    result = job(status="oom", memory={
        "oom_breakdown": {"rank": 1, "step": 2, "phase": "forward", "tracked_mib": 5.5, "limit_mib": 5.0,
                          "by_category_mib": {"Activation": 3.0, "Gradient": 0.0}, "top_modules_mib": {"fc1": 2.5},
                          "outside_modules_mib": 0.25},
        "memory_snapshot": {"files": ["/a.pickle"]}},
        profile={"files": ["/t.json"], "steps": [3], "size_mib_per_rank": 1.5, "step_time_s_median": 0.02,
                 "unprofiled_step_time_s_median": None})  # fmt: skip
    oom, snap, prof = res.memory_lines(result)
    assert oom == ("out of memory on rank 1 at step 2 (forward): 5.50 MiB live over the 5 MiB budget: Activation 3.00; "
                   "top modules (MiB): fc1 2.50; outside any module 0.25")  # fmt: skip
    assert snap == "memory snapshots (open at https://pytorch.org/memory_viz): /a.pickle"
    assert prof.endswith("of steps [3]: /t.json; 1.50 MiB each; a profiled step 20.0 ms, unprofiled -")


def test_memory_lines_say_why_an_oom_has_no_breakdown():
    result = job(status="oom", memory={"oom_breakdown": None, "oom_breakdown_error": "no rank recorded"},
                 profile={"error": "rank 0: boom"})  # fmt: skip
    assert res.memory_lines(result) == [
        "no out-of-memory breakdown: no rank recorded",
        "no profiler trace: rank 0: boom",
    ]
    assert res.memory_lines(job(memory={"oom_breakdown_error": "x"})) == []
    assert res.memory_lines(job()) == []
