"""sharded_exp.probe.summary: the lines rank 0 prints after writing result.json, from
hand-written results whose figures can be read off."""

from __future__ import annotations

from sharded_exp.probe.summary import LISTED_RANKS, WIDTH, error_text, split_text, summary


def _result(world: int = 2, **memory) -> dict:
    per_rank = [
        {"rank": r, "peak_allocated_mib": 2.47 - 0.04 * r,
         "peak_breakdown_mib": {"Parameter": 0.55, "Gradient": 0.55, "Optstate": 1.10, "Activation": 0.23,
                                "Temp": 0.04, "Buffer": 0.0}}
        for r in range(world)
    ]  # fmt: skip
    return {
        "strategy": "ddp",
        "world_size": world,
        "steps": 35,
        "status": "ok",
        "error": None,
        "device": {"type": "cpu"},
        "output_dir": "/out/probe",
        "memory": {
            "per_rank": per_rank,
            "peak_allocated_mib_max": 2.47,
            "peak_allocated_mib_mean": 2.45,
            "predicted_peak_mib_max": 1.94,
            "peak_rel_error_max": -0.215,
            "peak_prediction": {
                "breakdown_mib": {
                    "params": 0.55,
                    "grads": 0.55,
                    "optimizer": 1.10,
                    "activations": 0.004,
                    "buckets": 0.55,
                },
                "error": None,
            },
            **memory,
        },  # fmt: skip
        "throughput": {"step_time_s_median": 0.0123, "timed_steps": 28, "samples_per_s": 1234.0},
    }


def test_the_summary_of_a_two_rank_run():
    assert summary(_result()) == "\n".join([
        "sharded_exp probe: ddp, 2 ranks (cpu), 35 steps, ok",
        "  peak per rank:  2.47 MiB largest, 2.45 mean (rank 0 2.47, rank 1 2.43)",
        "  rank 0's split: params 0.55, grads 0.55, optimizer 1.10, activations 0.23, temporaries 0.04 MiB",
        "  predicted:      1.94 MiB, 21.5% too low (the largest error over ranks); params 0.55, grads 0.55,",
        "                  optimizer 1.10, activations 0.004, buckets 0.55",
        "  speed:          12.3 ms a step (median of 28), 1,234 samples/s",
        "  result:         /out/probe/result.json",
    ])  # fmt: skip
    assert all(len(line) <= WIDTH for line in summary(_result()).splitlines())


def test_the_split_uses_our_names_and_sums_what_is_one_of_ours():
    assert split_text({"Sharded Param": 0.5, "Unsharded Param": 1.0, "Parameter": 0.25, "Bucket": 0.5}) == (
        "params 0.75, gathered 1.00, buckets 0.5"
    )
    assert split_text({"Temp": 0.0, "Other": 0.0001}) == "" and split_text(None) == ""
    assert split_text({"mystery": 1.0}) == "mystery 1.00"  # a name no table knows: as it came


def test_the_prediction_error_in_words():
    assert error_text(-0.215) == "21.5% too low" and error_text(0.031) == "3.1% too high"
    assert error_text(0.0001) == "as measured (within 0.05%)"


def test_what_was_not_measured_or_predicted_says_why():
    text = summary(
        _result(
            1,
            peak_allocated_mib_max=None,
            peak_error="rank 0: the probe saw 3 step(s)",
            predicted_peak_mib_max=None,
            peak_prediction={"error": "no example batch was given (example=)"},
        )
    )
    assert "  peak:" not in text and "split" not in text
    assert "  peak per rank:  not measured (rank 0: the probe saw 3 step(s))" in text
    assert "  predicted:      none (no example batch was given (example=))" in text


def test_one_rank_reads_as_one_peak_and_many_ranks_as_largest_and_mean():
    one = summary(_result(1)).splitlines()
    assert one[1] == "  peak:           2.47 MiB" and one[2].startswith("  split:          params 0.55")
    assert "largest error over ranks" not in one[3]
    many = summary(_result(LISTED_RANKS + 1)).splitlines()
    assert many[1] == "  peak per rank:  2.47 MiB largest, 2.45 mean"  # no list of nine ranks


def test_a_failed_run_says_so_on_its_first_line():
    failed = _result() | {"status": "failed", "error": "rank 0: RuntimeError: boom\ntraceback"}
    assert (
        summary(failed).splitlines()[0]
        == "sharded_exp probe: ddp, 2 ranks (cpu), 35 steps, failed: rank 0: RuntimeError: boom"
    )


def test_the_result_path_is_never_wrapped():
    """A path is copied from the terminal: a long one with hyphens stays on its line."""
    from sharded_exp.probe.summary import summary

    long = "/tmp/" + "-".join(["a-very-long-directory-name"] * 6)
    lines = summary({"status": "ok", "strategy": "single", "world_size": 1, "output_dir": long}).splitlines()
    assert lines[-1] == f"  result:         {long}/result.json"
