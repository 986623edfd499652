"""Placeholder until the logits branch lands: the model's own logit post-processing."""
from __future__ import annotations

from typing import Any


def logit_postprocess(lm: Any) -> Any:
    return None


def processed_head(lm: Any, head: Any = None) -> Any:
    return lm.get_output_embeddings() if head is None else head
