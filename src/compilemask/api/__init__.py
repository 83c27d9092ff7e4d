"""The public entry points that run attention over a compiled plan."""

from .functional import attention

__all__ = ["attention"]
