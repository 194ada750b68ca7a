"""sharded_exp.job.result: result.json's models (closed top level, open sections), problems(),
the JSON Schema's header, a result built, laid over and written as given (numbers keep their
type), and write_result / write_json: atomic, with schema_version, a mismatch warned of but
still written, a full disk named."""

from __future__ import annotations

import errno
import json
import os

import pytest
from pydantic import ValidationError

from sharded_exp.job import result as result_mod
from sharded_exp.job.result import SCHEMA_VERSION, Result, problems, read_result, schema, write_json, write_result


def minimal(**extra) -> dict:
    return {
        "status": "ok",
        "strategy": "ddp",
        "precision": "32",
        "model": "mlp",
        "optimizer": "adam",
        "output_dir": "/tmp/run",
        "config": {"trainer": {"steps": 3}},
        **extra,
    }


def test_a_minimal_result_matches_and_gets_the_current_schema_version():
    assert problems(minimal()) == []
    assert Result.model_validate(minimal()).schema_version == SCHEMA_VERSION


def test_the_top_level_is_closed_an_unknown_key_is_named():
    found = problems(minimal(speed=3))
    assert len(found) == 1 and found[0].startswith("speed:")


def test_a_missing_required_key_and_a_bad_status_are_named():
    data = minimal(status="exploded")
    del data["strategy"]
    found = problems(data)
    assert any(p.startswith("strategy:") for p in found)
    assert any(p.startswith("status:") for p in found)


def test_open_sections_accept_keys_the_schema_does_not_name():
    data = minimal(memory={"per_rank": [{"rank": 0, "peak_allocated_mib": 1.5, "cuda_extra_mib": 2.0}], "new": 1},
                   device={"type": "cpu", "vendor": "x"})  # fmt: skip
    assert problems(data) == []


def test_closed_sections_refuse_unknown_keys():
    assert problems(minimal(zero_grad={"requested": "free", "applied": "free", "when": 1}))
    assert problems(minimal(param_digest={"sum": 1.0, "l2": 2.0, "max": 3.0}))
    assert problems(minimal(device={"type": "tpu"}))  # cpu or cuda only


def test_strict_refuses_a_value_that_would_be_converted():
    data = minimal(world_size="2")
    assert problems(data) == []  # lax: "2" is read as 2
    assert [p.split(":")[0] for p in problems(data, strict=True)] == ["world_size"]


def test_ignore_leaves_out_the_named_error_types():
    data = minimal(extra_key=1)
    del data["model"]
    assert len(problems(data)) == 2
    assert [p.split(":")[0] for p in problems(data, ignore=("extra_forbidden",))] == ["model"]
    assert problems(data, ignore=("extra_forbidden", "missing")) == []


