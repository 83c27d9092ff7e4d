"""The public entry points that run attention over a compiled plan."""

from .device_builder import install_default as _install_default_tile_builder
from .functional import attention

_install_default_tile_builder()

__all__ = ["attention"]
