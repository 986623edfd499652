"""The token store: each split tokenized once into flat files on disk, mapped read-only by every rank.

    train, held_out = token_stores(rows, tokenizer, run.data, cache_dir=store_cache_dir())
    len(train)                          # rows of seq_len tokens
    train[[3, 7]]                       # LongTensor [2, seq_len]: a copy of two rows, the rest stays on disk
    train.micro_batch([3, 7], weight=w) # what the model is fed (ids; or ids, labels, positions and the weight)

Text (`data.format: text`): the documents, in a seeded shuffle with the eval documents held out
first, joined by EOS into one stream of uint16 ids (uint32 when the vocabulary needs it); row i
is stream[i * seq_len:(i + 1) * seq_len], the tail that fills no row is dropped. These are the
blocks the in-memory packing before the store made, in the same order.

Chat and prompt/completion: whole examples (data/examples.py: ids and a trained-token mask) packed
in order into rows of seq_len, the next example starting a new row when it does not fit (or one
per row with `data.packing: false`), each with its own position ids from 0, so transformers'
packed-sequence masking keeps every example to itself; the unfilled tail of a row is padding, never
trained, with positions of its own. An example longer than seq_len is cut; one left with no trained
token is dropped (both counted in the store's report).

Tokenization runs through datasets' `map` (batched, `num_proc` processes for big data) into its
Arrow cache, then streams to the store files batch by batch: no process holds the corpus. The
store lives in `cache_dir` under a key of everything it depends on; it is written into a temporary
directory renamed into place when complete, and one whose files do not have the sizes its
meta.json records (torn) is rebuilt. Reading a batch copies its rows and releases their pages from
the process (madvise): the page cache is shared by the ranks and a rank's memory does not grow
with the corpus.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dsframework.config import DataSpec
from dsframework.data.examples import tokenize_examples
from dsframework.errors import UserError
from dsframework.files import disk_full, free_bytes, gib
from dsframework.models.loss import IGNORE_INDEX  # the label of a token that trains nothing

STORE_VERSION = 2  # bump when what a store holds for the same inputs changes
BIG_DATA_BYTES = 64 << 20  # above this, tokenize with several processes by default


def id_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def default_num_proc(rows: Any, spec: DataSpec) -> int:
    if spec.num_proc is not None:
        return spec.num_proc
    size = getattr(getattr(rows, "data", None), "nbytes", 0)
    return min(os.cpu_count() or 1, 8) if size > BIG_DATA_BYTES else 1


# --- reading ------------------------------------------------------------------------------------

class _MappedRows:
    """[rows, width] of `dtype` in a file, memory-mapped; `take` copies rows and lets their pages go."""

    def __init__(self, path: Path, dtype: np.dtype, *, width: int, rows: int):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._array = np.frombuffer(self._map, dtype=dtype, count=rows * width).reshape(rows, width)

    def take(self, indices: list[int]) -> np.ndarray:
        out = self._array[indices]  # fancy indexing: a copy
        # Unmap what the read mapped (they stay in the shared page cache): the whole mapping, since
        # the kernel maps neighbours of each page read too (fault-around), and skipping unmapped
        # ranges costs next to nothing.
        self._map.madvise(mmap.MADV_DONTNEED)
        return out


class TokenStore:
    """One split of a store: `len(store)` rows of `seq_len` tokens (see the module docstring)."""

    def __init__(self, directory: Path, split: str):
        meta = json.loads((directory / "meta.json").read_text())
        info = meta["splits"][split]
        self.directory, self.split, self.seq_len = directory, split, meta["seq_len"]
        self.num_rows, self.report = info["rows"], info
        self.supervised = meta["format"] != "text"
        width, rows = self.seq_len, self.num_rows
        self._ids = _MappedRows(directory / f"{split}.ids", np.dtype(meta["dtype"]), width=width, rows=rows)
        self._trained = self._positions = None
        if self.supervised:
            self._trained = _MappedRows(directory / f"{split}.trained", np.dtype(np.uint8), width=width, rows=rows)
            self._positions = _MappedRows(directory / f"{split}.positions", np.dtype(meta["position_dtype"]),
                                          width=width, rows=rows)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: Any) -> Any:
        """The token ids of a row (1-D) or of a list of rows (2-D), as a LongTensor."""
        import torch

        if isinstance(index, (int, np.integer)):
            return torch.from_numpy(self._ids.take([int(index)]).astype(np.int64))[0]
        return torch.from_numpy(self._ids.take(_as_list(index, self.num_rows)).astype(np.int64))

    def trained_tokens(self, indices: Any) -> int:
        """Labels the causal LM loss counts in these rows (token t predicts t + 1: row starts never)."""
        indices = _as_list(indices, self.num_rows)
        if self._trained is None:
            return len(indices) * (self.seq_len - 1)
        return int(self._trained.take(indices)[:, 1:].sum())

    def micro_batch(self, indices: Any, *, weight: float | None = None) -> Any:
        """Text: the ids (LongTensor). Supervised: {input_ids, labels, position_ids, loss_weight}, where
        the loss of the micro-batch's trained tokens is to be summed and multiplied by loss_weight
        (train/step.py micro_batch_loss; `weight` is set per step so the mean is over the whole batch)."""
        import torch

        if not self.supervised:
            return self[indices]
        assert self._trained is not None and self._positions is not None  # a supervised store maps both
        indices = _as_list(indices, self.num_rows)
        input_ids = torch.from_numpy(self._ids.take(indices).astype(np.int64))
        labels = input_ids.masked_fill(torch.from_numpy(self._trained.take(indices) == 0), IGNORE_INDEX)
        return {"input_ids": input_ids, "labels": labels,
                "position_ids": torch.from_numpy(self._positions.take(indices).astype(np.int64)),
                "loss_weight": weight}


def _as_list(index: Any, rows: int) -> list[int]:
    if hasattr(index, "tolist"):
        index = index.tolist()
    if isinstance(index, slice):
        return list(range(*index.indices(rows)))
    return [int(i) for i in index]


def describe_store(store: TokenStore) -> str:
    """One line on what a split holds: documents and tokens; for examples, what was cut or dropped."""
    r = store.report
    if not store.supervised:
        return (f"{store.split}: {r['documents']:,} documents, {r['tokens']:,} tokens in {r['rows']:,} rows "
                f"({r['dropped_tail_tokens']:,} tail tokens dropped)")
    return (f"{store.split}: {r['examples']:,} examples in {r['rows']:,} rows, {r['trained_tokens']:,} trained tokens, "
            f"{r['padding'] / max(r['tokens'], 1):.0%} padding, {r['truncated']:,} cut to seq_len, "
            f"{r['dropped']:,} dropped with no trained token left")


# --- writing: text ------------------------------------------------------------------------------

def _tokenize_documents(batch: dict[str, list], *, tokenizer: Any, eos: int) -> dict[str, list]:
    ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
    return {"input_ids": [seq + [eos] for seq in ids]}


def _end_with_eos(batch: dict[str, list], *, eos: int) -> dict[str, list]:
    return {"input_ids": [seq if seq and seq[-1] == eos else list(seq) + [eos] for seq in batch["input_ids"]]}


def _write_stream(documents: Any, path: Path, *, dtype: np.dtype, vocab_size: int, field: str) -> int:
    """Append every document's ids to `path`; the number of tokens written."""
    import pyarrow.compute as pc

    tokens = 0
    with open(path, "wb") as f:
        for table in documents.with_format("arrow").iter(batch_size=8192):
            flat = pc.list_flatten(  # pyright: ignore[reportAttributeAccessIssue]  pyarrow.compute makes it at import
                table["input_ids"]).to_numpy(zero_copy_only=False)
            if flat.size and (flat.max() >= vocab_size or flat.min() < 0):
                bad = int(flat.max() if flat.max() >= vocab_size else flat.min())
                raise UserError(field, bad, f"is an input_ids value outside the tokenizer's vocabulary "
                                f"(0..{vocab_size - 1})", "tokenize with the run's tokenizer (model.tokenizer) "
                                "or give the model a vocabulary that covers the ids")
            f.write(flat.astype(dtype, copy=False).tobytes())
            tokens += int(flat.size)
    return tokens


