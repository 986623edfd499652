"""The run's tokenizer: trained here with `tokenizers`, or loaded from a local directory.

    tokenizer = train_tokenizer(texts, run.data)     # characters for built-in tasks, byte-level BPE else
    tokenizer = load_tokenizer("runs/x/checkpoints/tokenizer")
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dsframework.config import DataSpec
from dsframework.errors import UserError
from dsframework.data.tasks import BUILTIN_TASKS

TOKENIZER_SAMPLE_BYTES = 256 << 20  # a tokenizer is trained on at most this much text (the first documents)

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}


def train_tokenizer(texts: Any, spec: DataSpec) -> Any:
    """A tokenizer trained here with `tokenizers`: characters for built-in tasks, byte-level BPE else."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if "input_ids" in texts.column_names:
        raise UserError("model.tokenizer", None, "is needed for already tokenized data (an input_ids column)",
                        "set model.tokenizer to the tokenizer that made the ids, or use a pretrained model.name")
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
    tok.train_from_iterator(_sample(texts), trainer=trainer)
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


def _texts_of(batch: dict[str, list]) -> list[str]:
    """The text of a batch of rows of any format: documents, prompts and completions, turns."""
    if "text" in batch:
        return batch["text"]
    if "prompt" in batch:
        return [f"{p}{c}" for p, c in zip(batch["prompt"], batch["completion"])]
    return ["\n".join(str(turn.get("content") or "") for turn in turns if isinstance(turn, dict))
            for turns in batch["messages"] if isinstance(turns, list)]


def _sample(texts: Any) -> Any:
    """The documents, in order, up to TOKENIZER_SAMPLE_BYTES of text: a vocabulary settles long before
    a big corpus ends, and the trainer's memory grows with what it reads."""
    seen = 0
    for batch in texts.iter(batch_size=1024):
        for text in _texts_of(batch):
            yield text
            seen += len(text)
            if seen >= TOKENIZER_SAMPLE_BYTES:
                return
