"""cuDNN-frontend interval attention (``cudnn.flex_attention``) behind the backend interface.

- :mod:`.lower`: plan -> cuDNN's per-row key endpoints (pure torch, no cuDNN import);
- :mod:`.backend`: :class:`CudnnBackend` (imports ``cudnn`` lazily, inside its methods).
"""

from .backend import CudnnBackend
from .lower import endpoints

__all__ = ["CudnnBackend", "endpoints"]
