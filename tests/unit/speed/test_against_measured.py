"""A run's predicted step time beside its measured median."""

from sharded_exp.speed.against_measured import step_time_figures


def test_the_error_is_relative_to_the_measured_median():
    out = step_time_figures({"step_time_s": 0.12, "compute_s": 0.1, "error": None}, 0.1)
    assert out["predicted_step_time_s"] == 0.12 and abs(out["step_time_rel_error"] - 0.2) < 1e-12
    assert out["step_time_prediction"] == {"compute_s": 0.1, "error": None}


def test_a_missing_prediction_leaves_null_and_its_reason():
    out = step_time_figures({"step_time_s": None, "error": "no op trace"}, 0.1)
    assert out["predicted_step_time_s"] is None and out["step_time_rel_error"] is None
    assert out["step_time_prediction"]["error"] == "no op trace"
    assert "no step time was predicted" in step_time_figures(None, 0.1)["step_time_prediction"]["error"]
