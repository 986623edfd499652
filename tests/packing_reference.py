"""The in-memory packing dsframework used before the token store (issue 12), kept as the reference
the store is checked against: the same blocks, in the same order, so the same losses.

    train, held_out = pack_splits(load_texts(run.data), tokenizer, run.data)   # LongTensor [n, seq_len]
"""
from __future__ import annotations

from typing import Any


def pack(texts: Any, tokenizer: Any, seq_len: int) -> Any:
    """Tokenize, join documents with EOS and cut into [n, seq_len] blocks (remainder dropped)."""
    import torch

    eos = tokenizer.eos_token_id
    ids = tokenizer(list(texts["text"]), add_special_tokens=False)["input_ids"]
    flat = torch.tensor([t for seq in ids for t in seq + [eos]], dtype=torch.long)
    num_blocks = flat.numel() // seq_len
    return flat[: num_blocks * seq_len].view(num_blocks, seq_len)


def pack_splits(texts: Any, tokenizer: Any, spec: Any) -> tuple[Any, Any]:
    """(train_blocks, eval_blocks): documents held out for eval before packing, so none straddles."""
    split = texts.train_test_split(test_size=spec.eval_fraction, seed=spec.seed, shuffle=True)
    return pack(split["train"], tokenizer, spec.seq_len), pack(split["test"], tokenizer, spec.seq_len)
