"""The reference backend: masked attention in plain PyTorch (the correctness oracle).

- :mod:`.kernel`: :func:`reference_attention` and :func:`reference_attention_backward`;
- :mod:`.backend`: the backend object of ``kernels/interface.py`` (``backend="reference"``).
"""

from .kernel import reference_attention, reference_attention_backward

__all__ = ["reference_attention", "reference_attention_backward"]
