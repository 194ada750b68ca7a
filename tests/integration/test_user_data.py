"""Your data (issue 26): CoNLL, text / JSON lines, ``datasets`` and custom Datasets read through
a DataLoader with a DistributedSampler, the refusals before any rank starts, and a resumed
run that sees exactly the batches of the uninterrupted one.

Every file here is made by the test (tests/helpers/data_files.py): no downloads. The real 2-rank
runs of each data option are tests/integration/test_coverage.py's covering runs.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from sharded_exp.compose import compose
from sharded_exp.data import Task, build_task, probe_batch
from sharded_exp.data.files import CONLL2003_LABELS, read_conll, read_documents
from sharded_exp.data.loader import StepLoader, data_changes
from sharded_exp.errors import ConfigError
from sharded_exp.launch import preflight
from sharded_exp.logs import LOG_NAME
from tests.helpers import data_files
from tests.helpers.jobs import launch_job, read_result, saved_tiny_hf


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("user_data")
    data_files.write_conll(d / "train.conll", n=40)
    data_files.write_text(d / "corpus.txt", n=40)
    data_files.write_jsonl(d / "corpus.jsonl", n=40)
    data_files.train_tokenizer(d / "tok")
    return d


def bert(files: Path, *extra: str) -> list[str]:
    return ["model=hf_bert", "model.seq_len=24", "data=conll", f"data.path={files / 'train.conll'}",
            f"data.tokenizer={files / 'tok'}", *extra]  # fmt: skip


def task_of(overrides: list[str], batch_size: int = 4) -> Task:
    cfg = compose(overrides)
    return build_task(cfg.data, cfg.model, batch_size)


# ---------------------------------------------------------------------- samples and batches
def test_conll_labels_each_word_on_its_first_sub_token(files):
    """A word's tag on its first sub-token, -100 on its other sub-tokens and on padding; the
    padding is to model.seq_len, with attention_mask 0."""
    from sharded_exp.data.files import CONLL2003_LABELS, load_tokenizer

    task = task_of(bert(files))
    sentences = data_files.sentences(40)
    tokenizer = load_tokenizer(str(files / "tok"))
    split_words = 0
    for i, sentence in enumerate(sentences):
        sample = task.dataset[i]
        labelled = sample["labels"][sample["labels"] != -100].tolist()
        assert labelled == [CONLL2003_LABELS.index(t) for _, t in sentence][: len(labelled)]
        pieces = [len(tokenizer.tokenize(w)) for w, _ in sentence]
        split_words += sum(p > 1 for p in pieces)
        assert len(sample["input_ids"]) == min(24, sum(pieces))
    assert split_words > 0  # some words are cut into sub-tokens, so the -100s above were tested
    batch = task.collate([task.dataset[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 24)
    pad = batch["attention_mask"] == 0
    assert pad.any() and (batch["labels"][pad] == -100).all() and (batch["input_ids"][pad] == 0).all()
    assert task.metric == "token_accuracy" and task.num_classes == 9


@pytest.mark.slow  # 4 s: datasets' import, and four tasks
def test_text_and_json_lines_and_a_saved_dataset_give_the_same_blocks(files, tmp_path):
    """The same documents as plain text, as JSON lines and as a ``datasets`` dataset (from
    load_dataset on the JSON file, and from save_to_disk) are cut into the same blocks."""
    gpt = ["model=hf_gpt2", "model.seq_len=16", f"data.tokenizer={files / 'tok'}"]
    text = task_of([*gpt, "data=text_file", f"data.path={files / 'corpus.txt'}"]).dataset
    lines = task_of([*gpt, "data=text_file", f"data.path={files / 'corpus.jsonl'}", "data.text_field=body"]).dataset
    loaded = task_of(
        [*gpt, "data=hf_dataset", "data.format=json", f"data.path={files / 'corpus.jsonl'}", "data.text_field=body"]
    ).dataset
    data_files.save_dataset(tmp_path / "saved", n=40)
    saved = task_of([*gpt, "data=hf_dataset", f"data.path={tmp_path / 'saved'}"]).dataset
    assert len(text) > 10
    for other in (lines, loaded, saved):
        assert len(other) == len(text)
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(text, other))
    assert all(torch.equal(s["input_ids"], s["labels"]) and len(s["input_ids"]) == 16 for s in text)
    # and a saved token-classification dataset gives the CoNLL file's samples
    conll = task_of(bert(files)).dataset
    ner = task_of(bert(files, "data=hf_dataset", f"data.path={tmp_path / 'saved'}", "data.kind=token_classification"))
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(conll, ner.dataset))


# ---------------------------------------------------------------------- the loader
class Indices(torch.utils.data.Dataset):
    """Items that say which sample they are."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i]), "labels": torch.tensor([i])}


