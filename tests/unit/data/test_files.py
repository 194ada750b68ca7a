"""sharded_exp.data.files, without a real tokenizer: local paths refused by name, reading text,
JSON lines and CoNLL files, causal blocks, word-aligned labels, padding, the encodability and
vocabulary checks, fingerprints, and the text_file / conll tasks over a stand-in tokenizer."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.data import files
from sharded_exp.data.files import (
    IGNORE,
    ConllConfig,
    PadTo,
    Samples,
    TextFileConfig,
    causal_blocks,
    check_encodes,
    dataset_task,
    fingerprint,
    local_path,
    read_conll,
    read_documents,
    word_labels,
)
from sharded_exp.errors import ConfigError


class Encoded(dict):
    def __init__(self, ids, words):
        super().__init__(input_ids=ids)
        self._words = words

    def word_ids(self, i):
        return self._words[i]


class FakeTokenizer:
    """Words to ids by a fixed vocabulary; a word of more than 3 letters is two sub-tokens;
    [CLS] ... [SEP] around split words; unknown words are [UNK]."""

    pad_token_id, unk, cls, sep_token_id, eos_token_id = 0, 1, 2, 3, None
    all_special_ids = [0, 1, 2, 3]
    is_fast = True

    def __init__(self, words=("the", "cat", "sat", "on", "mat", "Peter", "Berlin")):
        self.vocab = {w: 4 + 2 * i for i, w in enumerate(words)}

    def __len__(self):
        return 4 + 2 * len(self.vocab)

    def _word(self, w):
        i = self.vocab.get(w, self.unk)
        return [i, i + 1] if len(w) > 3 and i != self.unk else [i]

    def __call__(self, texts, add_special_tokens=True, is_split_into_words=False, truncation=False, max_length=None):
        ids, words = [], []
        for text in texts:
            split = text if is_split_into_words else text.split()
            row, owner = ([self.cls], [None]) if is_split_into_words else ([], [])
            for n, w in enumerate(split):
                sub = self._word(w)
                row += sub
                owner += [n] * len(sub)
            if is_split_into_words:
                row, owner = row + [self.sep_token_id], owner + [None]
            if truncation and max_length and len(row) > max_length:
                row, owner = row[: max_length - 1] + [self.sep_token_id], owner[: max_length - 1] + [None]
            ids.append(row)
            words.append(owner)
        return Encoded(ids, words)


# ------------------------------------------------------------------------ paths
def data_cfg(**kw):
    c = OmegaConf.structured(TextFileConfig)
    for k, v in kw.items():
        c[k] = v
    return c


def test_a_missing_path_is_refused_naming_the_setting():
    with pytest.raises(ConfigError, match=r"data=text_file needs data.path=... \(the file\)"):
        local_path(data_cfg(), "path", "the file")


def test_a_path_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"data.path={tmp_path}/no.txt does not exist: the file must be a local file"):
        local_path(data_cfg(path=str(tmp_path / "no.txt")), "path", "the file")


def test_a_directory_for_a_file_and_a_file_for_a_directory_are_refused(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x\n")
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        local_path(data_cfg(path=str(tmp_path)), "path", "the file", file=True)
    with pytest.raises(ConfigError, match="is not a local directory: the tokenizer must be one"):
        local_path(data_cfg(tokenizer=str(f)), "tokenizer", "the tokenizer", directory=True)
    assert local_path(data_cfg(path=str(f)), "path", "the file", file=True) == str(f)
    assert local_path(data_cfg(tokenizer=str(tmp_path)), "tokenizer", "t", directory=True) == str(tmp_path)


def test_a_relative_or_home_path_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    assert local_path(data_cfg(path="a.txt"), "path", "f") == str(tmp_path / "a.txt")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert local_path(data_cfg(path="~/a.txt"), "path", "f") == str(tmp_path / "a.txt")


# ---------------------------------------------------------------------- reading
def test_a_text_file_is_a_document_per_non_blank_line_without_its_bom(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes("\ufefffirst doc\n\n  \nsecond doc  \n".encode())
    assert read_documents(str(f), "text") == ["first doc", "second doc  "]


def test_a_json_lines_file_gives_its_text_field(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two", "id": 2}) + "\n")
    assert read_documents(str(f), "body") == ["one", "two"]


@pytest.mark.parametrize(
    "line, message",
    [("{not json", "line 2 is not JSON"), ('{"text": 3}', "line 2 has no text field 'text' (data.text_field)"),
     ("[1, 2]", "line 2 has no text field 'text'")],
)  # fmt: skip
def test_a_bad_json_line_is_refused_naming_its_number(tmp_path, line, message):
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(ConfigError) as err:
        read_documents(str(f), "text")
    assert message in str(err.value)


def test_a_file_not_in_utf8_is_refused_naming_its_first_bad_line(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes("fine\nalso fine\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 \(line 3\)"):
        read_documents(str(f), "text")


CONLL = """-DOCSTART- -X- -X- O

