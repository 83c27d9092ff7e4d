"""Integrations of CompileMask with other libraries, each importing its library lazily.

- :mod:`compilemask.integrations.huggingface`: ``attn_implementation="compilemask"`` for
  transformers models (the mask travels as a ``compilemask_plan=`` keyword of the model call).
"""