def index_task(n: int, workers: int = 0) -> Task:
    return Task(lambda s, m, r: {}, "accuracy", labels="labels", dataset=Indices(n), collate=torch.utils.data.default_collate, seed=3, num_workers=workers)  # fmt: skip


def stream(loader: StepLoader, steps: int) -> list[list[int]]:
    return [b["input_ids"].flatten().tolist() for _ in range(steps) for b in loader.get(0)]


def test_each_rank_reads_its_own_shard_of_each_epoch_and_resumes_where_it_stopped():
    """2 ranks, 23 samples, batch 3: each rank 3 micro-batches per epoch (the tails dropped),
    disjoint between ranks, another order every epoch. A loader started at a checkpoint's
    position (mid-epoch, with worker processes) yields exactly the batches the uninterrupted
    one does from there; one started at the wrong position does not."""
    cpu = torch.device("cpu")
    loaders = [StepLoader(index_task(23), rank, 2, 3, 2, cpu) for rank in (0, 1)]
    assert loaders[0].per_epoch == 3
    full = [stream(loader, 6) for loader in loaders]  # 12 micro-batches: 4 epochs
    for epoch in range(4):
        shards = [sum(f[epoch * 3 : epoch * 3 + 3], []) for f in full]
        assert len(set(shards[0])) == 9 and not set(shards[0]) & set(shards[1])
    assert sum(full[0][0:3], []) != sum(full[0][3:6], [])  # set_epoch reshuffles
    # resume after step 2 (micro-batch 4: epoch 1, batch 1) from the recorded position
    first = StepLoader(index_task(23), 1, 2, 3, 2, cpu)
    stream(first, 2)
    position = first.position()
    assert position == {"epoch": 1, "samples": 6, "length": 23}  # (and what the data is: its length)
    resumed = StepLoader(index_task(23, workers=2), 1, 2, 3, 2, cpu, start=2, position=position)
    assert stream(resumed, 4) == full[1][4:12]
    resumed.close()
    wrong = StepLoader(index_task(23), 1, 2, 3, 2, cpu, position={"epoch": 1, "samples": 0})
    assert stream(wrong, 4) != full[1][4:12]


