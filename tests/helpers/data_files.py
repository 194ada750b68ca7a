"""Small data files the data tests make for themselves (no downloads): a CoNLL-2003-format
file, plain text and JSON lines, a tokenizer trained with ``tokenizers``, and a dataset
saved with ``datasets``. The text is learnable: each word has a fixed tag, and sentences
follow a few fixed patterns."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

ENTITIES = {
    "B-PER": ["Peter", "Maria", "Ahmed", "Chen", "Olga"],
    "B-ORG": ["Reuters", "Siemens", "UNICEF", "Fiat"],
    "B-LOC": ["Berlin", "Lagos", "Lima", "Osaka"],
    "B-MISC": ["German", "British", "Olympic"],
}
WORDS = ["the", "said", "on", "in", "a", "visit", "report", "met", "with", "today", "of", "team", "."]


def sentences(n: int, seed: int = 0) -> list[list[tuple[str, str]]]:
    """``n`` sentences of (word, tag): entity names among plain words, names of people
    followed by a surname (I-PER)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sentence = []
        for _ in range(rng.randint(4, 12)):
            if rng.random() < 0.3:
                tag = rng.choice(list(ENTITIES))
                sentence.append((rng.choice(ENTITIES[tag]), tag))
                if tag == "B-PER" and rng.random() < 0.5:
                    sentence.append((rng.choice(["Smith", "Okafor", "Ivanova"]), "I-PER"))
            else:
                sentence.append((rng.choice(WORDS), "O"))
        out.append(sentence)
    return out


def write_conll(path: Path, n: int = 64, seed: int = 0) -> Path:
    """A CoNLL-2003-format file: ``word POS chunk NER`` per line, a blank line between
    sentences, a ``-DOCSTART-`` line first."""
    lines = ["-DOCSTART- -X- -X- O", ""]
    for sentence in sentences(n, seed):
        lines += [f"{word} NN I-NP {tag}" for word, tag in sentence] + [""]
    path.write_text("\n".join(lines) + "\n")
    return path


def documents(n: int, seed: int = 0) -> list[str]:
    return [" ".join(w for w, _ in s) for s in sentences(n, seed)]


def write_text(path: Path, n: int = 64, seed: int = 0) -> Path:
    path.write_text("\n".join(documents(n, seed)) + "\n")
    return path


def write_jsonl(path: Path, n: int = 64, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(documents(n, seed))))
    return path


def train_tokenizer(directory: Path, vocab_size: int = 120) -> Path:
    """A WordPiece tokenizer trained on the sentences' words, saved as a Hugging Face one
    (``PreTrainedTokenizerFast.save_pretrained``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer.train_from_iterator(
        documents(200, seed=99), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    fast.save_pretrained(str(directory))
    return directory


def save_dataset(directory: Path, n: int = 64, seed: int = 0) -> Path:
    """A ``datasets`` dataset (tokens, ner_tags as ids, text) written by ``save_to_disk``."""
    import datasets

    from sharded_exp.data.files import CONLL2003_LABELS

    rows = sentences(n, seed)
    data = datasets.Dataset.from_dict(
        {
            "tokens": [[w for w, _ in s] for s in rows],
            "ner_tags": [[CONLL2003_LABELS.index(t) for _, t in s] for s in rows],
            "text": [" ".join(w for w, _ in s) for s in rows],
        }
    )
    datasets.DatasetDict({"train": data}).save_to_disk(str(directory))
    return directory


def save_ner_dataset(directory: Path, n: int = 64, seed: int = 0) -> Path:
    """A ``datasets`` DatasetDict (train, validation) with ``words`` and ``tags`` (tag names)
    columns, written by ``save_to_disk``."""
    import datasets

    def split(n, seed):
        rows = sentences(n, seed)
        return datasets.Dataset.from_dict(
            {"words": [[w for w, _ in s] for s in rows], "tags": [[t for _, t in s] for s in rows]}
        )

    datasets.DatasetDict({"train": split(8, seed + 1), "validation": split(n, seed)}).save_to_disk(str(directory))
    return directory


class Classes(torch.utils.data.Dataset):
    """A user's Dataset for the MLP: Gaussian inputs labelled by the largest of their first
    ``classes`` features (items: inputs, targets)."""

    def __init__(self, n: int, in_features: int, classes: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, in_features, generator=g)
        self.y = self.x[:, :classes].argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"inputs": self.x[i], "targets": self.y[i]}


class Counting(torch.utils.data.Dataset):
    """A user's Dataset for a causal LM: counting sequences (each token is the previous + 1,
    modulo the vocabulary), with their own collate_fn."""

    def __init__(self, n: int, seq_len: int, vocab: int):
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return (i * 7 + torch.arange(self.seq_len)) % self.vocab

    def collate_fn(self, items: list) -> dict:
        ids = torch.stack(items)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class Tagged(Classes):
    """Classes whose items also hold values that are no tensors: a name (a string) and a
    span (a list of ints), which the model takes as they come."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "name": f"item {i}", "span": [i, i + 1]}
