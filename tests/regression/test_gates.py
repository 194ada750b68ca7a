"""The regression gates run as tests: the golden set's recorder and comparison (``golden.py``,
its recording in ``golden/``), the digests of every strategy (``digests.py``) and fairscale's
parity against DDP (``parity.py``), each a command a refactor is held to
(``python -m tests.regression.NAME``; see docs/development/testing.md)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.jobs import ROOT, run_cli, run_measurement

pytestmark = pytest.mark.slow  # each records real jobs end to end


def gate(name: str, *args: str, cwd, timeout: float = 300) -> dict:
    return run_measurement(f"tests.regression.{name}", *args, cwd=cwd, timeout=timeout)


def test_digests_runs(tmp_path):
    data = gate("digests", "--smoke", cwd=tmp_path)
    assert set(data) == {"mlp/ddp"} and data["mlp/ddp"]["l2"] > 0


def test_golden_smoke_records_and_compare_flags_a_change(tmp_path, capsys):
    from tests.regression import golden as gate_module

    data = gate("golden", "record", "recorded", "--smoke", cwd=tmp_path, timeout=600)
    assert data["resume_matches_fresh"] == {"mlp/ddp/32": True, "mlp/fsdp/32": True}
    recorded = tmp_path / "recorded"
    golden = json.loads((recorded / "golden.json").read_text())
    assert {"fault/raise", "plan", "sweep", "sweep/0", "cross/ddp_to_fsdp"} <= set(golden["runs"])
    assert (recorded / "checkpoints" / "mlp" / "fsdp" / "32" / "step_00000003" / ".metadata").exists()

    env = {"PYTHONPATH": str(ROOT)}  # the command as typed, once
    same = run_cli(["compare", str(recorded), str(recorded)], tmp_path, env=env, module="tests.regression.golden")
    assert same.returncode == 0 and "no differences" in same.stdout, same.stdout + same.stderr

    def compare(other) -> tuple[int, str]:
        """The same command's main in this process (a subprocess each: a Python and torch start-up
        per comparison): its exit code and what it printed."""
        capsys.readouterr()
        code = gate_module.main(["compare", str(recorded), str(other)])
        return code, capsys.readouterr().out

    def altered(name: str, change):
        out = tmp_path / name
        out.mkdir()
        copy = json.loads(json.dumps(golden))
        change(copy["runs"])
        (out / "golden.json").write_text(json.dumps(copy))
        return out

    def digest(runs):  # the sum compares bit for bit; the L2 norm within 1e-9 relative
        runs["mlp/fsdp/32/resume"]["values"]["param_digest.sum"] += 1e-12

    def norm(factor):
        def change(runs):
            runs["mlp/fsdp/32/resume"]["values"]["param_digest.l2"] *= factor

        return change

    def peak(factor):
        def change(runs):
            runs["mlp/ddp/32/fresh"]["values"]["memory.peak_allocated_mib_max"] *= factor

        return change

    code, out = compare(altered("digest", digest))
    assert code == 1 and "| mlp/fsdp/32/resume | digest | param_digest.sum |" in out, out
    assert compare(altered("norm_1e-12", norm(1 + 1e-12)))[0] == 0  # another order of a float64 sum
    code, out = compare(altered("norm_1e-6", norm(1 + 1e-6)))
    assert code == 1 and "| mlp/fsdp/32/resume | digest | param_digest.l2 |" in out, out
    assert compare(altered("peak_5pct", peak(1.05)))[0] == 0  # measured: within 10%
    code, out = compare(altered("peak_20pct", peak(1.2)))
    assert code == 1 and "| measured | memory.peak_allocated_mib_max |" in out, out
