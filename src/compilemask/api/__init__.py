"""The public entry points that run attention over a compiled plan."""

from ..kernels import registry as _registry
from .functional import attention, explain

_registry.install_defaults()

__all__ = ["attention", "explain"]
