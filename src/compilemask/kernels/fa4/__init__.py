"""FlashAttention-4's block-sparse kernels (``flash_attn.cute``) behind the backend interface.

- :mod:`.lower`: plan -> block lists and tile bitmasks (pure torch, no FlashAttention import);
- :mod:`.mask_mod`: the CuTe ``mask_mod`` reading those bitmasks;
- :mod:`.backend`: :class:`Fa4Backend` (imports ``flash_attn`` lazily, inside its methods).
"""

from .backend import Fa4Backend
from .lower import lower

__all__ = ["Fa4Backend", "lower"]
