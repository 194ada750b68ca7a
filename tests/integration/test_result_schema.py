"""result.json's schema: published, generated from the models, and enforced by its writer.
(Every result.json the suite writes is validated against it at the end of the session:
conftest.py's pytest_sessionfinish.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from sharded_exp.job import result as job_result
from tests.helpers.jobs import ROOT


def test_the_published_schema_is_the_one_the_models_generate():
    published = json.loads((ROOT / "docs" / "result.schema.json").read_text())
    assert published == job_result.schema(), (
        "docs/result.schema.json is stale: python -m sharded_exp.job.result > docs/result.schema.json"
    )
    jsonschema.Draft202012Validator.check_schema(published)


def test_the_result_reference_page_is_generated_and_names_every_key():
    from sharded_exp.reference import result_markdown

    page = (ROOT / "docs" / "reference" / "result.md").read_text()
    assert page == result_markdown(), "docs/reference/result.md is stale: python -m sharded_exp.reference result > it"
    schema = job_result.schema()
    for section in [schema, *schema["$defs"].values()]:
        for key in section.get("properties", {}):
            assert f"| `{key}` |" in page, key
    assert "| - |" not in page, "every key of result.json says what it means (a docstring under its field)"


def test_a_result_with_a_key_no_model_declares_is_written_with_a_warning(tmp_path, capsys):
    result = {"status": "ok", "strategy": "ddp", "precision": "32", "model": "mlp", "optimizer": "adam",
              "output_dir": str(tmp_path), "config": {}, "surprise": 1}  # fmt: skip
    job_result.write_result(str(tmp_path), job_result.Result.of(result))
    written = json.loads((tmp_path / "result.json").read_text())
    assert written["surprise"] == 1 and written["schema_version"] == job_result.SCHEMA_VERSION  # kept, not lost
    assert "surprise: Extra inputs are not permitted" in capsys.readouterr().err
    with pytest.raises(jsonschema.ValidationError, match="surprise"):
        jsonschema.validate(written, json.loads((ROOT / "docs" / "result.schema.json").read_text()))
    (tmp_path / "result.json").unlink()  # not one of the suite's: the session check would count it


@pytest.mark.parametrize("status", job_result.STATUSES)
def test_every_status_is_declared(status):
    assert not job_result.problems({"status": status, "strategy": "ddp", "precision": "32", "model": "mlp",
                                     "optimizer": "adam", "output_dir": "x", "config": {}})  # fmt: skip
    assert job_result.problems({"status": "done", "strategy": "ddp", "precision": "32", "model": "mlp",
                                "optimizer": "adam", "output_dir": "x", "config": {}})  # fmt: skip
