"""Your data, from local files: plain text or JSON lines (causal LM), a CoNLL-2003 file
(token classification), or a dataset of the ``datasets`` library.

    python -m sharded_exp model=hf_gpt2 data=text_file data.path=corpus.txt data.tokenizer=my_tokenizer/
    python -m sharded_exp model=hf_bert data=conll data.path=train.conll data.tokenizer=my_tokenizer/
    python -m sharded_exp model=hf_bert data=hf_dataset data.path=saved/ data.kind=token_classification ...

Local files only: ``data.path`` must exist and ``data.tokenizer`` must be a local directory
written by ``save_pretrained`` (a Hugging Face tokenizer); anything else is refused before
any rank starts, and nothing is downloaded. Every sample is tokenized when the task is
built (on each rank, and once in the parent to check it); the training batches then come
from a DataLoader (:mod:`sharded_exp.data.loader`).

- Causal LM (text_file, hf_dataset kind=causal_lm): the documents (lines of a text file,
  the ``data.text_field`` of each JSON line or row) are tokenized, joined with the
  tokenizer's end-of-text token (EOS, else SEP) and cut into blocks of ``model.seq_len``
  tokens (the remainder dropped), as Hugging Face's language-modelling examples do.
  Batches: input_ids, attention_mask, labels = input_ids (the model shifts them).
- Token classification (conll, hf_dataset kind=token_classification): one sample per
  sentence, words tokenized into sub-tokens; a word's label goes on its first sub-token,
  the other sub-tokens and special tokens get -100 (ignored by the loss and the metrics);
  sentences longer than ``model.seq_len`` sub-tokens are cut.

Batches are padded to ``model.seq_len`` (the padding's label -100, attention_mask 0), so
every step has the shape the memory prediction assumed. Evaluation batches are samples of
the same data drawn at random (there is no held-out split).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from omegaconf import MISSING, OmegaConf

from sharded_exp.config import Option, Sealed, bounded, require_model_fields
from sharded_exp.data import TASKS, Batch, Task, generator
from sharded_exp.errors import ConfigError

IGNORE = -100
CONLL2003_LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
"""CoNLL-2003's NER tags in the order of the Hugging Face ``conll2003`` dataset's ids."""


# ------------------------------------------------------------------------------ configs
@dataclass
class FileDataConfig(Sealed):
    name: str = MISSING
    path: str = MISSING
    """The data: a local file (or, for hf_dataset, a directory written by save_to_disk)."""
    tokenizer: str = MISSING
    """A local directory holding a Hugging Face tokenizer (``tokenizer.save_pretrained(DIR)``)."""
    seed: int = 0
    """Seed of the shuffle (the DistributedSampler's, with the epoch)."""
    shuffle: bool = True
    """Shuffle the samples every epoch (false: file order)."""
    num_workers: int = bounded(0, at_least=0)
    """DataLoader worker processes per rank (0: batches are made in the rank's process)."""


CAUSAL_FEEDS = "causal language models (model=hf_gpt2, hf_llama)"
CAUSAL_FIELDS = ("vocab_size", "seq_len")
TOKEN_FEEDS = "token classifiers (model=hf_bert)"
TOKEN_FIELDS = ("vocab_size", "seq_len", "num_labels")


@dataclass
class TextFileConfig(FileDataConfig):
    FEEDS = CAUSAL_FEEDS
    MODEL_FIELDS = CAUSAL_FIELDS
    name: str = "text_file"
    text_field: str = "text"
    """The field holding the text in a JSON lines file (.jsonl/.json); a plain text file
    has a document per line."""


@dataclass
class ConllConfig(FileDataConfig):
    FEEDS = TOKEN_FEEDS
    MODEL_FIELDS = TOKEN_FIELDS
    name: str = "conll"
    labels: List[str] = field(default_factory=lambda: list(CONLL2003_LABELS))
    """The tags, in the order of their ids (the last column of each line); a tag outside
    them is refused. model.num_labels must be at least their number."""


class DatasetKind(Option):
    causal_lm = "causal_lm"
    token_classification = "token_classification"


@dataclass
class HFDatasetConfig(FileDataConfig):
    FEEDS = {"causal_lm": CAUSAL_FEEDS, "token_classification": TOKEN_FEEDS}
    MODEL_FIELDS = {"causal_lm": CAUSAL_FIELDS, "token_classification": TOKEN_FIELDS}
    """What it feeds depends on its ``kind``: per kind (:func:`sharded_exp.config.check_fed`)."""
    name: str = "hf_dataset"
    format: Optional[str] = None
    """null: data.path is a directory written by ``save_to_disk`` (``load_from_disk``);
    json, csv, parquet, text...: local files for ``load_dataset(format, data_files=path)``."""
    split: str = "train"
    """The split to train on (of a DatasetDict; load_dataset names local files' split train)."""
    kind: DatasetKind = DatasetKind.causal_lm
    """causal_lm (a text column) or token_classification (a column of words and one of tags)."""
    text_field: str = "text"
    """causal_lm: the column holding the text."""
    tokens_field: str = "tokens"
    """token_classification: the column holding each sentence's words."""
    labels_field: str = "ner_tags"
    """token_classification: the column holding each word's tag (ids, or names from data.labels)."""
    labels: List[str] = field(default_factory=lambda: list(CONLL2003_LABELS))
    """token_classification: the tags in the order of their ids."""


# ------------------------------------------------------------------------------ checks
def local_path(cfg: FileDataConfig, key: str, what: str, directory: bool = False, file: bool = False) -> str:
    """``cfg[key]`` as an existing local path (a directory, a file, or either), or a
    ConfigError naming the value."""
    if OmegaConf.is_missing(cfg, key) or cfg[key] is None:
        raise ConfigError(f"data={cfg.name} needs data.{key}=... ({what})")
    path = os.path.expanduser(str(cfg[key]))
    if directory and not os.path.isdir(path):
        raise ConfigError(
            f"data.{key}={cfg[key]} is not a local directory: {what} must be one (written by save_pretrained); "
            "names on the Hugging Face hub are not downloaded"
        )
    if not os.path.exists(path):
        raise ConfigError(f"data.{key}={cfg[key]} does not exist: {what} must be a local file")
    if file and os.path.isdir(path):  # open() would say only "Is a directory", naming no key
        raise ConfigError(f"data.{key}={cfg[key]} is a directory, not a file: give {what} itself")
    return os.path.abspath(path)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    AutoTokenizer = _needs("transformers", "data.tokenizer").AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 -- transformers' own complaint, named
        raise ConfigError(
            f"data.tokenizer={path} holds no tokenizer transformers can load ({type(exc).__name__}: {exc}); "
            "save one with tokenizer.save_pretrained(DIR)"
        ) from None
    if not tokenizer.is_fast:
        raise ConfigError(f"data.tokenizer={path} is a slow tokenizer: word-aligned labels need a fast one")
    return tokenizer


def _bigger(model_cfg, key: str, needed: int) -> str:
    """What makes the model's ``key`` (vocab_size, num_labels) at least ``needed``: the setting,
    or, for saved weights (whose config.json fixes it), a model resized and saved again."""
    pretrained = model_cfg.get("pretrained")
    if not pretrained:
        return f"set model.{key}={needed} (or more)"
    how = f"model.resize_token_embeddings({needed})" if key == "vocab_size" else f"a new {needed}-label head"
    return (
        f"model.pretrained={pretrained} fixes it (its config.json, which model.{key} cannot override: the "
        f"weights have that size); use the tokenizer and labels the model was saved with, or load it, give it "
        f"{how} and save_pretrained it again"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What ``tokenizer.save_pretrained`` always writes (a slow tokenizer's vocabulary files aside)."""


UNENCODED_SHARE = 0.9
"""A tokenizer that turns more than this share of the data's tokens into special or unknown
ones cannot encode the data (a tokenizer of other text; an empty one)."""


def check_encodes(cfg: FileDataConfig, tokenizer, directory: str, ids: torch.Tensor) -> None:
    """Refuse a tokenizer that cannot encode the data: ``ids``, the tokens of the data's
    words (labelled tokens for token classification), are none, or nearly all special or
    unknown. transformers loads a directory without tokenizer files (a model's
    save_pretrained) as a tokenizer of one token that encodes every word to nothing: training
    would then run on end-of-text tokens alone, or on labels that are all -100 (loss NaN).
    ``directory``: the tokenizer's (its files are named when it lacks a tokenizer's)."""
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    unencoded = int(torch.isin(ids, special).sum()) if ids.numel() else 0
    if ids.numel() and unencoded <= UNENCODED_SHARE * ids.numel():
        return
    found = (
        "its words give no tokens at all"
        if not ids.numel()
        else f"{unencoded / ids.numel():.0%} of its {ids.numel()} word tokens are special or unknown"
    )
    has = sorted(os.listdir(directory))
    lacks = (
        f"; the directory holds no tokenizer files (no {' or '.join(TOKENIZER_FILES)}; it has {', '.join(has)}), "
        "so transformers made an empty tokenizer: save the data's tokenizer there with tokenizer.save_pretrained(DIR)"
        if not set(TOKENIZER_FILES) & set(has)
        else ": use the tokenizer the data and the model were made with"
    )
    raise ConfigError(
        f"data.tokenizer={cfg.tokenizer} cannot encode data.path={cfg.path}: {found} "
        f"({type(tokenizer).__name__}, vocabulary of {len(tokenizer)}){lacks}"
    )


def _tokenizer_fits(cfg: FileDataConfig, model_cfg, tokenizer) -> None:
    if len(tokenizer) > model_cfg.vocab_size:
        raise ConfigError(
            f"data.tokenizer={cfg.tokenizer} has {len(tokenizer)} tokens, more than model.vocab_size="
            f"{model_cfg.vocab_size}: {_bigger(model_cfg, 'vocab_size', len(tokenizer))}"
        )


# ------------------------------------------------------------------------------ reading
def text_lines(path: str):
    """(line number, line) of a UTF-8 text file; a byte order mark at its start is dropped
    (``utf-8-sig``: an editor's BOM would otherwise glue itself to the first word). A file
    in another encoding is refused naming its first line that is not UTF-8."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield from enumerate(f, 1)
    except UnicodeDecodeError:
        with open(path, "rb") as f:  # line by line: a UTF-8 character never spans a newline
            n = next((n for n, raw in enumerate(f, 1) if not _is_utf8(raw)), "?")
        raise ConfigError(
            f"data.path={path} is not UTF-8 (line {n}): save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_documents(path: str, text_field: str) -> list[str]:
    """Documents of a plain text file (a line each) or of a JSON lines file (.jsonl/.json)."""
    json_lines = path.endswith((".jsonl", ".json"))
    docs = []
    for n, line in text_lines(path):
        if not line.strip():
            continue
        if not json_lines:
            docs.append(line.rstrip("\n"))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"data.path={path} line {n} is not JSON ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(f"data.path={path} line {n} has no text field {text_field!r} (data.text_field)")
        docs.append(record[text_field])
    return docs


def read_conll(path: str, labels: list[str]) -> list[tuple[list[str], list[int]]]:
    """(words, tag ids) per sentence of a CoNLL-2003-format file: a word per line, its tag in
    the last column, a blank line between sentences, ``-DOCSTART-`` lines skipped."""
    ids = {tag: i for i, tag in enumerate(labels)}
    sentences, words, tags = [], [], []
    for n, line in text_lines(path):
        parts = line.split()
        if not parts or parts[0] == "-DOCSTART-":
            if words:
                sentences.append((words, tags))
            words, tags = [], []
            continue
        if len(parts) < 2:
            raise ConfigError(f"data.path={path} line {n} has one column; CoNLL lines are `word ... tag`")
        if parts[-1] not in ids:
            raise ConfigError(
                f"data.path={path} line {n} has the tag {parts[-1]!r}, not one of data.labels ({', '.join(labels)})"
            )
        words.append(parts[0])
        tags.append(ids[parts[-1]])
    if words:
        sentences.append((words, tags))
    return sentences


def _needs(package: str, what: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(
            f"{what} needs the package {package}, which is not installed here (pip install -e '.[data]')"
        ) from None


def _load_hf(cfg: HFDatasetConfig, path: str) -> "object":
    datasets = _needs("datasets", "data=hf_dataset")

    try:
        if cfg.format is None:
            data = datasets.load_from_disk(path)
        else:
            data = datasets.load_dataset(str(cfg.format), data_files=path)
    except Exception as exc:  # noqa: BLE001 -- the datasets library's own complaint, named
        how = "load_from_disk" if cfg.format is None else f"load_dataset({cfg.format!r}, data_files=...)"
        raise ConfigError(f"data.path={cfg.path}: {how} failed ({type(exc).__name__}: {exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if cfg.split not in data:
            raise ConfigError(
                f"data.split={cfg.split} is not a split of data.path={cfg.path} (it has {', '.join(data)})"
            )
        data = data[cfg.split]
    return data


def _column(data, name: str, key: str, path: str) -> list:
    if name not in data.column_names:
        raise ConfigError(
            f"data.{key}={name} is not a column of data.path={path} (it has {', '.join(data.column_names)})"
        )
    return data[name]


def _held(value) -> str:
    return f"{len(value)} values" if isinstance(value, list) else repr(value)[:40]


# ------------------------------------------------------------------------------ samples
def causal_blocks(docs: list[str], tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents' tokens, joined by the end-of-text token, in (blocks, seq_len); and
    the documents' own tokens (no end-of-text), for :func:`check_encodes`."""
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    own: list[int] = []
    for encoded in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids += encoded + ([end] if end is not None else [])
        own += encoded
    blocks = len(ids) // seq_len
    blocked = torch.tensor(ids[: blocks * seq_len], dtype=torch.long).reshape(blocks, seq_len)
    return blocked, torch.tensor(own, dtype=torch.long)


def word_labels(sentences: list[tuple[list[str], list[int]]], tokenizer, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """A sample per sentence: its sub-tokens, and each word's tag on the word's first sub-token."""
    if not sentences:
        return []
    encoded = tokenizer([w for w, _ in sentences], is_split_into_words=True, truncation=True, max_length=seq_len)
    samples = []
    for i, (_, tags) in enumerate(sentences):
        labels, previous = [], None
        for word in encoded.word_ids(i):
            labels.append(IGNORE if word is None or word == previous else tags[word])
            previous = word
        ids = torch.tensor(encoded["input_ids"][i], dtype=torch.long)
        samples.append({"input_ids": ids, "labels": torch.tensor(labels, dtype=torch.long)})
    return samples


class Samples(torch.utils.data.Dataset):
    """Tokenized samples of their own lengths (dicts of 1-D tensors)."""

    def __init__(self, samples: list[dict[str, torch.Tensor]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


class PadTo:
    """Collation: pads input_ids with the pad id, attention_mask with 0 and labels with -100
    to ``length`` tokens. A class, not a closure: DataLoader workers may need to pickle it."""

    def __init__(self, pad_id: int, length: int):
        self.pad_id, self.length = pad_id, length

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> Batch:
        n = len(items)
        input_ids = torch.full((n, self.length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, self.length), dtype=torch.long)
        labels = torch.full((n, self.length), IGNORE, dtype=torch.long)
        for row, item in enumerate(items):
            k = len(item["input_ids"])
            input_ids[row, :k], mask[row, :k], labels[row, :k] = item["input_ids"], 1, item["labels"]
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def dataset_task(cfg, source: str, dataset, collate, batch_size: int, **task) -> Task:
    """A Task over ``dataset`` (read from ``source``, for messages): the DataLoader's batches
    for training, random samples of it (keyed by step, micro-batch and rank) for evaluation
    and the shape probes. ``cfg``: the data config (seed, shuffle, num_workers)."""
    seed = int(cfg.seed)
    if len(dataset) == 0:
        raise ConfigError(f"{source} holds no samples (data={cfg.name})")

    def batch(step: int, micro: int, rank: int) -> Batch:
        picks = torch.randint(len(dataset), (batch_size,), generator=generator(seed, step, micro, rank))
        return collate([dataset[int(i)] for i in picks])

    return Task(
        batch,
        dataset=dataset,
        collate=collate,
        seed=seed,
        shuffle=bool(cfg.shuffle),
        num_workers=int(cfg.num_workers),
        **task,
    )


HASHED_UP_TO = 64 * 2**20
"""Data files up to this size are fingerprinted by their sha256 (a fraction of a second);
larger ones, and directories, by size and modification time."""


def fingerprint(path: str) -> dict[str, str]:
    """``path`` and a cheap fingerprint of its content, which a checkpoint's data position
    records: a run resumed on another file, or on the same file edited, is told so (its
    position in the data would otherwise silently mean other samples)."""
    if os.path.isfile(path) and os.path.getsize(path) <= HASHED_UP_TO:
        with open(path, "rb") as f:
            return {"path": path, "content": f"sha256:{hashlib.sha256(f.read()).hexdigest()}"}
    files = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
    stats = [os.stat(f) for f in files]
    size, mtime = sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)
    return {"path": path, "content": f"size:{size},mtime_ns:{mtime}"}


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def causal_task(cfg: FileDataConfig, model_cfg, batch_size: int, path: str, docs_of) -> Task:
    require_model_fields(cfg.name, CAUSAL_FEEDS, model_cfg, CAUSAL_FIELDS)
    directory = local_path(cfg, "tokenizer", "the tokenizer", directory=True)
    tokenizer = load_tokenizer(directory)
    _tokenizer_fits(cfg, model_cfg, tokenizer)
    docs = docs_of()
    if not docs:  # (the tokenizer itself fails on no documents, with an IndexError)
        raise ConfigError(f"data.path={cfg.path} holds no samples (data={cfg.name}: no documents)")
    blocks, own = causal_blocks(docs, tokenizer, model_cfg.seq_len)
    check_encodes(cfg, tokenizer, directory, own)
    samples = Samples([{"input_ids": b, "labels": b} for b in blocks])
    return dataset_task(
        cfg,
        f"data.path={cfg.path}",
        samples,
        PadTo(_pad_id(tokenizer), model_cfg.seq_len),
        batch_size,
        metric="perplexity",
        labels="labels",
        shift_labels=True,
        padded=False,  # every block is model.seq_len tokens long: PadTo pads none of them
        fingerprint=fingerprint(path),
    )


def token_task(cfg: FileDataConfig, model_cfg, batch_size: int, path: str, sentences_of) -> Task:
    require_model_fields(cfg.name, TOKEN_FEEDS, model_cfg, TOKEN_FIELDS)
    if len(cfg.labels) > model_cfg.num_labels:
        raise ConfigError(
            f"data={cfg.name} has {len(cfg.labels)} labels (data.labels) and model.num_labels={model_cfg.num_labels}: "
            f"{_bigger(model_cfg, 'num_labels', len(cfg.labels))}"
        )
    directory = local_path(cfg, "tokenizer", "the tokenizer", directory=True)
    tokenizer = load_tokenizer(directory)
    _tokenizer_fits(cfg, model_cfg, tokenizer)
    sentences = sentences_of()
    if not sentences:
        raise ConfigError(f"data.path={cfg.path} holds no samples (data={cfg.name}: no sentences)")
    samples = Samples(word_labels(sentences, tokenizer, model_cfg.seq_len))
    # the words' first sub-tokens, those that carry a label
    check_encodes(cfg, tokenizer, directory, torch.cat([s["input_ids"][s["labels"] != IGNORE] for s in samples]))
    return dataset_task(
        cfg,
        f"data.path={cfg.path}",
        samples,
        PadTo(_pad_id(tokenizer), model_cfg.seq_len),
        batch_size,
        metric="token_accuracy",
        labels="labels",
        num_classes=model_cfg.num_labels,
        fingerprint=fingerprint(path),
    )


# ------------------------------------------------------------------------------ the tasks
@TASKS.register("text_file", config=TextFileConfig)
def text_file_task(cfg: TextFileConfig, model_cfg, batch_size: int) -> Task:
    """A plain text or JSON lines file, for causal language modelling."""
    path = local_path(cfg, "path", "the text or JSON lines file", file=True)
    return causal_task(cfg, model_cfg, batch_size, path, lambda: read_documents(path, cfg.text_field))


@TASKS.register("conll", config=ConllConfig)
def conll_task(cfg: ConllConfig, model_cfg, batch_size: int) -> Task:
    """A CoNLL-2003-format file, for token classification (NER)."""
    path = local_path(cfg, "path", "the CoNLL file", file=True)
    return token_task(cfg, model_cfg, batch_size, path, lambda: read_conll(path, list(cfg.labels)))


@TASKS.register("hf_dataset", config=HFDatasetConfig)
def hf_dataset_task(cfg: HFDatasetConfig, model_cfg, batch_size: int) -> Task:
    """A ``datasets`` dataset from local files (save_to_disk's directory, or data files)."""
    path = local_path(cfg, "path", "a dataset directory written by save_to_disk, or local data files")
    data = _load_hf(cfg, path)
    if cfg.kind == "causal_lm":

        def texts():
            column = list(_column(data, cfg.text_field, "text_field", cfg.path))
            for row, text in enumerate(column):  # a null or a number: the tokenizer's TypeError otherwise
                if not isinstance(text, str):
                    raise ConfigError(
                        f"data.path={cfg.path} row {row} has no text (data.text_field={cfg.text_field} holds "
                        f"{text!r}, not a string)"
                    )
            return column

        return causal_task(cfg, model_cfg, batch_size, path, texts)
    labels = list(cfg.labels)

    def sentences():
        words = _column(data, cfg.tokens_field, "tokens_field", cfg.path)
        tags = _column(data, cfg.labels_field, "labels_field", cfg.path)
        out = []
        for row, (w, t) in enumerate(zip(words, tags)):
            if not isinstance(w, list) or not isinstance(t, list) or len(w) != len(t):
                raise ConfigError(
                    f"data.path={cfg.path} row {row} has no tag per word: data.tokens_field={cfg.tokens_field} "
                    f"holds {_held(w)}, data.labels_field={cfg.labels_field} {_held(t)}"
                )
            ids = [labels.index(x) if isinstance(x, str) and x in labels else x for x in t]
            bad = [x for x in ids if not isinstance(x, int) or not 0 <= x < len(labels)]
            if bad:
                raise ConfigError(
                    f"data.path={cfg.path} column {cfg.labels_field} holds the tag {bad[0]!r}: tags are ids below "
                    f"{len(labels)} or names in data.labels ({', '.join(labels)})"
                )
            out.append((list(w), ids))
        return out

    return token_task(cfg, model_cfg, batch_size, path, sentences)