def _text_split(documents: Any, tokenizer: Any, spec: DataSpec, out: Path, split: str, *,
                dtype: np.dtype, num_proc: int) -> dict[str, Any]:
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    if "input_ids" in documents.column_names:  # already tokenized: documents are joined by EOS all the same
        ids = documents.map(_end_with_eos, batched=True, fn_kwargs={"eos": eos}, num_proc=num_proc)
    else:
        ids = documents.map(_tokenize_documents, batched=True, remove_columns=documents.column_names,
                            fn_kwargs={"tokenizer": tokenizer, "eos": eos}, num_proc=num_proc)
    tokens = _write_stream(ids, out / f"{split}.ids", dtype=dtype, vocab_size=vocab, field="data.dataset")
    rows = tokens // spec.seq_len
    return {"rows": rows, "documents": len(documents), "tokens": tokens, "dropped_tail_tokens": tokens - rows * spec.seq_len}


# --- writing: chat and prompt/completion ---------------------------------------------------------

def pack_examples(examples: Iterator[tuple[list[int], list[int]]], *, seq_len: int, packing: bool,
                  pad_id: int, counts: dict[str, int]) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """Rows of (ids, trained, positions), each seq_len long, from (ids, trained) examples in order.

    An example goes in the current row when it fits (always alone with packing off), else it
    starts the next; cut to seq_len when longer; dropped when it has no trained token left. Each
    example's positions start at 0; the padding tail is a sequence of its own, never trained."""
    ids: list[int] = []
    trained: list[int] = []
    positions: list[int] = []

    def finish() -> tuple[list[int], list[int], list[int]]:
        pad = seq_len - len(ids)
        counts["padding"] += pad
        return ids + [pad_id] * pad, trained + [0] * pad, positions + list(range(pad))

    for example_ids, example_trained in examples:
        if len(example_ids) > seq_len:
            counts["truncated"] += 1
            example_ids, example_trained = example_ids[:seq_len], example_trained[:seq_len]
        if not any(example_trained[1:]):
            counts["dropped"] += 1
            continue
        if ids and (not packing or len(ids) + len(example_ids) > seq_len):
            yield finish()
            ids, trained, positions = [], [], []
        ids, trained = ids + list(example_ids), trained + list(example_trained)
        positions += range(len(example_ids))
        counts["examples"] += 1
    if ids:
        yield finish()


