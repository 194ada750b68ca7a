"""sharded_exp/plan/table.py: the plan in table, Markdown, CSV and JSON, the same columns in each.

Rows are made up here (as plan_rows returns them), so every cell, unit and shown column is
known: which columns a plan shows, a row's cells in order, the unit, the header, the method
line(s), the notes, the cheapest point and the found values, the CSV and JSON forms.
"""

from __future__ import annotations

import csv
import io
import json

import pytest
from omegaconf import OmegaConf

from sharded_exp.plan import table
from sharded_exp.plan.table import COLUMNS, PARTS


def row(strategy="ddp", world_size=2, total=0.5, method="fake step", note="", fits=True, levers="none", **parts):
    """A planned point: ``parts`` are GiB by part name; any part not given holds nothing; no
    speed predicted."""
    out = {f"{p}_gib": 0.0 for p in PARTS} | {f"{k}_gib": v for k, v in parts.items()} | dict.fromkeys(table.SPEED)
    return out | {"strategy": strategy, "world_size": world_size, "total_gib": total, "mean_gib": total,
                  "allocated_gib": total, "reserved_gib": None, "device_total_gib": None,  # a CPU plan's
                  "fits": fits, "method": method, "note": note, "levers": levers}  # fmt: skip


def config(params=None, find=None, levers=("none",), seq_len=64, budget=80.0):
    return OmegaConf.create({
        "plan": {"params": params, "units": 32, "device_memory_gib": budget, "find": find, "levers": list(levers)},
        "model": {"name": "gpt", "seq_len": seq_len, "d_model": 128},
        "precision": {"name": "bf16"}, "optimizer": {"name": "adam"}, "trainer": {"batch_size": 4},
    })  # fmt: skip


# ------------------------------------------------------------------------------ cells
def test_a_rows_cells_follow_the_columns_in_order():
    r = row(params=1.0, grads=2.0, optimizer=4.0, activations=0.5, total=7.5)
    r["mean_gib"], r["host_gib"] = 7.0, 3.0
    values = dict(zip(COLUMNS, table.cells(r, 1.0)))
    assert list(values) == list(COLUMNS) and len(table.cells(r, 1.0)) == len(COLUMNS)
    assert values["strategy"] == "ddp" and values["levers"] == "none" and values["ranks"] == 2
    assert values["params"] == 1.0 and values["grads"] == 2.0 and values["optim state"] == 4.0
    assert values["activations"] == 0.5
    assert (values["peak"], values["mean"], values["host"], values["fits"]) == (7.5, 7.0, 3.0, "yes")


def test_cells_scale_memory_and_keep_none_as_none():
    r = row(params=2.0, total=3.0, activations=None, fits=False)
    values = dict(zip(COLUMNS, table.cells(r, 1024.0)))
    assert values["params"] == 2048.0 and values["peak"] == 3072.0
    assert values["activations"] is None and values["host"] is None  # none: not zero
    assert values["fits"] == "no"
    r["fits"] = None
    assert dict(zip(COLUMNS, table.cells(r, 1.0)))["fits"] is None


def test_a_row_without_levers_is_planned_with_none():
    r = row()
    del r["levers"]
    assert table.cells(r, 1.0)[COLUMNS.index("levers")] == "none"


def test_memory_is_in_gib_from_one_gib_and_in_mib_below():
    assert table._unit([row(total=0.99), row(total=0.5)]) == ("MiB", 1024.0)
    assert table._unit([row(total=0.99), row(total=1.0)]) == ("GiB", 1.0)
    assert table._unit([row(total=None)]) == ("MiB", 1024.0)  # a failed point counts as nothing


# --------------------------------------------------------------------- shown columns
def test_columns_no_row_holds_anything_in_are_not_shown():
    rows = [row(params=1.0, grads=1.0, optimizer=2.0), row(world_size=8, params=1.0, buckets=0.25)]
    head = table.shown(rows)
    assert head == ["strategy", "levers", "ranks", "params", "grads", "optim state", "buckets", "peak", "mean",
                    "allocated", "fits", *table.SPEED]  # fmt: skip


def test_the_speed_columns_are_shown_in_every_format_under_their_json_keys():
    rows = [row(params=1.0) | {"step_time_s": 0.5, "exposed_comm_s": 0.1, "tokens_per_s_per_device": 800.0,
                               "mfu_pct": 41.0}]  # fmt: skip
    keys = table.column_keys(rows)
    assert all(keys[k] == k for k in table.SPEED)
    head, *lines = table.csv_text(rows).splitlines()
    assert head.split(",")[-5:-1] == list(table.SPEED) and lines[0].split(",")[-5:-1] == ["0.5", "0.1", "800", "41"]


