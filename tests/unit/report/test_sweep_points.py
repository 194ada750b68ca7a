"""sharded_exp.report.sweep_points: the sweep's points: the result.json files outside attempts/, the current sweep's only, an unreadable one as a point that says why, a point's overrides and name."""

from __future__ import annotations

import pytest

from sharded_exp.report.sweep_points import SWEEP_ID, load_points, overrides, point_name, sweep_id, swept_keys
from tests.helpers.unit_output import point, write_point


def test_a_point_is_named_by_its_number_in_the_sweep_else_its_directory():
    assert point_name({"output_dir": "/s/12_strategy=fsdp"}) == "point 12"
    assert point_name({"output_dir": "/s/my_run"}) == "my_run"
    assert point_name({}) == "?"


def test_overrides_drop_plus_signs_and_quotes_and_fall_back_to_hydras_file(tmp_path):
    assert overrides({"overrides": ["+x=1", "++y.z=a", "precision='32'"]}) == {
        "x": "1",
        "y.z": "a",
        "precision": "32",
    }
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- strategy=oss\n- trainer.batch_size=8\n")
    assert overrides({"output_dir": str(tmp_path)}) == {"strategy": "oss", "trainer.batch_size": "8"}
    assert overrides({"output_dir": str(tmp_path / "none")}) is None


def test_swept_keys_are_the_overrides_that_differ_beyond_the_reports_own_columns():
    points = [
        point("ddp", overrides=["strategy=ddp", "trainer.world_size=2", "trainer.batch_size=8", "trainer.steps=4"]),
        point("oss", overrides=["strategy=oss", "trainer.world_size=4", "trainer.batch_size=16", "trainer.steps=4"]),
        {**point("oss", output_dir="/nowhere"), "overrides": None},  # unknown overrides: not counted
    ]
    assert swept_keys(points) == ["trainer.batch_size"]


def test_points_are_the_result_files_outside_attempts(tmp_path):
    write_point(tmp_path, "0_strategy=ddp", point("ddp"))
    write_point(tmp_path, "0_strategy=ddp/attempts/1", point("ddp"))
    write_point(tmp_path, "1_strategy=oss", point("oss"))
    assert sorted(p["strategy"] for p in load_points(tmp_path)) == ["ddp", "oss"]


def test_a_reused_directory_reports_the_current_sweeps_points_and_names_the_rest(tmp_path):
    (tmp_path / SWEEP_ID).write_text("new\n")
    write_point(tmp_path, "0_a", point("ddp", sweep_id="new"))
    write_point(tmp_path, "1_b", point("oss", sweep_id="old"))
    write_point(tmp_path, "2_c", "{broken")
    stale = []
    points = load_points(tmp_path, stale)
    assert sorted(p["status"] for p in points) == ["ok", "unreadable"]  # an unreadable point is always shown
    assert [p["strategy"] for p in stale] == ["oss"]
    assert sweep_id(tmp_path) == "new"


def test_a_sweep_id_file_that_is_empty_or_absent_is_no_id(tmp_path):
    assert sweep_id(tmp_path) is None
    (tmp_path / SWEEP_ID).write_text("\n")
    assert sweep_id(tmp_path) is None
    write_point(tmp_path, "0_a", point("ddp", sweep_id="any"))
    assert len(load_points(tmp_path)) == 1


@pytest.mark.parametrize(
    ("text", "why"),
    [("{not json", "Expecting property name"), ("[1, 2]", "a JSON list, not an object"),
     ('{"status": "ok", "world_size": "2"}', "does not match its schema: world_size"),
     ('{"schema_version": 99, "status": "ok", "strategy": "ddp", "world_size": 2, "precision": "32", "model": "mlp"}',
      "schema_version 99 is newer than this sharded_exp reads (1)")],
)  # fmt: skip
def test_an_unreadable_result_becomes_a_point_that_says_why(tmp_path, text, why):
    path = write_point(tmp_path, "0_x", text)
    (p,) = load_points(tmp_path)
    assert p["status"] == "unreadable" and p["error"].startswith(f"{path}: ") and why in p["error"]
    assert p["output_dir"] == str(path.parent)


def test_a_result_without_what_a_row_needs_is_incomplete_or_still_running(tmp_path):
    write_point(tmp_path, "0_x", {k: v for k, v in point("ddp").items() if k not in ("world_size", "model")})
    write_point(tmp_path, "1_y", {**{k: v for k, v in point("oss").items() if k != "world_size"}, "status": "running"})
    a, b = load_points(tmp_path)
    assert a["status"] == "incomplete" and a["error"].endswith(": incomplete (no world_size, model)")
    assert b["status"] == "running" and b["error"].endswith(
        ": still running or killed before it finished (no world_size)"
    )
    assert a["strategy"] == "ddp"  # what it holds is kept