def _example_pairs(examples: Any) -> Iterator[tuple[list[int], list[int]]]:
    for batch in examples.iter(batch_size=1024):
        yield from zip(batch["input_ids"], batch["trained"])


def _supervised_split(examples: Any, tokenizer: Any, spec: DataSpec, out: Path, split: str, *,
                      dtype: np.dtype, position_dtype: np.dtype) -> dict[str, Any]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    counts = {"examples": 0, "truncated": 0, "dropped": 0, "padding": 0}
    written = trained_total = 0
    with open(out / f"{split}.ids", "wb") as f_ids, open(out / f"{split}.trained", "wb") as f_trained, \
            open(out / f"{split}.positions", "wb") as f_positions:
        for row_ids, row_trained, row_positions in pack_examples(
                _example_pairs(examples), seq_len=spec.seq_len, packing=spec.packing, pad_id=pad, counts=counts):
            f_ids.write(np.asarray(row_ids, dtype=dtype).tobytes())
            f_trained.write(np.asarray(row_trained, dtype=np.uint8).tobytes())
            f_positions.write(np.asarray(row_positions, dtype=position_dtype).tobytes())
            written += 1
            trained_total += sum(row_trained)
    return {"rows": written, "tokens": written * spec.seq_len, "trained_tokens": trained_total, **counts}


# --- the store: key, build, cache -----------------------------------------------------------------

