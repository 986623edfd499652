"""Training data: built-in tasks or local files -> tokenizer -> packed blocks -> per-rank batches.

    texts = load_texts(run.data)                                # a datasets.Dataset with "text"
    tokenizer = train_tokenizer(texts, run.data)                # or load_tokenizer(directory)
    train_blocks, eval_blocks = pack_splits(texts, tokenizer, run.data)   # LongTensor [n, seq_len]
    # or pack_splits_cached(..., cache_dir=blocks_cache_dir()): tokenized once, read back after
    sampler = BlockSampler(len(train_blocks), batch, dp_rank=0, seed=run.data.seed)
    for indices in sampler.micro_batches(consumed_samples=0):   # this rank's share of one step
        input_ids = train_blocks[indices]

Every block holds exactly `seq_len` tokens (documents joined by EOS, then cut), so every
micro-batch has the same number of predicted tokens and the mean over micro-batches and ranks is
the mean over the global batch: that is what makes ZeRO and gradient accumulation exact.

The data position is one number, the samples consumed so far; the global batch of a step is a
function of it alone (and the seed), whatever the data-parallel size, so a run resumes exactly.
"""
from __future__ import annotations

import glob
import random
from pathlib import Path
from typing import Any, Callable

from dsframework.config import DataSpec
from dsframework.errors import UserError, did_you_mean
from dsframework.files import written_then_renamed

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}


# --- built-in tasks -----------------------------------------------------------------------------

def _addition(rng: random.Random, digits: int) -> str:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"{a}+{b}={a + b}"


def _reverse(rng: random.Random, digits: int) -> str:
    text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 2 * digits)))
    return f"{text}>{text[::-1]}"


def _counting(rng: random.Random, digits: int) -> str:
    start = rng.randrange(10**digits)
    return ",".join(str(start + i) for i in range(8))


BUILTIN_TASKS: dict[str, Callable[[random.Random, int], str]] = {
    "addition": _addition,   # 123+456=579
    "reverse": _reverse,     # 1234>4321
    "counting": _counting,   # 17,18,19,20,21,22,23,24
}


def generate_task(name: str, *, num_examples: int, digits: int, seed: int) -> list[str]:
    """Deterministic examples of a built-in task."""
    rng = random.Random(seed)
    make = BUILTIN_TASKS[name]
    return [make(rng, digits) for _ in range(num_examples)]


# --- loading ------------------------------------------------------------------------------------

_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
            ".text": "text"}


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or (
        path / "state.json").is_file()


def load_texts(spec: DataSpec) -> Any:
    """A datasets.Dataset with one column "text": a built-in task, or the user's local data."""
    import datasets

    if spec.dataset in BUILTIN_TASKS:
        texts = generate_task(spec.dataset, num_examples=spec.num_examples, digits=spec.max_digits,
                              seed=spec.seed)
        return datasets.Dataset.from_dict({"text": texts})
    path = Path(spec.dataset).expanduser()
    if path.is_dir() and _is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    else:
        files = sorted(glob.glob(str(path / "*") if path.is_dir() else str(path)))
        files = [f for f in files if Path(f).suffix in _FORMATS]
        if not files:
            raise UserError("data.dataset", spec.dataset,
                            "is neither a built-in task nor a data file, glob or saved dataset",
                            f"use one of {sorted(BUILTIN_TASKS)} or a .jsonl/.csv/.parquet/.txt path")
        formats = {_FORMATS[Path(f).suffix] for f in files}
        if len(formats) > 1:
            raise UserError("data.dataset", spec.dataset, f"mixes formats {sorted(formats)}",
                            "point to files of one format")
        level = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error log would be a 2nd line
        try:
            loaded = datasets.load_dataset(formats.pop(), data_files=files, split="train")
        except Exception as err:  # noqa: BLE001 - datasets raises many types for a malformed file
            raise UserError("data.dataset", spec.dataset, f"could not be read: {type(err).__name__}",
                            "check that the file is valid for its extension") from None
        finally:
            datasets.logging.set_verbosity(level)
    if spec.text_field not in loaded.column_names:
        raise UserError("data.text_field", spec.text_field, f"is not a column of {spec.dataset}",
                        did_you_mean(spec.text_field, loaded.column_names))
    texts = loaded.select_columns([spec.text_field])
    if spec.text_field != "text":
        texts = texts.rename_column(spec.text_field, "text")
    return texts.filter(lambda row: bool(row["text"]))


# --- tokenizers ---------------------------------------------------------------------------------

def train_tokenizer(texts: Any, spec: DataSpec) -> Any:
    """A tokenizer trained here with `tokenizers`: characters for built-in tasks, byte-level BPE else."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    if spec.dataset in BUILTIN_TASKS:
        tok = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS["unk_token"]))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(special_tokens=specials)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=spec.tokenizer_vocab_size, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((row["text"] for row in texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def load_tokenizer(directory: str | Path, *, field: str = "model.tokenizer") -> Any:
    """A tokenizer saved with save_pretrained in a local directory (never the hub)."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(field, str(directory), "is not a directory", "point to a saved tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(field, str(directory), f"holds no loadable tokenizer ({type(err).__name__})",
                        "point to a directory written by tokenizer.save_pretrained") from None
    if tokenizer.eos_token_id is None:
        raise UserError(field, str(directory), "tokenizer has no EOS token",
                        "use a tokenizer with an eos_token; documents are joined by it")
    return tokenizer


# --- packing ------------------------------------------------------------------------------------

