"""What a mixture of experts' router does during training, logged with each window's metrics.

    load = ExpertLoad.attach(engine.module, config)   # None for a dense model
    load.read()    # {'aux_loss': 0.0123, 'expert_load_cv': 0.41, 'expert_load_max_share': 0.38}

A forward hook on the model reads what transformers' CausalLM forward returns with
`output_router_logits` (dsf turns it on for training: models/experts.py): `aux_loss`, the router's
load-balancing loss (already in the trained loss, times router_aux_loss_coef), and `router_logits`,
one [tokens, experts] tensor per MoE layer, whose top_k experts per token are the ones it went to.
Training forwards only (not evaluation). At `read`, summed over the window's forwards and all ranks:

- aux_loss: the mean load-balancing loss of the window's forwards (without the coefficient);
- expert_load_cv: the coefficient of variation (std / mean) of tokens per expert, over every
  (layer, expert) pair: 0 when each expert of each layer gets the same share;
- expert_load_max_share: the busiest expert's share of its layer's routed tokens (1 / experts is
  perfect balance, 1.0 one expert taking everything).
"""
from __future__ import annotations

from typing import Any

from dsframework.models.experts import expert_layout
from dsframework.parallel.host import all_reduce_host
from dsframework.types import HFConfig


class ExpertLoad:
    def __init__(self, experts: int, top_k: int) -> None:
        self.experts, self.top_k = experts, top_k
        self._reset()

    @classmethod
    def attach(cls, model: Any, config: HFConfig) -> "ExpertLoad | None":
        moe = expert_layout(config)
        if moe is None or not getattr(config, "output_router_logits", False):
            return None
        load = cls(moe.experts, moe.top_k)
        model.register_forward_hook(load._after_forward)
        return load

    def _reset(self) -> None:
        self.aux_sum, self.forwards, self.counts = 0.0, 0, None

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        import torch

        if not module.training:
            return
        aux, logits = getattr(output, "aux_loss", None), getattr(output, "router_logits", None)
        if aux is not None:  # a tensor until `read`: no host synchronisation per forward on a GPU
            self.aux_sum = self.aux_sum + aux.detach().double()
            self.forwards += 1
        if logits is not None and len(logits):
            with torch.no_grad():
                counts = torch.stack([self._chosen(layer.detach()) for layer in logits])
            self.counts = counts if self.counts is None else self.counts + counts

    def _chosen(self, logits: Any) -> Any:
        """Tokens per expert of one layer's router logits [tokens, experts (or more)], on their device.
        Added into a fixed number of bins: bincount's output size depends on the data, which a GPU
        must read back first. A column past `experts` (a zero expert, say) falls in a last bin, dropped."""
        import torch

        chosen = logits.topk(self.top_k, dim=-1).indices.flatten().clamp(max=self.experts)
        bins = torch.zeros(self.experts + 1, dtype=torch.long, device=logits.device)
        return bins.scatter_add_(0, chosen, torch.ones_like(chosen)).narrow(0, 0, self.experts)

    def read(self) -> dict[str, float]:
        """The window's figures over all ranks (a collective: every rank calls it), then a new window."""
        import torch
        import torch.distributed as dist

        # host: read back once per window, summed on the host group (a gloo group beside NCCL)
        counts = (self.counts.cpu() if self.counts is not None
                  else torch.zeros(1, self.experts, dtype=torch.long))  # host: no forward, nothing counted
        aux_sum = torch.as_tensor(self.aux_sum, dtype=torch.float64).reshape(1).cpu()  # host: read back
        forwards = torch.tensor([float(self.forwards)], dtype=torch.float64)  # host: a Python count
        totals = torch.cat([aux_sum, forwards, counts.flatten().double()])
        if dist.is_initialized():
            all_reduce_host(totals)
        aux_sum, forwards, counts = totals[0].item(), totals[1].item(), totals[2:].view(-1, self.experts)
        self._reset()
        out: dict[str, float] = {}
        if forwards:
            out["aux_loss"] = aux_sum / forwards
        if counts.sum() > 0:
            out["expert_load_cv"] = (counts.std(unbiased=False) / counts.mean()).item()
            out["expert_load_max_share"] = (counts.max(dim=1).values / counts.sum(dim=1).clamp(min=1)).max().item()
        return out
