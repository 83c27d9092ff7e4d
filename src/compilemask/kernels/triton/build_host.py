"""The host side of the tile builder's launch on a GPU: Triton launches through the compiled
launcher, and host tables copied to the device through one pinned buffer.

On an H200 host a plan build is host-bound (``docs/perf-notes.md``, "Plan building"): the
device work of a 32K build is one launch of about 0.1 ms, the host's Python about 0.15 ms.
Two pieces of that are here:

- :func:`launch`: ``kernel[grid](...)`` (Triton's ``JITFunction.run``) binds and specialises
  every argument and builds launch metadata on every call, about 17 us of host time, against
  6 us for the compiled kernel's launcher called directly. The first launch of a
  specialisation goes through Triton (which compiles it if need be); later ones call the
  launcher it returned.
- :class:`Staging`: a host table reaches the device by a non-blocking copy from pinned memory
  (from pageable memory the copy would wait for the device). Pinning a new tensor per table
  asks the host allocator for a block every build; the tables instead go through one pinned
  buffer per device, used as a ring whose quarters are reused once the copies out of them
  are done (a CUDA event per quarter and stream, recorded when the ring leaves it).
"""

from __future__ import annotations

import threading

import torch
import triton

# (kernel, current device, specialisation, constants) -> (launcher, function, metadata)
_LAUNCHERS: dict[tuple, tuple] = {}


def launch_hooks() -> bool:
    """Whether a Triton launch hook is set (then every launch goes through Triton's own path,
    which calls it)."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:  # a Triton without knobs: taken as hooked (its own launch path)
        return True
    hooks = (getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None))
    return any(getattr(h, "calls", h) for h in hooks)


def launch(kernel, grid: tuple, device: torch.device, values: tuple, consts: tuple) -> None:
    """``kernel[grid](*values, **dict(consts))``: ``values`` its runtime arguments (tensors and
    ints below 2**63), ``consts`` its ``(name, value)`` constants in the kernel's parameter
    order, after the runtime ones. On a CUDA device without launch hooks, the first launch of
    a specialisation goes through Triton and keeps the compiled kernel's launcher; later ones
    call it with what Triton passes. The key is at least as fine as Triton's specialisation:
    each tensor's 16-byte alignment, each int's value 1, divisibility by 16 and width."""
    if device.type != "cuda" or launch_hooks():
        kernel[grid](*values, **dict(consts))
        return
    index = torch.cuda.current_device()
    key = (kernel, index, consts, *(
        v.data_ptr() % 16 == 0 if isinstance(v, torch.Tensor)
        else (v == 1) + 2 * (v % 16 == 0) + 4 * (v >= 1 << 31)
        for v in values
    ))  # fmt: skip
    hit = _LAUNCHERS.get(key)
    if hit is not None:
        run, function, metadata = hit
        stream = torch._C._cuda_getCurrentRawStream(index)
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
            function, metadata, None, None, None, *values, *(v for _, v in consts))  # fmt: skip
        return
    compiled = kernel[grid](*values, **dict(consts))
    try:
        _LAUNCHERS[key] = (compiled.run, compiled.function, compiled.packed_metadata)
    except AttributeError:  # another Triton: its own launch path every time
        pass


class Staging:
    """One pinned int32 buffer of ``words`` through which small host tables are copied to CUDA
    devices without blocking (:meth:`copy`). Used as a ring of four quarters: when the ring
    moves on to a quarter, it records an event on every stream that copied out of the quarter
    it leaves, and enters the next only when the events recorded there a round before have
    completed (else :meth:`copy` declines and the caller pins its table itself)."""

    QUARTERS = 4

    def __init__(self, words: int):
        self.buf = torch.empty(words, dtype=torch.int32, pin_memory=True)
        self.host = self.buf.numpy()
        self.quarter = words // self.QUARTERS
        self.cursor = 0
        self.events: list[list] = [[] for _ in range(self.QUARTERS)]
        self.streams: list[dict] = [{} for _ in range(self.QUARTERS)]
        self.lock = threading.Lock()

    def copy(self, dst: torch.Tensor, table: torch.Tensor) -> bool:
        """``dst.copy_(table)`` (``dst`` on a CUDA device, ``table`` int32 1-D on the host)
        through the ring, without blocking; False (nothing done) where the ring cannot take
        it now: too long, or its next quarter still being read. Under the ring's lock up to
        the copy's issue, so that the event recorded when the ring leaves a quarter follows
        every copy out of it."""
        n = table.shape[0]
        if n > self.quarter:
            return False
        index = dst.device.index
        stream = torch._C._cuda_getCurrentRawStream(index)  # the stream the copy runs on
        with self.lock:
            at, q = self.cursor, self.cursor // self.quarter
            if at + n > (q + 1) * self.quarter:  # past this quarter: move on to the next
                q = self._move_on(q)
                if q is None:
                    return False
                at = q * self.quarter
            self.cursor = at + n
            self.streams[q][(index, stream)] = True
            self.host[at : at + n] = table.numpy()
            dst.copy_(self.buf[at : at + n], non_blocking=True)
        return True

    def _move_on(self, q: int) -> int | None:
        """Leave quarter ``q`` (events on the streams that copied out of it) and enter the
        next if its events of a round before have completed; its index, else None."""
        nxt = (q + 1) % self.QUARTERS
        if not all(e.query() for e in self.events[nxt]):
            return None
        left = []
        for index, stream in self.streams[q]:
            event = torch.cuda.Event()
            event.record(torch.cuda.ExternalStream(stream, device=index))
            left.append(event)
        self.events[q], self.streams[q] = left, {}
        self.events[nxt] = []
        return nxt


_STAGING: list = []
_STAGING_LOCK = threading.Lock()
#: words of the pinned ring (256 KiB; a seed's table at 32K is at most a few hundred words)
STAGING_WORDS = 1 << 16


def staging() -> Staging:
    """The process's :class:`Staging` ring, made on first use."""
    if not _STAGING:
        with _STAGING_LOCK:
            if not _STAGING:
                _STAGING.append(Staging(STAGING_WORDS))
    return _STAGING[0]


def upload(dst: torch.Tensor, table: torch.Tensor) -> None:
    """``dst.copy_(table)`` without blocking the host: ``table`` (int32, 1-D, on the host)
    through the pinned ring on a CUDA device (pinned by itself where the ring cannot take it),
    directly elsewhere."""
    if dst.device.type != "cuda":
        dst.copy_(table)
        return
    if not staging().copy(dst, table):
        dst.copy_(table.pin_memory(), non_blocking=True)
