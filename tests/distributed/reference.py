"""A single-process, plain PyTorch reference for a dsf run: same weights, batches and optimizer.

    want = reference_losses(run)      # step -> loss, to compare with a distributed run's metrics
    losses, model = reference_train(run)   # ... and the trained model

It shares with dsf only what defines the problem (the data blocks and their order, the initial
weights, the tokenizer the run saved); the training step is torch's own: AdamW, clip_grad_norm_,
and DeepSpeed's lr-schedule class driven by hand, as DeepSpeed's engine drives it.
"""
from __future__ import annotations

import torch
from deepspeed.runtime import lr_schedules

from dsframework.config import RunConfig
from dsframework.data import IGNORE_INDEX, BlockSampler, load_texts, load_tokenizer, store_cache_dir, token_stores
from tests.packing_reference import pack_splits  # the blocks as packed in memory: the store must match them
from dsframework.dsconfig import build_ds_config, resolve_batch
from dsframework.models.build import build_model, resolve_model


def reference_losses(run: RunConfig, *, steps: int | None = None, dp: int | None = None) -> dict[int, float]:
    return reference_train(run, steps=steps, dp=dp)[0]


def reference_train(run: RunConfig, *, steps: int | None = None,
                    dp: int | None = None) -> tuple[dict[int, float], torch.nn.Module]:
    """(step -> loss, the trained model) of the plain PyTorch loop. With `dp`, each step's loss is
    the mean of the model's losses on the micro-batches `dp` data ranks see (BlockSampler's split),
    not its loss on the whole global batch: the same for a mean over tokens, not for a mixture of
    experts' load-balancing loss, which transformers computes per forward."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(run.checkpoint_dir / "tokenizer")
    supervised = run.data.format != "text"
    if supervised:  # the rows and masks the run trained on (their making is checked in tests/unit/test_sft.py)
        train_blocks, _ = token_stores(load_texts(run.data), tokenizer, run.data, cache_dir=store_cache_dir())
    else:
        train_blocks, _ = pack_splits(load_texts(run.data), tokenizer, run.data)
    source = resolve_model(run.model)
    model = build_model(source, source.config_for(tokenizer), seed=run.train.seed)
    model.train()
    t = run.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps,
                                  weight_decay=t.weight_decay)
    assert t.global_batch, "the reference needs train.global_batch"
    global_batch = t.global_batch  # one process: the whole global batch in one forward
    one_process = t.model_copy(update={"micro_batch": None, "grad_accum": None})
    sched_cfg = build_ds_config(one_process, run.parallel, dp_size=1)["scheduler"]
    scheduler = getattr(lr_schedules, sched_cfg["type"])(optimizer, **sched_cfg["params"])
    sampler = BlockSampler(len(train_blocks), micro_batch=global_batch, grad_accum=1, dp_size=1,
                           dp_rank=0, seed=run.data.seed)
    out = {}
    for step in range(1, (steps or t.steps) + 1):
        indices = sampler.global_indices((step - 1) * global_batch)
        if supervised:
            loss = _mean_over_trained_tokens(model, train_blocks, indices)
        elif dp is not None:
            loss = _mean_over_micro_batches(model, train_blocks, run, dp=dp, consumed=(step - 1) * global_batch)
        else:
            input_ids = train_blocks[indices]
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        out[step] = loss.item()
    return out, model


def _mean_over_micro_batches(model: torch.nn.Module, store, run: RunConfig, *, dp: int, consumed: int) -> torch.Tensor:
    """The mean of the model's own losses on every data rank's micro-batches of one step."""
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=dp)
    losses = []
    for rank in range(dp):
        sampler = BlockSampler(len(store), micro_batch=batch.micro_batch, grad_accum=batch.grad_accum, dp_size=dp,
                               dp_rank=rank, seed=run.data.seed)
        for indices in sampler.micro_batches(consumed):
            input_ids = store[indices]
            losses.append(model(input_ids=input_ids, labels=input_ids).loss)
    return torch.stack(losses).mean()


def reference_router_figures(run: RunConfig, *, dp: int, top_k: int, experts: int) -> dict[str, float]:
    """A mixture of experts' step-1 router figures in one process, from transformers' own outputs:
    the mean aux_loss of the ranks' micro-batch forwards, and the CV and busiest share of tokens per
    (layer, expert) from router_logits' top_k (what train/expert_load.py logs)."""
    tokenizer = load_tokenizer(run.checkpoint_dir / "tokenizer")
    train_blocks, _ = pack_splits(load_texts(run.data), tokenizer, run.data)
    source = resolve_model(run.model)
    model = build_model(source, source.config_for(tokenizer), seed=run.train.seed).train()
    batch = resolve_batch(run.train.micro_batch, run.train.grad_accum, run.train.global_batch, dp_size=dp)
    aux, counts = [], torch.zeros(experts, dtype=torch.float64)
    with torch.no_grad():
        for rank in range(dp):
            sampler = BlockSampler(len(train_blocks), micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
                                   dp_size=dp, dp_rank=rank, seed=run.data.seed)
            for indices in sampler.micro_batches(0):
                out = model(input_ids=train_blocks[indices], labels=train_blocks[indices])
                aux.append(out.aux_loss.item())
                layers = torch.stack([torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=experts)
                                      for logits in out.router_logits]).double()
                counts = layers if counts.dim() == 1 else counts + layers
    return {"aux_loss": sum(aux) / len(aux), "expert_load_cv": (counts.std(unbiased=False) / counts.mean()).item(),
            "expert_load_max_share": (counts.max(dim=1).values / counts.sum(dim=1)).max().item()}


def _mean_over_trained_tokens(model: torch.nn.Module, store, indices: list[int]) -> torch.Tensor:
    """The global batch's loss by hand: cross-entropy of every trained label, summed, over their count."""
    batch = store.micro_batch(indices, weight=None)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["labels"][:, 1:]
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                                  ignore_index=IGNORE_INDEX, reduction="sum")
    return per_token / (labels != IGNORE_INDEX).sum()


def assert_export_matches(run_dir, reference_model, *, rtol: float = 1e-4) -> None:
    """`dsf export RUN_DIR/checkpoints RUN_DIR/hf`, loaded with from_pretrained, gives the
    reference model's logits (max difference within `rtol` of the largest logit)."""
    from transformers import AutoModelForCausalLM

    from tests.distributed.launcher import dsf

    dsf("export", str(run_dir / "checkpoints"), str(run_dir / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True).eval()
    input_ids = torch.arange(32).remainder(exported.config.vocab_size).view(2, 16)
    with torch.no_grad():
        got, want = exported(input_ids=input_ids).logits, reference_model.eval()(input_ids=input_ids).logits
    assert (got - want).abs().max().item() < rtol * want.abs().max().item()