# ---------------------------------------------------------------------- refusals, before spawn
REFUSALS = {
    "no file": (["data.path=/nonexistent/train.conll"], "data.path=/nonexistent/train.conll does not exist"),
    "a hub name": (["data.tokenizer=bert-base-cased"], "data.tokenizer=bert-base-cased is not a local directory"),
    "no tokenizer there": (["data.tokenizer=__files__"], "holds no tokenizer transformers can load"),
    "a tag not in labels": (["data.labels=[O,B-PER,I-PER]"], "not one of data.labels (O, B-PER, I-PER)"),
    "more labels than the model": (["model.num_labels=5"], "set model.num_labels=9"),
    "a tokenizer larger than the vocab": (["model.vocab_size=50"], "set model.vocab_size=120"),
    "too little data": (
        ["trainer.batch_size=16", "trainer.world_size=4"],
        "has 40 samples, fewer than one micro-batch",
    ),
    "no path given": (["~data.path"], "data=conll needs data.path=..."),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_data_is_refused_before_any_rank_starts(case, files, tmp_path):
    overrides, message = REFUSALS[case]
    overrides = [o.replace("__files__", str(files)) for o in overrides]
    cfg = compose(bert(files, "logger=none", *[o for o in overrides if not o.startswith("~")]))
    if "~data.path" in overrides:
        cfg = compose(["model=hf_bert", "data=conll", f"data.tokenizer={files / 'tok'}", "logger=none"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight.check(cfg, str(tmp_path), peak=False)


def gpt(files: Path, *extra: str) -> list[str]:
    return ["model=hf_gpt2", "model.seq_len=16", "data=text_file", f"data.path={files / 'corpus.txt'}",
            f"data.tokenizer={files / 'tok'}", *extra]  # fmt: skip


def refused(overrides: list[str], tmp_path: Path) -> str:
    """The pre-flight's refusal of ``overrides`` (it must refuse them)."""
    with pytest.raises(ConfigError) as err:
        preflight.check(compose([*overrides, "logger=none"]), str(tmp_path / "out"), peak=False)
    return str(err.value)


@pytest.mark.parametrize("data", ["conll", "text_file"])
def test_a_tokenizer_that_cannot_encode_the_data_is_refused(data, files, tmp_path_factory, tmp_path):
    """A directory a model's save_pretrained wrote (config.json and weights, no tokenizer
    files) loads as a GPT2Tokenizer of one token that encodes every word to nothing: CoNLL
    labels all -100 (loss NaN), text blocks of end-of-text tokens alone. Refused, naming the
    directory and what it lacks. A real tokenizer that knows none of the data's words (another
    script: each word [UNK]) is refused by its share of unknown tokens."""

    def overrides(files, *extra):  # one sample a micro-batch: the empty tokenizer's data would fit
        return (bert if data == "conll" else gpt)(files, "trainer.world_size=1", "trainer.batch_size=1", *extra)

    model_dir = saved_tiny_hf(tmp_path_factory, "gpt2")
    path = files / ("train.conll" if data == "conll" else "corpus.txt")
    message = refused(overrides(files, f"data.tokenizer={model_dir}"), tmp_path)
    assert message == (
        f"data.tokenizer={model_dir} cannot encode data.path={path}: its words give no tokens at all "
        "(GPT2Tokenizer, vocabulary of 1); the directory holds no tokenizer files (no tokenizer.json or "
        "tokenizer_config.json; it has config.json, generation_config.json, model.safetensors), so transformers "
        "made an empty tokenizer: save the data's tokenizer there with tokenizer.save_pretrained(DIR)"
    )
    foreign = tmp_path / f"foreign.{data}"
    if data == "conll":
        foreign.write_text("-DOCSTART- -X- -X- O\n\n" + "Пётр NN I-NP B-PER\nсказал NN I-NP O\n\n" * 8)
    else:
        foreign.write_text("Пётр сказал слово\n" * 40)
    message = refused(overrides(files, f"data.path={foreign}"), tmp_path)
    assert re.fullmatch(
        rf"data\.tokenizer={re.escape(str(files / 'tok'))} cannot encode data\.path={re.escape(str(foreign))}: "
        r"100% of its \d+ word tokens are special or unknown \(\w+, vocabulary of 120\): "
        "use the tokenizer the data and the model were made with",
        message,
    ), message


MALFORMED = {
    # case: (data option, file name, its bytes (None: a directory), the message after data.path=<it>)
    "an empty text file": ("text_file", "empty.txt", b"", "holds no samples (data=text_file: no documents)"),
    "a CoNLL file of no sentence": ("conll", "empty.conll", b"-DOCSTART- -X- -X- O\n\n",
                                    "holds no samples (data=conll: no sentences)"),
    "a Latin-1 CoNLL file": ("conll", "latin1.conll",
                             "-DOCSTART- -X- -X- O\n\nPeter NN I-NP B-PER\nJosé NN I-NP I-PER\n".encode("latin-1"),
                             "is not UTF-8 (line 4): save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"),
    "a Latin-1 text file": ("text_file", "latin1.txt", "Peter met Maria\nJosé said\n".encode("latin-1"),
                            "is not UTF-8 (line 2)"),
    "a null as text": ("hf_dataset", "null.jsonl", b'{"text": "Peter met Maria"}\n{"text": null}\n',
                       "row 1 has no text (data.text_field=text holds None, not a string)"),
    "a number as text": ("hf_dataset", "number.jsonl", b'{"text": 3}\n{"text": 4}\n',
                         "row 0 has no text (data.text_field=text holds 3, not a string)"),
    "a directory for a file": ("conll", "a_directory", None, "is a directory, not a file: give the CoNLL file itself"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_data_files_are_refused_naming_the_file(case, files, tmp_path):
    """What the tokenizer or the reader would raise from inside a rank (IndexError on no
    documents, UnicodeDecodeError, TypeError: TextEncodeInput, IsADirectoryError) is a
    ConfigError of the pre-flight: exit 2 and no run directory, as every refused value."""
    data, name, content, message = MALFORMED[case]
    path = tmp_path / name
    path.mkdir() if content is None else path.write_bytes(content)
    overrides = {
        "conll": bert(files, f"data.path={path}"),
        "text_file": gpt(files, f"data.path={path}"),
        "hf_dataset": gpt(files, "data=hf_dataset", "data.format=json", f"data.path={path}"),
    }[data]
    assert refused(overrides, tmp_path).startswith(f"data.path={path} {message}")


def test_a_byte_order_mark_is_not_read_as_a_word(files, tmp_path):
    """A UTF-8 byte order mark (an editor's) at the start of a file: the same sentences and
    documents as without it (not a sentence ['\ufeff-DOCSTART-'])."""
    bom = b"\xef\xbb\xbf"
    conll, text = tmp_path / "bom.conll", tmp_path / "bom.txt"
    conll.write_bytes(bom + (files / "train.conll").read_bytes())
    text.write_bytes(bom + (files / "corpus.txt").read_bytes())
    assert read_conll(str(conll), CONLL2003_LABELS) == read_conll(str(files / "train.conll"), CONLL2003_LABELS)
    assert read_documents(str(text), "text") == read_documents(str(files / "corpus.txt"), "text")


def test_a_custom_factory_that_is_no_dataset_is_refused(tmp_path):
    cfg = compose(["model=mlp", "data=custom", "data._target_=builtins.list", "logger=none"])
    with pytest.raises(ConfigError, match=r"data\._target_=builtins\.list returned list, not a map-style"):
        preflight.check(cfg, str(tmp_path), peak=False)


def test_the_planner_needs_no_file():
    """The fake step's probe: without data.path, a user's data is planned at the shapes of the
    synthetic task of its layout (padded to model.seq_len)."""
    cfg = compose(["model=hf_bert", "data=conll", "model.seq_len=24"])
    batch = probe_batch(cfg.data, cfg.model, 0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"} and batch["input_ids"].shape == (1, 24)


def test_values_of_a_custom_dataset_that_are_no_tensors_reach_the_model_unchanged():
    """A custom item with a string and a list (default_collate makes them a list of strings
    and a list of tensors): the training batches and evaluation pass them on as they are;
    only tensors are copied to the device."""
    from types import SimpleNamespace

    from sharded_exp.train.evaluate import evaluate

    task = task_of(["model=mlp", "data=custom", "data._target_=tests.helpers.data_files.Tagged", "+data.kwargs.n=16",
                    "+data.kwargs.in_features=4", "+data.kwargs.classes=3", "data.labels=targets",
                    "data.metric=accuracy", "data.num_classes=3"])  # fmt: skip
    (batch,) = StepLoader(task, 0, 1, 4, 1, torch.device("cpu"), position={"epoch": 0, "samples": 0}).get(0)
    assert len(batch["name"]) == 4 and all(n.startswith("item ") for n in batch["name"])
    assert len(batch["span"]) == 2 and torch.equal(batch["span"][1], batch["span"][0] + 1)
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4, 3)

        def forward(self, inputs, targets, name, span):
            seen.append((name, span))
            logits = self.head(inputs)
            return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, targets)}

    values = evaluate(SimpleNamespace(model=Model()), task, torch.autocast("cpu", enabled=False),
                      torch.device("cpu"), 2, 0)  # fmt: skip
    assert "eval/accuracy" in values and len(seen) == 2 and all(isinstance(n, list) for n, _ in seen)


# ---------------------------------------------------------------------- deterministic resume
def test_the_data_position_records_the_data_and_a_change_is_told(files, tmp_path, monkeypatch):
    """A checkpoint's data position holds the dataset's length, path and content (sha256);
    resumed on another file, or on the same file edited, each difference is a resume change
    (not a refusal). A position of an older checkpoint, without them, compares nothing."""
    import hashlib

    from sharded_exp.data import files as data_files_module

    first, other = (
        data_files.write_conll(tmp_path / "a.conll", n=64),
        data_files.write_conll(tmp_path / "b.conll", n=20),
    )
    task = task_of(bert(files, f"data.path={first}"))
    position = StepLoader(task, 0, 1, 4, 1, torch.device("cpu")).position()
    digest = f"sha256:{hashlib.sha256(first.read_bytes()).hexdigest()}"
    assert position == {"epoch": 0, "samples": 0, "length": 64, "path": str(first), "content": digest}
    assert data_changes(position, task) == []
    changed = task_of(bert(files, f"data.path={other}"))
    assert data_changes(position, changed) == [
        {"key": "data.length", "checkpoint": 64, "config": 20},
        {"key": "data.path", "checkpoint": str(first), "config": str(other)},
        {"key": "data.content", "checkpoint": digest, "config": changed.fingerprint["content"]},
    ]
    data_files.write_conll(first, n=64, seed=1)  # edited in place: as many sentences, other words
    assert [c["key"] for c in data_changes(position, task_of(bert(files, f"data.path={first}")))] == ["data.content"]
    assert data_changes({"epoch": 0, "samples": 8}, changed) == []
    monkeypatch.setattr(data_files_module, "HASHED_UP_TO", 10)  # a large file: by size and modification time
    assert data_files_module.fingerprint(str(first))["content"] == (
        f"size:{first.stat().st_size},mtime_ns:{first.stat().st_mtime_ns}"
    )


@pytest.mark.slow  # two runs of one rank
def test_a_run_resumed_on_other_data_records_the_change(files, tmp_path):
    """Resumed with data.path switched from 64 sentences to 20: resumed, and result.json's
    resume_changes says what changed in the data."""
    first, other = (
        data_files.write_conll(tmp_path / "a.conll", n=64),
        data_files.write_conll(tmp_path / "b.conll", n=20),
    )
    common = bert(files, "trainer.world_size=1", "trainer.batch_size=4", "trainer.warmup_steps=1",
                  "trainer.eval_batches=0", "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={tmp_path / 'c'}")  # fmt: skip
    launch_job([*common, f"data.path={first}", "trainer.steps=2"], tmp_path / "first")
    # The ranks append to the job's log file, as under Hydra's job logging (their stderr is the
    # fork server's, which an earlier test may have started: no capture here sees it reliably)
    log = logging.FileHandler(tmp_path / LOG_NAME)
    logging.getLogger().addHandler(log)
    try:
        resumed = launch_job(
            [*common, f"data.path={other}", "trainer.steps=4", "trainer.resume=auto"], tmp_path / "again"
        )
    finally:
        logging.getLogger().removeHandler(log)
        log.close()
    said = (tmp_path / LOG_NAME).read_text()
    assert resumed["status"] == "ok" and resumed["start_step"] == 2
    changes = {c["key"]: (c["checkpoint"], c["config"]) for c in read_result(tmp_path / "again")["resume_changes"]}
    assert changes["data.length"] == (64, 20) and changes["data.path"] == (str(first), str(other))
    assert set(changes) == {"data.length", "data.path", "data.content"}
    assert "warning: resuming on other data than the checkpoint's: data.length=20 (the checkpoint's: 64)" in said


@pytest.mark.slow
def test_a_resumed_run_sees_the_batches_of_the_uninterrupted_run(files, tmp_path):
    """2 ranks on the CoNLL file (40 sentences, 5 micro-batches per rank per epoch, 2 DataLoader
    workers each): 8 steps uninterrupted, and 3 steps then resumed from their checkpoint
    (mid-epoch 0) to 8, across the epoch's end. Every resumed step's loss equals the uninterrupted run's, bit for bit."""
    common = bert(
        files, "trainer.batch_size=4", "trainer.log_interval=1", "trainer.warmup_steps=1", "data.num_workers=2",
        "trainer.checkpoint_every=3", "trainer.checkpoint_format=consolidated", "trainer.eval_batches=0",
    )  # fmt: skip
    whole = launch_job([*common, "trainer.steps=8", f"trainer.checkpoint_dir={tmp_path / 'a'}"], tmp_path / "whole")
    launch_job([*common, "trainer.steps=3", f"trainer.checkpoint_dir={tmp_path / 'b'}"], tmp_path / "first")
    meta = json.loads((tmp_path / "b" / "step_00000003" / "meta.json").read_text())
    assert {k: meta["data"][k] for k in ("epoch", "samples", "length")} == {"epoch": 0, "samples": 24, "length": 40}
    resumed = launch_job(
        [*common, "trainer.steps=8", f"trainer.checkpoint_dir={tmp_path / 'b'}", "trainer.resume=auto"],
        tmp_path / "resumed",
    )
    assert resumed["start_step"] == 3 and read_result(tmp_path / "resumed")["steps_done"] == 8
    assert read_result(tmp_path / "resumed")["resume_changes"] == []  # the same data
    losses = {h["step"]: h["loss"] for h in whole["history"]}
    again = {h["step"]: h["loss"] for h in resumed["history"]}
    assert sorted(again) == [4, 5, 6, 7, 8]
    assert all(again[s] == losses[s] for s in again), (losses, again)
    assert whole["throughput"]["data_time_s_per_step"] > 0 and whole["throughput"]["data_prefetched"] is True


def test_files_not_given_are_named_with_what_to_set():
    """data=conll without its files: the keys to set, before anything runs."""
    from sharded_exp.__main__ import check_resolvable

    cfg = compose(["model=hf_bert", "data=conll"])
    with pytest.raises(ConfigError) as err:
        check_resolvable(cfg)
    assert str(err.value) == (
        "data.path, data.tokenizer must be set: no value was given "
        "(data=conll reads local files: data.path=... data.tokenizer=...)"
    )


@pytest.mark.slow  # a sweep of its own (the default tier's budget); the single run is its first half
def test_a_path_that_is_a_directory_is_named_and_its_sweep_point_recorded(files, tmp_path):
    """``data.path`` a directory where a file is needed: refused naming the key and the path
    (exit 2, as every refused value), and in a sweep the point ends with a result.json the
    report counts (it vanished, and the sweep exited 0)."""
    from tests.helpers.jobs import ROOT, run_cli

    (tmp_path / "some_dir").mkdir()
    tiny = ["model=hf_bert", "model.seq_len=24", "data=conll", f"data.tokenizer={files / 'tok'}", "logger=none",
            "trainer.world_size=1", "trainer.batch_size=4", "trainer.steps=2", "trainer.warmup_steps=1",
            "trainer.eval_batches=0"]  # fmt: skip
    one = run_cli([*tiny, f"data.path={tmp_path / 'some_dir'}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT)
    assert one.returncode == 2, one.stderr
    assert f"error: data.path={tmp_path / 'some_dir'} is a directory, not a file" in one.stderr, one.stderr
    assert not (tmp_path / "run").exists()
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *tiny, f"data.path={files / 'train.conll'},{tmp_path / 'some_dir'}",
                    f"hydra.sweep.dir={sweep}"], cwd=ROOT)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]  # a point failed: the sweep says so
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert len(rows) == 2, rows
    failed = [json.loads(p.read_text()) for p in sweep.glob("*/result.json")]
    failed = [r for r in failed if r["status"] == "failed"]
    assert len(failed) == 1 and f"data.path={tmp_path / 'some_dir'} is a directory" in failed[0]["error"]