Peter NNP B-NP B-PER
sat VBD I-VP O

Berlin NNP B-NP B-LOC
-DOCSTART- -X- -X- O
the DT B-NP O
"""


def test_conll_sentences_split_at_blank_and_docstart_lines_tags_from_the_last_column(tmp_path):
    f = tmp_path / "a.conll"
    f.write_text(CONLL)
    labels = ["O", "B-PER", "B-LOC"]
    assert read_conll(str(f), labels) == [(["Peter", "sat"], [1, 0]), (["Berlin"], [2]), (["the"], [0])]


def test_a_conll_tag_outside_the_labels_and_a_one_column_line_are_refused(tmp_path):
    f = tmp_path / "a.conll"
    f.write_text("Peter B-PER\nsat X-TAG\n")
    with pytest.raises(ConfigError, match=r"line 2 has the tag 'X-TAG', not one of data.labels \(O, B-PER\)"):
        read_conll(str(f), ["O", "B-PER"])
    f.write_text("Peter B-PER\nlonely\n")
    with pytest.raises(ConfigError, match="line 2 has one column"):
        read_conll(str(f), ["O", "B-PER"])


# ---------------------------------------------------------------------- samples
def test_causal_blocks_join_documents_with_the_end_token_and_drop_the_remainder():
    tok = FakeTokenizer()
    tok.eos_token_id = 99
    blocks, own = causal_blocks(["the cat", "sat on the mat"], tok, 3)
    stream = [4, 6, 99, 8, 10, 4, 12, 99]  # 8 tokens: two blocks of 3, two dropped
    assert blocks.tolist() == [stream[0:3], stream[3:6]]
    assert own.tolist() == [4, 6, 8, 10, 4, 12]  # no end-of-text


def test_causal_blocks_use_sep_when_there_is_no_eos():
    blocks, _ = causal_blocks(["the", "cat"], FakeTokenizer(), 4)
    assert blocks.tolist() == [[4, 3, 6, 3]]


def test_a_words_label_goes_on_its_first_sub_token_only():
    samples = word_labels([(["Peter", "sat"], [1, 0]), (["Berlin"], [2])], FakeTokenizer(), 16)
    # [CLS] Pe ter sat [SEP]
    assert samples[0]["input_ids"].tolist() == [2, 14, 15, 8, 3]
    assert samples[0]["labels"].tolist() == [IGNORE, 1, IGNORE, 0, IGNORE]
    assert samples[1]["labels"].tolist() == [IGNORE, 2, IGNORE, IGNORE]
    assert word_labels([], FakeTokenizer(), 4) == []


def test_a_long_sentence_is_cut_at_seq_len():
    (sample,) = word_labels([(["the"] * 10, [1] * 10)], FakeTokenizer(), 5)
    assert len(sample["input_ids"]) == 5 and sample["labels"].tolist() == [IGNORE, 1, 1, 1, IGNORE]


def test_pad_to_pads_ids_mask_and_labels_to_the_length():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([1, IGNORE, 2])},
             {"input_ids": torch.tensor([8]), "labels": torch.tensor([0])}]  # fmt: skip
    b = PadTo(pad_id=9, length=4)(items)
    assert b["input_ids"].tolist() == [[5, 6, 7, 9], [8, 9, 9, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert b["labels"].tolist() == [[1, IGNORE, 2, IGNORE], [0, IGNORE, IGNORE, IGNORE]]


def test_a_dataset_task_serves_seeded_random_samples_for_evaluation():
    data = Samples([{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in range(50)])
    cfg = data_cfg(seed=3, shuffle=False, num_workers=0)
    task = dataset_task(cfg, "data.path=x", data, PadTo(0, 2), 4, metric="perplexity")
    a, b = task(0, 0, 0), task(0, 0, 1)
    assert a["input_ids"].shape == (4, 2) and not torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["input_ids"], task(0, 0, 0)["input_ids"])
    assert (task.seed, task.shuffle, task.dataset, len(task.dataset)) == (3, False, data, 50)
    with pytest.raises(ConfigError, match=r"data.path=x holds no samples \(data=text_file\)"):
        dataset_task(cfg, "data.path=x", Samples([]), PadTo(0, 2), 4, metric="perplexity")


# ----------------------------------------------------------------------- checks
def test_a_tokenizer_that_cannot_encode_the_data_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = data_cfg(path="d.txt", tokenizer=str(tmp_path))
    tok = FakeTokenizer()
    check_encodes(cfg, tok, str(tmp_path), torch.tensor([1] * 9 + [4]))  # 90% unknown: still allowed
    with pytest.raises(ConfigError, match="cannot encode data.path=d.txt: 91% of its 11 word tokens are special"):
        check_encodes(cfg, tok, str(tmp_path), torch.tensor([1] * 10 + [4]))
    with pytest.raises(ConfigError, match="its words give no tokens at all.*use the tokenizer the data"):
        check_encodes(cfg, tok, str(tmp_path), torch.tensor([], dtype=torch.long))


def test_a_directory_without_tokenizer_files_is_named_as_such(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no tokenizer files .* it has config.json"):
        check_encodes(data_cfg(path="d", tokenizer=str(tmp_path)), FakeTokenizer(), str(tmp_path), torch.tensor([1]))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_saying_what_to_set():
    tok = FakeTokenizer()  # 18 tokens
    files._tokenizer_fits(data_cfg(tokenizer="t"), OmegaConf.create({"vocab_size": 18}), tok)
    with pytest.raises(ConfigError, match="has 18 tokens, more than model.vocab_size=17: set model.vocab_size=18"):
        files._tokenizer_fits(data_cfg(tokenizer="t"), OmegaConf.create({"vocab_size": 17}), tok)
    with pytest.raises(ConfigError, match="model.pretrained=w fixes it .*model.resize_token_embeddings\\(18\\)"):
        files._tokenizer_fits(data_cfg(tokenizer="t"), OmegaConf.create({"vocab_size": 17, "pretrained": "w"}), tok)


def test_small_files_are_fingerprinted_by_content_and_large_ones_by_size_and_time(tmp_path, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello\n")
    assert fingerprint(str(f)) == {"path": str(f), "content": "sha256:" + hashlib.sha256(b"hello\n").hexdigest()}
    monkeypatch.setattr(files, "HASHED_UP_TO", 5)
    assert fingerprint(str(f))["content"] == f"size:6,mtime_ns:{os.stat(f).st_mtime_ns}"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"abc")
    latest = max(os.stat(f).st_mtime_ns, os.stat(tmp_path / "sub" / "b").st_mtime_ns)
    assert fingerprint(str(tmp_path))["content"] == f"size:9,mtime_ns:{latest}"


# ------------------------------------------------------------------------ tasks
@pytest.fixture
def fake_tokenizer(tmp_path, monkeypatch):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(files, "load_tokenizer", lambda path: FakeTokenizer())
    return str(directory)


def test_the_text_file_task_is_blocks_of_seq_len_labelled_by_themselves(tmp_path, fake_tokenizer):
    f = tmp_path / "corpus.txt"
    f.write_text("the cat sat\non the mat\nthe cat\n")
    cfg = data_cfg(path=str(f), tokenizer=fake_tokenizer)
    model = OmegaConf.create({"name": "hf_gpt2", "vocab_size": 32, "seq_len": 4})
    task = files.text_file_task(cfg, model, 2)
    # the cat sat [SEP] on the mat [SEP] the cat [SEP]: 11 tokens, two blocks of 4
    assert [s["input_ids"].tolist() for s in task.dataset] == [[4, 6, 8, 3], [10, 4, 12, 3]]
    assert (task.metric, task.labels, task.shift_labels) == ("perplexity", "labels", True)
    assert task.fingerprint["path"] == str(f)
    b = task(0, 0, 0)
    assert torch.equal(b["labels"], b["input_ids"]) and b["attention_mask"].tolist() == [[1] * 4] * 2
    assert task.padded is False  # whole blocks: no batch pads (the fake step is told so)


def test_the_conll_task_refuses_more_labels_than_the_model_has(tmp_path, fake_tokenizer):
    f = tmp_path / "a.conll"
    f.write_text(CONLL)
    model = OmegaConf.create({"name": "hf_bert", "vocab_size": 32, "seq_len": 8, "num_labels": 3})
    cfg = OmegaConf.structured(ConllConfig)
    cfg.path, cfg.tokenizer = str(f), fake_tokenizer
    with pytest.raises(ConfigError, match="data=conll has 9 labels .* and model.num_labels=3: set model.num_labels=9"):
        files.conll_task(cfg, model, 1)
    cfg.labels = ["O", "B-PER", "B-LOC"]
    task = files.conll_task(cfg, model, 2)
    assert len(task.dataset) == 3 and task.metric == "token_accuracy" and task.num_classes == 3
    assert task.padded is True  # sentences of their own lengths, padded to model.seq_len
    assert task.dataset[0]["labels"].tolist() == [IGNORE, 1, IGNORE, 0, IGNORE]


def test_an_empty_text_file_is_refused(tmp_path, fake_tokenizer):
    f = tmp_path / "empty.txt"
    f.write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no samples .*no documents"):
        files.text_file_task(data_cfg(path=str(f), tokenizer=fake_tokenizer),
                             OmegaConf.create({"name": "hf_gpt2", "vocab_size": 32, "seq_len": 4}), 1)  # fmt: skip