def test_host_memory_is_shown_where_a_row_holds_some():
    rows = [row(params=1.0), row(params=1.0)]
    rows[1]["host_gib"] = 2.0
    assert "host" in table.shown(rows)
    assert "host" not in table.shown(rows[:1]) and "host_node" not in table.shown(rows)
    rows[1] |= {"host_node_gib": 16.0, "host_memory_gib": 2048.0, "host_memory_basis": "h100_sxm's server"}
    assert "host_node" in table.shown(rows) and table.column_keys(rows)["host_node"] == "host_node_gib"
    assert table.host_lines(rows) == [
        "host: CPU offload's pinned shards rounded up to powers of two (torch's CachingHostAllocator); fits also "
        "holds host_node against 2,048 GiB (h100_sxm's server)"
    ]
    assert table.host_lines(rows[:1]) == []
    why = "h100_hbm2e_500w states no server memory: set plan.host_memory_gib"
    rows[1] |= {"host_memory_gib": None, "host_memory_basis": why}
    assert table.host_lines(rows)[0].endswith(f"host unchecked: {why}")


def test_a_method_column_numbers_the_methods_only_where_they_differ():
    same = [row(method="a", params=1.0), row(method="a", world_size=4, params=1.0)]
    head, body = table._body(same, 1.0)
    assert "method" not in head
    rows = [row(method="a", params=1.0), row(method="b", params=1.0), row(method="a", params=1.0)]
    head, body = table._body(rows, 1.0)
    assert head[-1] == "method"
    assert [line[-1] for line in body] == [1, 2, 1]
    assert table.methods(rows) == ["a", "b"]  # in order of first appearance, each once


def test_the_body_holds_the_shown_columns_of_each_row_scaled():
    rows = [row(params=1.0, total=1.0), row(strategy="fsdp", params=0.25, total=0.25)]
    head, body = table._body(rows, 1024.0)
    assert head == ["strategy", "levers", "ranks", "params", "peak", "mean", "allocated", "fits", *table.SPEED]
    speed = [None] * len(table.SPEED)  # no speed predicted for these rows: "-" in the table
    assert body == [["ddp", "none", 2, 1024.0, 1024.0, 1024.0, 1024.0, "yes", *speed],
                    ["fsdp", "none", 2, 256.0, 256.0, 256.0, 256.0, "yes", *speed]]  # fmt: skip


# ------------------------------------------------------------------------------- text
def test_the_header_names_a_model_with_its_count_sequence_and_budget():
    head = table.header(config(budget=40.0), 7_000_000_000, "gpt_7b", "cuda (faked)")
    assert head[0] == ("plan: model=gpt_7b (7.00 B params), sequence 64, precision bf16, optimizer adam, "
                       "batch 4 per rank, device budget 40 GiB")  # fmt: skip
    assert head[1] == "device: cuda (faked)"
    small = table.header(config(), 12_345, "mlp", "cpu")[0]
    assert small.startswith("plan: model=mlp (12,345 params), sequence 64,")
    assert table.header(config(), 99_999_999, "m", "cpu")[0].startswith("plan: model=m (99,999,999 params)")
    assert table.header(config(), 100_000_000, "m", "cpu")[0].startswith("plan: model=m (0.10 B params)")


def test_the_header_of_a_raw_count_says_its_units_and_no_sequence():
    head = table.header(config(params=7.5e9), 7_500_000_000, "mlp", "cpu")
    assert head[0].startswith("plan: raw parameter count 7.50 B params in 32 units, precision bf16,")
    assert "sequence" not in head[0]
    assert "sequence" not in table.header(config(seq_len=None), 10, "mlp", "cpu")[0]


def test_the_table_says_its_method_once_and_its_unit():
    rows = [row(params=0.5, total=0.5), row(world_size=4, params=0.25, total=0.25)]
    out = table.text(rows, [], config(), 10, "gpt", "cpu").splitlines()
    assert out[2] == "method: fake step"
    assert out[3] == "MiB per rank at the peak; - : not applicable"
    assert out[4] == ""
    assert out[5].split() == [
        "strategy",
        "levers",
        "ranks",
        "params",
        "peak",
        "mean",
        "allocated",
        "fits",
        *table.SPEED,
    ]
    assert out[7].split() == ["ddp", "none", "2", "512.00", "512.00", "512.00", "512.00", "yes", "-", "-", "-", "-"]


