"""Model presets, resolution of `model.name`, and construction (ZeRO-3 aware).

    from dsframework.models import PRESETS, resolve_model, build_model
"""
from dsframework.models.build import (ModelSource, build_model, causal_lm_class, count_parameters,
                                      init_weights_deterministically, resolve_model)
from dsframework.models.presets import PRESETS

__all__ = ["PRESETS", "ModelSource", "build_model", "causal_lm_class", "count_parameters",
           "init_weights_deterministically", "resolve_model"]