def pack(texts: Any, tokenizer: Any, seq_len: int) -> Any:
    """Tokenize, join documents with EOS and cut into [n, seq_len] blocks (remainder dropped)."""
    import torch

    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [seq + [eos] for seq in ids]}

    tokenized = texts.map(tokenize, batched=True, remove_columns=texts.column_names)
    flat = torch.tensor([t for seq in tokenized["input_ids"] for t in seq], dtype=torch.long)
    num_blocks = flat.numel() // seq_len
    return flat[: num_blocks * seq_len].view(num_blocks, seq_len)


def pack_splits(texts: Any, tokenizer: Any, spec: DataSpec) -> tuple[Any, Any]:
    """(train_blocks, eval_blocks): documents held out for eval before packing, so none straddles."""
    if len(texts) < 2:
        raise UserError("data.dataset", spec.dataset, f"has {len(texts)} non-empty documents",
                        "provide at least 2 (one for eval)")
    split = texts.train_test_split(test_size=spec.eval_fraction, seed=spec.seed, shuffle=True)
    train, held_out = pack(split["train"], tokenizer, spec.seq_len), pack(split["test"], tokenizer, spec.seq_len)
    if len(train) == 0 or len(held_out) == 0:
        raise UserError("data.seq_len", spec.seq_len, "is longer than the data can fill",
                        "lower data.seq_len or provide more data")
    return train, held_out


BLOCKS_CACHE_VERSION = 1  # bump when pack/pack_splits change what they produce


def _blocks_key(texts: Any, tokenizer: Any, spec: DataSpec) -> str:
    """What the blocks depend on: the data (datasets' fingerprint: content for generated data, files
    for loaded data), the tokenizer's full definition, and the packing settings."""
    import hashlib
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    digest = hashlib.sha256()
    for part in (BLOCKS_CACHE_VERSION, texts._fingerprint, type(tokenizer).__name__, vocab,
                 tokenizer.eos_token_id, spec.seq_len, spec.eval_fraction, spec.seed):
        digest.update(f"{part}\0".encode())
    return digest.hexdigest()[:24]


def pack_splits_cached(texts: Any, tokenizer: Any, spec: DataSpec, *, cache_dir: Path | None) -> tuple[Any, Any]:
    """pack_splits, tokenized once: the blocks are saved in `cache_dir` under a key of everything
    they depend on, and read back by later runs, resumed runs and the other ranks (rank 0 writes,
    see engine.rank_zero_first). A cache file that does not load is rebuilt."""
    import torch

    if cache_dir is None:
        return pack_splits(texts, tokenizer, spec)
    path = Path(cache_dir) / f"blocks-{_blocks_key(texts, tokenizer, spec)}.pt"
    if path.is_file():
        try:
            saved = torch.load(path, weights_only=True)
            return saved["train"], saved["eval"]
        except Exception:  # noqa: BLE001 - a torn or foreign file: build it again
            pass
    train, held_out = pack_splits(texts, tokenizer, spec)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_then_renamed(path) as tmp:  # the other ranks read the whole file or none
            torch.save({"train": train, "eval": held_out}, tmp)
    except OSError:
        pass  # a read-only cache: train without it
    return train, held_out


def blocks_cache_dir() -> Path:
    """Beside datasets' own cache (HF_DATASETS_CACHE / HF_HOME)."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "dsframework-blocks"


# --- sampling -----------------------------------------------------------------------------------

class BlockSampler:
    """Which blocks each data-parallel rank reads, as a pure function of the samples consumed.

    Sample i of the run is block perm_{i // n}[i % n], perm_e a seeded permutation per epoch.
    A step takes the next `global_batch` samples; rank r reads the r-th contiguous slice of them,
    in `grad_accum` micro-batches, so the ranks' shards are disjoint and cover the global batch.
    """

    def __init__(self, num_blocks: int, *, micro_batch: int, grad_accum: int, dp_size: int,
                 dp_rank: int, seed: int):
        assert 0 <= dp_rank < dp_size and num_blocks > 0
        self.num_blocks, self.micro_batch, self.grad_accum = num_blocks, micro_batch, grad_accum
        self.dp_size, self.dp_rank, self.seed = dp_size, dp_rank, seed
        self._perms: dict[int, Any] = {}

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def _perm(self, epoch: int) -> list[int]:
        """The epoch's order, drawn on the CPU once per epoch (a list: steps index it in Python)."""
        import torch

        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.num_blocks, generator=generator).tolist()}
        return self._perms[epoch]

    def global_indices(self, consumed_samples: int) -> list[int]:
        """The block indices of the step that starts after `consumed_samples` samples."""
        return [self._perm(i // self.num_blocks)[i % self.num_blocks]
                for i in range(consumed_samples, consumed_samples + self.global_batch)]

    def micro_batches(self, consumed_samples: int) -> list[list[int]]:
        """This rank's `grad_accum` micro-batches of block indices for one step."""
        indices = self.global_indices(consumed_samples)
        per_rank = self.micro_batch * self.grad_accum
        mine = indices[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return [mine[k * self.micro_batch:(k + 1) * self.micro_batch] for k in range(self.grad_accum)]


def eval_shard(num_blocks: int, *, micro_batch: int, dp_size: int, dp_rank: int) -> list[list[int]]:
    """This rank's eval micro-batches: the same count on every rank (ZeRO-3 needs each rank to
    run every forward), blocks beyond a multiple of micro_batch * dp_size left out."""
    micro = min(micro_batch, max(1, num_blocks // dp_size))
    usable = num_blocks - num_blocks % (micro * dp_size)
    mine = list(range(dp_rank, usable, dp_size))
    return [mine[k:k + micro] for k in range(0, len(mine), micro)]