def store_key(rows: Any, tokenizer: Any, spec: DataSpec) -> str:
    """What the store depends on: the data (datasets' fingerprint: content for generated data, files
    for loaded data), the tokenizer's full definition (and chat template), and the data settings."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    settings = spec.model_dump(mode="json", exclude={"num_proc"})
    digest = hashlib.sha256()
    for part in (STORE_VERSION, rows._fingerprint, type(tokenizer).__name__, vocab, tokenizer.eos_token_id,
                 tokenizer.pad_token_id, getattr(tokenizer, "chat_template", None), json.dumps(settings, sort_keys=True)):
        digest.update(f"{part}\0".encode())
    return digest.hexdigest()[:24]


def _files_of(meta: dict[str, Any]) -> dict[str, int]:
    """{file name: size in bytes} of a store, from its meta.json."""
    kinds = {"ids": np.dtype(meta["dtype"]).itemsize}
    if meta["format"] != "text":
        kinds.update(trained=1, positions=np.dtype(meta["position_dtype"]).itemsize)
    sizes = {}
    for split, info in meta["splits"].items():
        for kind, itemsize in kinds.items():
            sizes[f"{split}.{kind}"] = (info["tokens"] if kind == "ids" and meta["format"] == "text"
                                        else info["rows"] * meta["seq_len"]) * itemsize
    return sizes


def _is_complete(directory: Path) -> bool:
    try:
        meta = json.loads((directory / "meta.json").read_text())
        return meta.get("version") == STORE_VERSION and all(
            (directory / name).stat().st_size == size for name, size in _files_of(meta).items())
    except (OSError, ValueError, KeyError):
        return False


def build_store(rows: Any, tokenizer: Any, spec: DataSpec, out: Path) -> dict[str, Any]:
    """Write both splits into the directory `out`; returns the meta written to out/meta.json last."""
    if len(rows) < 2:
        raise UserError("data.dataset", spec.dataset, f"has {len(rows)} non-empty examples",
                        "provide at least 2 (one for eval)")
    dtype, num_proc = id_dtype(len(tokenizer)), default_num_proc(rows, spec)
    if spec.format != "text":  # examples are checked (and errors name their row) in the user's order
        canonical = {"messages_field": "messages", "prompt_field": "prompt", "completion_field": "completion"}
        rows = tokenize_examples(rows, tokenizer, spec.model_copy(update=canonical), num_proc=num_proc)  # load_texts' names
        if len(rows) < 2:
            raise UserError("data.dataset", spec.dataset, f"has {len(rows)} examples with a trained token",
                            "provide at least 2 (one for eval)")
    split = rows.train_test_split(test_size=spec.eval_fraction, seed=spec.seed, shuffle=True)
    meta: dict[str, Any] = {"version": STORE_VERSION, "format": spec.format, "seq_len": spec.seq_len,
                            "dtype": dtype.name, "splits": {}}
    for name, part in (("train", split["train"]), ("eval", split["test"])):
        if spec.format == "text":
            info = _text_split(part, tokenizer, spec, out, name, dtype=dtype, num_proc=num_proc)
        else:
            meta["position_dtype"] = id_dtype(spec.seq_len).name
            info = _supervised_split(part, tokenizer, spec, out, name, dtype=dtype,
                                     position_dtype=np.dtype(meta["position_dtype"]))
        if info["rows"] == 0:
            raise UserError("data.seq_len", spec.seq_len, f"is longer than the {name} data can fill",
                            "lower data.seq_len or provide more data")
        meta["splits"][name] = info
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def token_stores(rows: Any, tokenizer: Any, spec: DataSpec, *, cache_dir: Path) -> tuple[TokenStore, TokenStore]:
    """(train, eval) stores: read from the cache when a complete one is there, else built and cached.

    Ranks call this one after another (engine: rank 0 first); processes racing to build the
    same store each write their own temporary directory, and the first rename wins."""
    cache_dir = Path(cache_dir)
    final = cache_dir / f"store-{store_key(rows, tokenizer, spec)}"
    if not _is_complete(final):
        shutil.rmtree(final, ignore_errors=True)  # torn, or from another version
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(cache_dir / f".{final.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as err:
            raise UserError("HF_DATASETS_CACHE", str(cache_dir), f"cannot hold the token store ({err.strerror})",
                            "point HF_DATASETS_CACHE (or HF_HOME) at a writable directory") from None
        try:
            build_store(rows, tokenizer, spec, tmp)
            os.rename(tmp, final)
        except OSError as err:
            if _is_complete(final):  # another process renamed its copy first
                pass
            elif disk_full(err):
                shutil.rmtree(tmp, ignore_errors=True)  # (before the free space is measured)
                raise UserError("HF_DATASETS_CACHE", str(cache_dir), f"could not hold the token store: the disk is "
                                f"full ({gib(free_bytes(cache_dir))} free), nothing partial is left",
                                "free space there, or point HF_DATASETS_CACHE (or HF_HOME) at a larger disk") from None
            else:
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return TokenStore(final, "train"), TokenStore(final, "eval")


def store_cache_dir() -> Path:
    """Beside datasets' own cache (HF_DATASETS_CACHE / HF_HOME)."""
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "dsframework-stores"