def test_a_table_of_several_methods_numbers_them():
    rows = [row(method="composed", params=2.0, total=2.0), row(method="whole", params=1.0, total=1.0)]
    out = table.text(rows, [], config(), 10, "gpt", "cpu").splitlines()
    assert out[2:5] == ["method 1: composed", "method 2: whole", "GiB per rank at the peak; - : not applicable"]
    assert out[6].split()[-1] == "method"


def test_markdown_breaks_its_header_lines_and_draws_a_github_table():
    out = table.text([row(params=1.0, total=1.0)], [], config(), 10, "gpt", "cpu", markdown=True).splitlines()
    assert all(line.endswith("  ") for line in out[:4])
    assert out[5].startswith("| strategy") and set(out[6]) <= set("|-: ")


def test_a_part_that_is_none_is_drawn_as_a_dash():
    rows = [row(params=1.0, activations=None, total=1.0), row(params=1.0, activations=0.5, total=1.5)]
    out = table.text(rows, [], config(), 10, "gpt", "cpu").splitlines()
    head = out[5].split()
    assert out[7].split()[head.index("activations")] == "-"


def test_notes_follow_the_table_each_once_naming_its_rows():
    rows = [row(strategy="zero1", note="z"), row(strategy="ddp", note="d"), row(strategy="ddp", world_size=8, note="d"),
            row(strategy="ddp", world_size=64, note="e"), row(strategy="ddp", world_size=8, levers="ac", note="d"),
            row(strategy="oss", note="")]  # fmt: skip
    out = table.text(rows, [], config(), 10, "gpt", "cpu").splitlines()
    notes = [line for line in out if line.startswith("note:")]
    assert notes == ["note: zero1 x2: z", "note: ddp x2, x8: d", "note: ddp x64: e", "note: ddp + ac x8: d"]
    assert out[out.index(notes[0]) - 1] == ""
    unpriced = row(strategy="fsdp", levers="offload") | {"speed_note": "this: cpu_offload's copies need the host link"}
    out = table.text([unpriced], [], config(), 10, "gpt", "cpu").splitlines()
    assert "note: fsdp + offload x2: speed not predicted: this: cpu_offload's copies need the host link" in out


def test_the_cheapest_point_that_fits_is_named_where_levers_are_planned():
    rows = [
        row(strategy="fsdp", total=0.5, params=0.5),
        row(strategy="ddp", total=0.75, params=0.75),
        row(strategy="ddp", levers="ac", total=0.25, params=0.25),
    ]
    rows[2]["cost"] = "recompute"
    out = table.text(rows, [], config(levers=["none", "ac"]), 10, "gpt", "cpu").splitlines()
    assert out[-1] == "cheapest that fits at 2 ranks: ddp (768.00 MiB)"
    rows[1]["fits"] = rows[0]["fits"] = False
    out = table.text(rows, [], config(levers=["none", "ac"]), 10, "gpt", "cpu").splitlines()
    assert out[-1] == "cheapest that fits at 2 ranks: ddp + ac (256.00 MiB; recompute)"
    # no levers planned: no such line
    assert "cheapest" not in table.text(rows[:2], [], config(), 10, "gpt", "cpu")
    # nor for a raw parameter count
    assert "cheapest" not in table.text(rows, [], config(params=1e9, levers=["none", "ac"]), 10, "gpt", "cpu")


def test_the_values_found_are_listed_under_what_was_sought():
    found = [{"strategy": "fsdp", "levers": "none", "world_size": 8, "value": 12, "note": "checked by fake steps"},
             {"strategy": "ddp", "levers": "ac", "world_size": 8, "value": 3, "note": "n"}]  # fmt: skip
    out = table.text([row(params=1.0)], found, config(find="batch_size", budget=0.5), 10, "gpt", "cpu").splitlines()
    assert out[-3:] == ["largest batch per rank that fits 0.5 GiB:", "  fsdp x8: 12 (checked by fake steps)",
                        "  ddp + ac x8: 3 (n)"]  # fmt: skip
    out = table.text([row(params=1.0)], found[:1], config(find="depth"), 10, "gpt", "cpu").splitlines()
    assert out[-2] == "largest depth at d_model=128 that fits 80 GiB:"


# -------------------------------------------------------------------- CSV and JSON
def test_csv_holds_the_shown_columns_in_gib_with_empty_cells_for_none():
    rows = [row(params=0.123456789, activations=None, total=0.123456789),
            row(strategy="fsdp", world_size=8, params=1.0, activations=2.0, total=3.0, fits=False)]  # fmt: skip
    lines = list(csv.reader(io.StringIO(table.csv_text(rows))))
    assert lines[0] == ["strategy", "levers", "ranks", "params", "activations", "peak", "mean", "allocated", "fits",
                        *table.SPEED, "note"]  # fmt: skip
    assert lines[1] == [
        "ddp",
        "none",
        "2",
        "0.123457",
        "",
        "0.123457",
        "0.123457",
        "0.123457",
        "yes",
        "",
        "",
        "",
        "",
        "",
    ]
    assert lines[2] == ["fsdp", "none", "8", "1", "2", "3", "3", "3", "no", "", "", "", "", ""]
    assert not table.csv_text(rows).endswith("\n")


