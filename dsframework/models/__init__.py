"""The model side: transformers models built, sharded and cut for a layout.

    from dsframework.models.build import build_model, resolve_model    # model.name -> config -> model
    from dsframework.models.presets import PRESETS                     # built-in configs
    from dsframework.models.hf import causal_lm_class, count_parameters
"""
