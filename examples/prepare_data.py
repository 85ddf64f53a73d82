"""Tokenize a text dataset into the memory-mapped token file that train_gpt.py trains on.

The original implementation's preprocessing step (Megatron's preprocess_data.py with --append-eod and GPT-2 BPE) in our
terms:

  # the original's data: the Pile through `datasets`, GPT-2's vocab.json and merges.txt
  python examples/prepare_data.py --input EleutherAI/the_pile_deduplicated --vocab_file vocab.json \
      --merge_file merges.txt --output_prefix data/pile/tokens --num_proc 16
  # local files (jsonl, json, txt, csv or parquet) and any tokenizer by path or hub name
  python examples/prepare_data.py --input corpus.jsonl --text_column body --tokenizer path/to/tokenizer \
      --output_prefix data/corpus/tokens
  # offline default: the Python documentation shipped in the standard library, no download at all
  python examples/prepare_data.py --output_prefix data/pydoc/tokens

Offline default ("pydoc"): the documentation every CPython ships with, so the quick start needs no network:
the `pydoc_data.topics` pages (the language reference behind `help()`, about 0.5 MB of English prose) and the
docstrings of the standard-library modules (about 1.2 MB more; tests and IDLE left out). Its tokenizer is a
byte-level BPE trained on that same text with the `tokenizers` library (a few seconds): byte-level, so every
input is encodable with no unknown token, exactly like GPT-2's tokenizer; trained here, so nothing is
downloaded; and small (--bpe_vocab_size, 2048 by default), so a tiny model's embedding stays small and a short
run learns more than unigram statistics. A plain byte tokenizer would also need no training, but it triples the
number of tokens per text and makes the demo model spend its few hundred steps on spelling.

Each document gets the end-of-document token appended (Megatron's --append-eod); documents are tokenized in
parallel (datasets.map with --num_proc processes, with a progress bar) and written in order. The output format
is described in token_dataset.py.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sdp4bit_examples.token_dataset import paths, token_dtype, write_index

EOD_TOKEN = "<|endoftext|>"
MIN_DOCSTRING_CHARS = 200
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}

Encoder = Callable[[list[str]], list[list[int]]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", default=["pydoc"], nargs="+", help="'pydoc' (offline default), local files, or a datasets hub name"
    )
    p.add_argument("--subset", default=None, help="hub dataset configuration name")
    p.add_argument("--split", default="train", help="hub dataset split")
    p.add_argument("--text_column", default="text", help="column holding the document text")
    p.add_argument("--output_prefix", required=True, help="writes PREFIX.bin, PREFIX.docs.npy and PREFIX.json")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--vocab_file", help="GPT-2 BPE vocab.json (with --merge_file), as in the original")
    tok.add_argument("--tokenizer", help="any transformers tokenizer: a local path or a hub name")
    p.add_argument("--merge_file", help="GPT-2 BPE merges.txt (with --vocab_file)")
    p.add_argument(
        "--bpe_vocab_size",
        type=int,
        default=2048,
        help="vocabulary of the byte-level BPE trained on the input when no tokenizer is given",
    )
    p.add_argument(
        "--bpe_train_documents",
        type=int,
        default=100_000,
        help="train that BPE on at most this many documents (the first ones)",
    )
    p.add_argument("--num_proc", type=int, default=min(8, os.cpu_count() or 1), help="tokenizing processes")
    p.add_argument("--limit_documents", type=int, default=None, help="use only the first N documents")
    p.add_argument("--seed", type=int, default=1234, help="shuffles the offline documents' order")
    args = p.parse_args(argv)
    if (args.vocab_file is None) != (args.merge_file is None):
        p.error("--vocab_file and --merge_file go together (GPT-2 BPE)")
    if args.num_proc < 1:
        p.error(f"--num_proc = {args.num_proc}: must be >= 1")
    if args.bpe_train_documents < 1:
        p.error(f"--bpe_train_documents = {args.bpe_train_documents}: must be >= 1")
    if args.bpe_vocab_size < 257:
        p.error(f"--bpe_vocab_size = {args.bpe_vocab_size}: must be >= 257 (256 bytes + end-of-document)")
    return args


def _module_docstrings(path: Path) -> str:
    """The module, class and function docstrings of one source file, in source order, separated by blank lines."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return ""
    nodes = [
        n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    docs = [ast.get_docstring(n) for n in sorted(nodes, key=lambda n: getattr(n, "lineno", 0))]
    return "\n\n".join(d.strip() for d in docs if d and len(d) >= MIN_DOCSTRING_CHARS)


def pydoc_documents(seed: int) -> list[str]:
    """The interpreter's own documentation, in a seeded order so validation is not one subject.

    One document per pydoc_data topic (the language reference behind help()) and one per standard-library
    module (its docstrings); test suites and IDLE are left out.
    """
    from pydoc_data.topics import topics

    docs = [topics[name].strip() for name in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    for path in sorted(stdlib.rglob("*.py")):
        if skip.isdisjoint(path.relative_to(stdlib).parts):
            docs.append(_module_docstrings(path))
    docs = [d for d in docs if d]
    random.Random(seed).shuffle(docs)
    return docs


def load_documents(args: argparse.Namespace):
    """The input as a datasets.Dataset with the text column."""
    import datasets

    if args.input == ["pydoc"]:
        return datasets.Dataset.from_dict({args.text_column: pydoc_documents(args.seed)})
    local = [Path(x) for x in args.input]
    if all(path.exists() for path in local):
        suffixes = {path.suffix for path in local}
        if len(suffixes) != 1 or next(iter(suffixes)) not in LOCAL_BUILDERS:
            raise ValueError(
                f"--input {args.input}: local files must share one of the suffixes {sorted(LOCAL_BUILDERS)}"
            )
        builder = LOCAL_BUILDERS[suffixes.pop()]
        ds = datasets.load_dataset(builder, data_files=[str(x) for x in local], split="train")
    elif len(args.input) == 1:
        ds = datasets.load_dataset(args.input[0], args.subset, split=args.split, num_proc=args.num_proc)
    else:
        missing = [str(path) for path in local if not path.exists()]
        raise FileNotFoundError(f"--input: files not found: {missing}")
    if args.text_column not in ds.column_names:
        raise ValueError(f"--text_column {args.text_column!r} is not a column of the input; columns: {ds.column_names}")
    return ds


def train_bpe(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) trained on the given texts, with the end-of-document token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def gpt2_bpe(vocab_file: str, merge_file: str):
    """GPT-2's tokenizer from its vocab.json and merges.txt, the files the original uses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if tokenizer.token_to_id(EOD_TOKEN) is None:
        raise ValueError(f"--vocab_file {vocab_file} has no {EOD_TOKEN} token")
    return tokenizer


def make_encoder(args: argparse.Namespace, ds) -> tuple[Encoder, int, int, str]:
    """(encode a batch of texts, vocabulary size, end-of-document id, description) for the chosen tokenizer."""
    if args.tokenizer:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(args.tokenizer)
        if hf.eos_token_id is None:
            raise ValueError(f"--tokenizer {args.tokenizer} has no end-of-sequence token to use as end-of-document")

        def encode_hf(texts: list[str]) -> list[list[int]]:
            return hf(texts, add_special_tokens=False)["input_ids"]

        return encode_hf, len(hf), hf.eos_token_id, args.tokenizer
    if args.vocab_file:
        tokenizer, description = gpt2_bpe(args.vocab_file, args.merge_file), f"gpt2-bpe:{args.vocab_file}"
    else:
        sample = ds.select(range(min(args.bpe_train_documents, len(ds))))
        tokenizer = train_bpe((row[args.text_column] or "" for row in sample), args.bpe_vocab_size)
        tokenizer_path = Path(str(paths(args.output_prefix)[2]).removesuffix(".json") + ".tokenizer.json")
        tokenizer.save(str(tokenizer_path))
        description = str(tokenizer_path.name)

    def encode(texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in tokenizer.encode_batch(texts)]

    return encode, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOD_TOKEN), description


def tokenize(ds, encode: Encoder, eod_id: int, text_column: str, num_proc: int):
    """The dataset with an `ids` column (tokens + end-of-document) and a `length` column."""

    def batch(rows: dict) -> dict:
        ids = [doc + [eod_id] for doc in encode([text or "" for text in rows[text_column]])]
        return {"ids": ids, "length": [len(doc) for doc in ids]}

    return ds.map(
        batch,
        batched=True,
        batch_size=256,
        num_proc=min(num_proc, len(ds)),
        remove_columns=ds.column_names,
        desc="tokenizing",
    )


def write_tokens(tokenized, prefix: str, dtype: np.dtype) -> np.ndarray:
    """Write every document's ids to PREFIX.bin in order; returns the document start offsets plus the total."""
    lengths = np.asarray(tokenized["length"], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    bin_path = paths(prefix)[0]
    out = np.memmap(bin_path, dtype=dtype, mode="w+", shape=(int(offsets[-1]),))
    position = 0
    with tqdm(total=len(tokenized), desc="writing", unit="doc") as bar:
        for rows in tokenized.select_columns(["ids"]).iter(batch_size=1024):
            flat = np.concatenate([np.asarray(doc, dtype=dtype) for doc in rows["ids"]])
            out[position : position + len(flat)] = flat
            position += len(flat)
            bar.update(len(rows["ids"]))
    out.flush()
    return offsets


def main(argv: list[str] | None = None) -> dict:
    """Load, tokenize and write; prints and returns the index."""
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    ds = load_documents(args)
    if args.limit_documents is not None:
        ds = ds.select(range(min(args.limit_documents, len(ds))))
    if len(ds) < 2:
        raise ValueError(f"--input {args.input}: {len(ds)} document(s); need at least 2 (train and validation)")
    encode, vocab_size, eod_id, description = make_encoder(args, ds)
    tokenized = tokenize(ds, encode, eod_id, args.text_column, args.num_proc)
    dtype = token_dtype(vocab_size)
    offsets = write_tokens(tokenized, args.output_prefix, dtype)
    index = write_index(args.output_prefix, int(offsets[-1]), offsets, vocab_size, eod_id, description)
    print(
        f"wrote {index['num_tokens']:,} tokens of {index['num_documents']:,} documents "
        f"(vocabulary {vocab_size}, {dtype.name}) to {paths(args.output_prefix)[0]}",
        file=sys.stderr,
    )
    return index


if __name__ == "__main__":
    main()