def test_csv_says_each_rows_method_and_note_in_words():
    """A CSV has no header lines for the methods' legend or the notes: they are its last columns."""
    rows = [row(method="fake step", note="a, b"), row(strategy="oss", method="fake step without clipping"),
            row(strategy="fsdp", note="n") | {"speed_note": "no host link"}]  # fmt: skip
    lines = list(csv.reader(io.StringIO(table.csv_text(rows))))
    assert lines[0][-2:] == ["method", "note"]
    assert lines[1][-2:] == ["fake step", "a, b"] and lines[2][-2:] == ["fake step without clipping", ""]
    assert lines[3][-1] == "n; speed not predicted: no host link"
    assert list(table.column_keys(rows))[-1] == "method"  # the note is said under a table, not a column of it


def test_json_is_the_document_indented():
    doc = {"rows": [row()], "found": [], "params": 10}
    text = table.json_text(doc)
    assert json.loads(text) == doc and "\n  " in text


def test_each_shown_column_has_its_key_in_a_json_row():
    rows = [row(params=1.0, optimizer_step=0.5, communication=0.1)]
    rows[0]["host_gib"] = 1.0
    keys = table.column_keys(rows)
    assert keys == {"strategy": "strategy", "levers": "levers", "ranks": "world_size", "params": "params_gib",
                    "optim step": "optimizer_step_gib", "comm": "communication_gib", "peak": "total_gib",
                    "mean": "mean_gib", "host": "host_gib", "allocated": "allocated_gib", "fits": "fits",
                    **{k: k for k in table.SPEED}}  # fmt: skip
    assert all(k in rows[0] for k in keys.values())


@pytest.mark.parametrize("part", PARTS)
def test_every_part_has_a_meaning_under_its_heading(part):
    heading = table.HEADINGS.get(part, part)
    assert heading in COLUMNS
    assert heading in table.MEANINGS or part == "other"


# ------------------------------------------------------------------ the allocator's columns
def cuda_row(**kw):
    r = row(params=1.0, total=1.0, **kw)
    return r | {"allocated_gib": 1.01, "reserved_gib": 1.25, "device_total_gib": 1.75, "context_gib": 0.5,
                "context_source": "a published figure", "alloc_conf": "expandable_segments:True"}  # fmt: skip


def test_a_cuda_plan_shows_allocated_reserved_and_the_device_total_and_says_what_it_modelled():
    rows = [cuda_row()]
    assert table.shown(rows)[-8:-4] == ["allocated", "reserved", "device_total", "fits"]
    values = dict(zip(COLUMNS, table.cells(rows[0], 1.0)))
    assert (values["allocated"], values["reserved"], values["device_total"]) == (1.01, 1.25, 1.75)
    out = table.text(rows, [], config(), 10, "gpt", "cuda")
    assert "modelled with expandable_segments:True" in out and "CUDA context 512 MiB: a published" in out
    assert table.column_keys(rows)["device_total"] == "device_total_gib"
    csv_head = next(csv.reader(io.StringIO(table.csv_text(rows))))
    assert csv_head[-9:-5] == ["allocated", "reserved", "device_total", "fits"]


def test_a_cpu_plan_shows_no_reserved_and_says_nothing_of_an_allocator():
    rows = [row(params=1.0, total=1.0)]
    assert "reserved" not in table.shown(rows) and "device_total" not in table.shown(rows)
    assert "allocator" not in table.text(rows, [], config(), 10, "gpt", "cpu")


# ------------------------------------------------------------- the short terminal table
def wide_rows():
    """A 7B-sized plan on CUDA: every part held, the allocator's columns, the speed columns,
    long notes: its full table is near 300 characters wide."""
    out = []
    for strategy, ws in [("ddp", 8), ("fsdp_grad_op", 64), ("sharded_ddp", 64)]:
        r = row(
            strategy=strategy,
            world_size=ws,
            total=150.23,
            params=25.01,
            grads=25.01,
            optimizer=50.03,
            optimizer_step=25.01,
            gathered=12.51,
            buckets=25.01,
            activations=8.19,
            temporaries=1.24,
            communication=0.5,
            other=0.02,
            workspace=0.03,
            note="drawn from 1 and 2 blocks (checked at 3); " * 4,
        )
        r |= {"mean_gib": 150.0, "host_gib": 1.5, "allocated_gib": 150.23, "reserved_gib": 165.22,
              "device_total_gib": 165.63, "step_time_s": 0.2431, "exposed_comm_s": 0.0294,
              "tokens_per_s_per_device": 1.993e7, "mfu_pct": 45.3}  # fmt: skip
        out.append(r)
    return out


