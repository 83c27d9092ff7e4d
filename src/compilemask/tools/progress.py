"""Progress bars: a thin wrapper over :mod:`tqdm` that stays quiet where nobody watches.

Bars are disabled when stderr is not a terminal (CI, pipes, files) or when the environment sets
``CM_NO_PROGRESS=1``.

Example::

    >>> from compilemask.tools.progress import progress
    >>> total = 0
    >>> for i in progress(range(3), desc="demo"):
    ...     total += i
    >>> total
    3
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def enabled() -> bool:
    """True when progress bars should show: stderr is a TTY and ``CM_NO_PROGRESS`` is not 1."""
    if os.environ.get("CM_NO_PROGRESS", "") == "1":
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress(items: Iterable[T], desc: str | None = None, total: int | None = None) -> Iterator[T]:
    """Iterate over ``items`` with a tqdm bar on stderr (or silently, see :func:`enabled`).

    Args:
        items: any iterable.
        desc: label printed before the bar.
        total: number of items, when ``len(items)`` is not available.

    Returns:
        An iterator over the same items.
    """
    return iter(tqdm(items, desc=desc, total=total, disable=not enabled(), leave=False))


def write(message: str) -> None:
    """Print a line to stdout without breaking an active bar."""
    tqdm.write(message, file=sys.stdout)
