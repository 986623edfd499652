"""Training data: rows -> tokenizer -> token store on disk -> per-rank micro-batches.

    rows = load_texts(run.data)                              # sources.py: a datasets.Dataset
    tokenizer = train_tokenizer(rows, run.data)              # tokenizers.py (or load_tokenizer(directory))
    train, held_out = token_stores(rows, tokenizer, run.data, cache_dir=store_cache_dir())   # store.py
    sampler = BlockSampler(len(train), micro_batch=4, grad_accum=2, dp_size=2, dp_rank=0,
                           seed=run.data.seed)               # sampling.py
    for indices in sampler.micro_batches(consumed_samples=0):   # this rank's share of one step
        batch = train.micro_batch(indices)                   # ids; with chat data also labels, positions

Every row holds exactly `seq_len` tokens. For text every token is trained, so every micro-batch
has the same number of predicted tokens and the mean over micro-batches and ranks is the mean
over the global batch; for chat and prompt/completion data (examples.py: loss on assistant /
completion tokens only) each micro-batch carries the weight that makes its summed loss a share
of the mean over the trained tokens of the whole global batch. Either way ZeRO and gradient
accumulation are exact.

The data position is one number, the samples consumed so far; the global batch of a step is a
function of it alone (and the seed), whatever the data-parallel size, so a run resumes exactly.
"""
from dsframework.data.sampling import BlockSampler, eval_shard
from dsframework.data.sources import load_texts
from dsframework.data.store import IGNORE_INDEX, TokenStore, store_cache_dir, token_stores
from dsframework.data.tasks import BUILTIN_TASKS, generate_task
from dsframework.data.tokenizers import SPECIAL_TOKENS, load_tokenizer, train_tokenizer

__all__ = ["BUILTIN_TASKS", "IGNORE_INDEX", "SPECIAL_TOKENS", "BlockSampler", "TokenStore", "eval_shard",
           "generate_task", "load_texts", "load_tokenizer", "store_cache_dir", "token_stores", "train_tokenizer"]