def short(rows, **kw):
    return table.text(rows, [], config(**kw), 6_700_000_000, "gpt_7b", "cuda, " + "the kernels CUDA picks " * 10,
                      speed="speed: " + "a device profile " * 10, columns="short")  # fmt: skip


def test_the_default_terminal_table_fits_100_characters_a_line():
    rows = wide_rows()
    assert max(len(line) for line in table.text(rows, [], config(), 10, "gpt", "cuda").splitlines()) > 200  # all
    lines = short(rows).splitlines()
    assert max(len(line) for line in lines) <= 100
    at = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    head = lines[at].split()
    assert head[:2] == ["strategy", "ranks"] and {"peak", "fits", "params", "optim", "activ"} <= set(head)
    assert "levers" not in head  # every row has none
    assert lines[at + 2].split()[:2] == ["ddp", "8"] and "150.23" in lines[at + 2].split()


def test_the_short_table_names_the_columns_it_leaves_out_and_keeps_the_most_telling():
    rows = wide_rows()
    head, body = table._body(rows, 1.0)
    lines, left_out = table.short_table(head, body, width=60)
    assert max(len(line) for line in lines) <= 60
    shown = lines[0].split()
    assert shown == [table.SHORT.get(c, c) for c in head if c not in left_out and c != "levers"]
    assert shown[:2] == ["strategy", "ranks"] and "peak" in shown and "fits" in shown
    assert "reserved" in left_out and "allocated" in left_out  # the least telling go first
    text = short(rows)
    assert "not shown here: " in text and "(plan.columns=all shows every column)" in text


def test_the_short_table_shows_mfu_only_beside_the_step_time_it_is_worked_out_from():
    """A step time too wide for what is left of the line, MFU narrow enough: neither is shown."""
    head = ["strategy", "ranks", "peak", "step_time_s", "mfu_pct"]
    body = [["ddp", 2, 1.0, 0.000176312345, 48.3]]
    lines, left_out = table.short_table(head, body, width=30)
    assert lines[0].split() == ["strategy", "ranks", "peak"] and left_out == ["step_time_s", "mfu_pct"]
    lines, left_out = table.short_table(head, body, width=60)
    assert lines[0].split() == ["strategy", "ranks", "peak", "step_s", "mfu%"] and left_out == []


def test_the_short_table_shows_levers_when_a_row_has_one_and_aligns_text_left():
    rows = [row(params=1.0, total=1.0), row(params=1.0, total=0.5, levers="ac")]
    head, body = table._body(rows, 1.0)
    lines, left_out = table.short_table(head, body)
    assert lines[0].split()[:3] == ["strategy", "levers", "ranks"] and not left_out
    assert lines[2].startswith("ddp       none") and lines[3].split()[:3] == ["ddp", "ac", "2"]


def test_the_columns_setting_leaves_markdown_whole():
    rows = wide_rows()
    assert table.text(rows, [], config(), 10, "gpt", "cuda", markdown=True, columns="short") == table.text(
        rows, [], config(), 10, "gpt", "cuda", markdown=True
    )


def test_the_allocator_line_says_what_was_modelled_and_what_fits_compares():
    modelled = row() | dict(
        reserved_gib=1.0, device_total_gib=1.5, context_gib=0.5, context_source="src", alloc_conf=""
    )
    assert table.allocator_lines([modelled]) == [
        "allocator: torch's CUDA caching allocator modelled with torch's default settings; fits compares "
        "device_total (reserved + CUDA context 512 MiB: src)"
    ]
    expandable = modelled | {"alloc_conf": "expandable_segments:True"}
    assert "modelled with expandable_segments:True;" in table.allocator_lines([expandable])[0]
    pool = row() | dict(context_gib=0.5, context_source="src", alloc_conf="backend:cudaMallocAsync")
    (line,) = table.allocator_lines([pool])
    assert line.startswith("allocator: backend:cudaMallocAsync: the driver's pool, not torch's caching allocator")
    assert "fits compares the tensors' peak + CUDA context 512 MiB" in line
    assert table.allocator_lines([row()]) == []  # a CPU plan: no allocator
