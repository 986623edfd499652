"""The one bridge between the installed DeepSpeed's AutoEP and the installed transformers.

    bridge_output_capture_registry()   # before deepspeed.initialize with expert_parallel on

DeepSpeed 0.19.8's AutoEP re-points transformers' router-logit recorders at its expert-parallel
block and saves/restores their registry entries as a plain dict keyed by class name:
`registry.get(key, default)` and `registry[key] = entry` (auto_ep_presets/base.py). transformers
5.24's `_CanRecordRegistry` (utils/output_capturing.py) is a dict whose `get(model)` takes one
argument and whose `__setitem__` keys by the *model's* class: AutoEP stops with
`TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given`, and its
restore would store entries under "<class 'str'>". The bridge makes both methods take either a
model (transformers' calls, unchanged) or a class-name key (AutoEP's), and applies only while the
installed transformers needs it (`registry_needs_bridge`); tests/unit/test_experts.py fails once
it no longer does, so the bridge can go.
"""
from __future__ import annotations

import inspect
from typing import Any

_NO_DEFAULT = object()


def _key(model_or_key: Any) -> str:
    return model_or_key if isinstance(model_or_key, str) else str(model_or_key.__class__)


def registry_needs_bridge() -> bool:
    """True while transformers' registry `get` takes no default (the call AutoEP makes)."""
    from transformers.utils.output_capturing import _CanRecordRegistry

    if getattr(_CanRecordRegistry.get, "dsf_bridge", False):
        return False
    return len(inspect.signature(_CanRecordRegistry.get).parameters) < 3


def bridge_output_capture_registry() -> bool:
    """Patch `_CanRecordRegistry.get` / `__setitem__` to take a key as well as a model (see the
    module docstring); True when it patched. Idempotent."""
    from transformers.utils.output_capturing import _CanRecordRegistry

    if not registry_needs_bridge():
        return False

    def get(self: dict, model_or_key: Any, default: Any = _NO_DEFAULT) -> Any:
        if default is _NO_DEFAULT:  # transformers' own call: `{}` when the class recorded nothing
            return dict.get(self, _key(model_or_key)) or {}
        return dict.get(self, _key(model_or_key), default)

    def setitem(self: dict, model_or_key: Any, value: Any) -> None:
        dict.__setitem__(self, _key(model_or_key), value)

    get.dsf_bridge = True
    # setattr: a patch of the class, whose methods now take a class-name key as well as transformers' model
    setattr(_CanRecordRegistry, "get", get)
    setattr(_CanRecordRegistry, "__setitem__", setitem)
    return True