def test_the_schema_is_draft_2020_12_and_titled_with_its_version():
    out = schema()
    assert out["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert out["title"] == f"result.json, schema_version {SCHEMA_VERSION}"
    assert out["additionalProperties"] is False
    assert set(out["required"]) == {"status", "strategy", "precision", "model", "optimizer", "output_dir", "config"}


def test_write_result_adds_schema_version_first_and_reads_back(tmp_path):
    out = tmp_path / "a" / "run"  # the directory is made
    write_result(str(out), Result.of(minimal(final_loss=0.5)))
    text = (out / "result.json").read_text()
    data = json.loads(text)
    assert list(data)[0] == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    assert data["final_loss"] == 0.5 and text.endswith("\n")
    assert read_result(str(out / "result.json")).final_loss == 0.5
    assert os.listdir(out) == ["result.json"]  # no tmp file left


def test_write_result_replaces_a_running_result(tmp_path):
    write_result(str(tmp_path), Result.of(minimal(status="running")))
    write_result(str(tmp_path), Result.of(minimal(status="oom", error="out of memory")))
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "oom"


def test_a_result_off_the_schema_is_written_with_a_warning(tmp_path, capsys):
    write_result(str(tmp_path), Result.of(minimal(bogus=1)))
    assert "bogus" in json.loads((tmp_path / "result.json").read_text())
    err = capsys.readouterr().err
    assert "result.json does not match its schema" in err and "bogus" in err
    (tmp_path / "result.json").unlink()  # the session checks every result.json left against the schema


def test_a_matching_result_writes_no_warning(tmp_path, capsys):
    write_result(str(tmp_path), Result.of(minimal()))
    assert capsys.readouterr().err == ""


def test_a_result_is_written_as_built_numbers_keep_their_type_and_unset_fields_stay_out(tmp_path):
    given = minimal(final_loss=None, timeline={"main": 1, "launch": 2.5},
                    memory={"per_rank": [{"rank": 0, "peak_allocated_mib": 3, "cuda_extra_mib": 2}], "new": 1},
                    eval={"final": {"eval/loss": 1}, "history": [{"step": 2, "eval/loss": 1}], "seconds": 0})  # fmt: skip
    result = Result.of(given)
    assert result.memory.per_rank[0].peak_allocated_mib == 3 and result.eval.seconds == 0
    write_result(str(tmp_path), result)
    text = (tmp_path / "result.json").read_text()
    assert text == json.dumps({"schema_version": SCHEMA_VERSION, **given}, indent=2) + "\n"  # in the order given
    assert '"peak_allocated_mib": 3,' in text and "3.0" not in text  # an int stays an int
    assert "traceback" not in json.loads(text)  # never set: not written (null only when set so)


def test_updated_lays_fields_over_and_keeps_the_rest():
    result = Result.build(**minimal(memory={"source": "cpu"}))
    later = result.updated(status="failed", error="rank 0: boom", memory={"peak_error": "x"})
    assert (later.status, later.error, later.strategy) == ("failed", "rank 0: boom", "ddp")
    assert later.as_written()["memory"] == {"peak_error": "x"}  # a section replaced whole
    assert result.status == "ok"  # the first result is left as it was
    assert later.has("error") and not later.has("traceback")
    assert list(later.as_written()) == ["schema_version", *minimal(), "memory", "error"]  # places kept, new ones last


def test_a_result_off_the_schema_is_kept_as_given():
    result = Result.build(status="failed", error="disk full")  # no strategy, no config
    assert (result.status, result.error) == ("failed", "disk full")
    assert result.as_written() == {"schema_version": SCHEMA_VERSION, "status": "failed", "error": "disk full"}
    assert result.updated(bogus=1).as_written()["bogus"] == 1


def test_read_result_reads_what_write_result_wrote(tmp_path):
    written = Result.of(minimal(memory={"per_rank": [{"rank": 0, "model_states_mib": {"params": 1}}]}))
    write_result(str(tmp_path), written)
    back = read_result(str(tmp_path / "result.json"))
    assert back.memory.per_rank[0].model_states_mib == {"params": 1}
    assert back.as_written() == written.as_written()


def test_read_result_raises_on_a_file_off_the_schema(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"status": "ok"}))
    with pytest.raises(ValidationError):
        read_result(str(path))


def test_a_full_disk_names_the_file_and_leaves_no_tmp_file(tmp_path, monkeypatch):
    path = str(tmp_path / "result.json")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(result_mod.os, "replace", full)
    with pytest.raises(OSError, match=f"no space left on device while writing {path}"):
        write_json(path, {"a": 1})
    assert os.listdir(tmp_path) == []


def test_another_write_error_is_raised_as_it_is_and_the_old_file_kept(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    path.write_text('{"old": true}\n')

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "denied")

    monkeypatch.setattr(result_mod.os, "replace", denied)
    monkeypatch.setattr(result_mod, "is_no_space", lambda exc, file: False)
    with pytest.raises(PermissionError):
        write_json(str(path), {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["result.json"]


def test_the_published_schema_is_the_generated_one():
    from pathlib import Path

    published = Path(result_mod.__file__).resolve().parents[1] / "docs" / "result.schema.json"
    assert json.loads(published.read_text()) == schema()


def test_a_partial_read_takes_an_unfinished_or_older_file_as_far_as_it_goes(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"status": "running", "strategy": "ddp", "future_key": {"a": 1},
                                "memory": {"per_rank": [{"rank": 0, "peak_allocated_mib": 2}]}}))  # fmt: skip
    point = read_result(str(path), partial=True)
    assert (point.status, point.strategy, point.model) == ("running", "ddp", None)
    assert point.memory.per_rank[0].peak_allocated_mib == 2
    assert point.as_written() == json.loads(path.read_text())  # nothing added (no schema_version), nothing lost


@pytest.mark.parametrize("content, message", [
    ("[1]", "a JSON list, not an object"),
    (json.dumps({"schema_version": SCHEMA_VERSION + 1, "status": "ok"}), f"schema_version {SCHEMA_VERSION + 1} is newer"),
    (json.dumps({"status": "ok", "world_size": "2"}), "does not match its schema: world_size"),
    ("{", "Expecting"),
])  # fmt: skip
def test_a_partial_read_still_refuses_what_it_cannot_trust(tmp_path, content, message):
    path = tmp_path / "result.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_result(str(path), partial=True)
