"""The token file that prepare_data.py writes and train_gpt.py samples from.

Layout for an output prefix P:
  P.bin        every token of every document, end-of-document token included, as one flat numpy memmap
               (uint16 when the vocabulary fits in 16 bits, else uint32);
  P.docs.npy   int64 start offset of each document plus the total (len = documents + 1): a separate array
               because a corpus such as the Pile has hundreds of millions of documents;
  P.json       the index: format, dtype, token and document counts, vocabulary size, end-of-document id,
               the tokenizer used and the names of the two files above.

Samples are Megatron-style windows of seq_len + 1 tokens taken every seq_len tokens, so consecutive samples share
one token and every token is predicted once per epoch. The last documents (a fraction of the tokens, rounded to a
document boundary) are held out for validation, so no validation text is ever trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "sdp4bit-tokens-v1"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary of this size."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size = {vocab_size}: must be >= 1")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def paths(prefix: str | Path) -> tuple[Path, Path, Path]:
    """(tokens, document offsets, index) paths of a token file prefix."""
    prefix = Path(prefix)
    return (
        prefix.with_name(prefix.name + ".bin"),
        prefix.with_name(prefix.name + ".docs.npy"),
        prefix.with_name(prefix.name + ".json"),
    )


def write_index(
    prefix: str | Path, num_tokens: int, doc_offsets: np.ndarray, vocab_size: int, eod_id: int, tokenizer: str
) -> dict:
    """Write P.docs.npy and the P.json index for a P.bin already written; returns the index."""
    bin_path, docs_path, index_path = paths(prefix)
    np.save(docs_path, doc_offsets.astype(np.int64))
    index = {
        "format": FORMAT,
        "dtype": token_dtype(vocab_size).name,
        "num_tokens": int(num_tokens),
        "num_documents": int(len(doc_offsets) - 1),
        "vocab_size": int(vocab_size),
        "eod_id": int(eod_id),
        "tokenizer": tokenizer,
        "tokens_file": bin_path.name,
        "documents_file": docs_path.name,
    }
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return index


@dataclass(frozen=True)
class Split:
    """A contiguous token range [start, end) cut into windows of seq_len + 1 tokens every seq_len tokens."""

    start: int
    end: int
    seq_len: int

    @property
    def num_samples(self) -> int:
        return max(0, (self.end - self.start - 1) // self.seq_len)


class TokenFile:
    """A prepared token file opened read-only, with its train and validation splits for one sequence length."""

    def __init__(self, prefix: str | Path, seq_len: int, valid_fraction: float) -> None:
        bin_path, docs_path, index_path = paths(prefix)
        if not index_path.exists():
            raise FileNotFoundError(f"--data {prefix}: no index {index_path} (run examples/prepare_data.py first)")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index_path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        if not 0.0 < valid_fraction < 1.0:
            raise ValueError(f"--valid_fraction = {valid_fraction}: must be in (0, 1)")
        self.tokens = np.memmap(bin_path, dtype=self.index["dtype"], mode="r", shape=(self.index["num_tokens"],))
        self.doc_offsets = np.load(docs_path)
        self.vocab_size = int(self.index["vocab_size"])
        self.eod_id = int(self.index["eod_id"])
        boundary = self._validation_start(valid_fraction)
        self.train = Split(0, boundary, seq_len)
        self.valid = Split(boundary, len(self.tokens), seq_len)
        for name, split in (("training", self.train), ("validation", self.valid)):
            if split.num_samples < 1:
                raise ValueError(
                    f"--data {prefix}: {len(self.tokens)} tokens leave no {name} sample of "
                    f"{seq_len + 1} tokens with --valid_fraction {valid_fraction}; use more data, a "
                    f"shorter --seq_len or another --valid_fraction"
                )

    def _validation_start(self, valid_fraction: float) -> int:
        """The document boundary closest to (1 - valid_fraction) of the tokens, keeping one document each side."""
        target = (1.0 - valid_fraction) * len(self.tokens)
        inner = self.doc_offsets[1:-1]
        if len(inner) == 0:
            return int(round(target))
        return int(inner[np.abs(inner - target).argmin()])

    def sample(self, split: Split, index: int) -> np.ndarray:
        """Window `index` of a split: seq_len + 1 tokens as int64."""
        if not 0 <= index < split.num_samples:
            raise IndexError(f"sample {index} outside [0, {split.num_samples})")
        begin = split.start + index * split.seq_len
        return np.asarray(self.tokens[begin : begin + split.seq_len + 1], dtype=np.int64)


class SampleOrder:
    """Which training window feeds global position g: a fresh seeded permutation of all windows every epoch.

    Position g of the run (step * global_batch + offset) maps to the same window whatever the number of ranks,
    so runs with different world sizes or configs see the same data in the same order.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return int(self._perm[offset])
