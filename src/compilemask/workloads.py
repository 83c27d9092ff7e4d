"""The four seed workloads of ``docs/workloads.md``, built exactly as defined there.

Every call of one batch row holds about 32K tokens: at nominal size ``N0`` a workload has
``B = 32768 // N0`` rows of ``N`` tokens each (``N = N0`` except for ``clear``, whose FLUX token
counts are ``512 + h * w``). Every batch row has the same mask, so one plan broadcasts over ``B``.

Random choices use one generator per (workload, size), ``torch.Generator().manual_seed(0)``,
created once and consumed in order (user after user for ``hstu``, group after group for
``shared_prompt``).

Example::

    >>> from compilemask.workloads import workload
    >>> w = workload("hstu", 4096)
    >>> (w.N, w.B)
    (4096, 8)
    >>> str(workload("causal", 1024).mask)
    'causal()'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import masks
from .errors import CompileMaskError
from .language.ast import Mask

SEED_WORKLOADS = ("causal", "hstu", "shared_prompt", "clear")
NOMINAL_SIZES = (1024, 4096, 16384, 32768)

TOKENS_PER_CALL = 32768
HSTU_MAX_USER_TOK = 4096
HSTU_MAX_TARGETS = 256
HSTU_CONTEXTUAL = 6
SHARED_PROMPT_MAX_GROUP_TOK = 16384
CLEAR_TEXT_TOK = 512
CLEAR_RADIUS = 16
CLEAR_GRIDS = {1024: (16, 32), 4096: (64, 64), 16384: (128, 128), 32768: (128, 256)}


@dataclass(frozen=True)
class Workload:
    """One seed workload at one nominal size.

    Attributes:
        name: one of :data:`SEED_WORKLOADS`.
        N0: nominal size (one of :data:`NOMINAL_SIZES`).
        N: real tokens per batch row (``q_len == kv_len == N``).
        B: batch rows, ``32768 // N0``; every row has the same mask.
        mask: the mask of one row.
    """

    name: str
    N0: int
    N: int
    B: int
    mask: Mask


def batch_for(N0: int) -> int:
    """Batch rows at nominal size ``N0``: ``32768 // N0`` (32, 8, 2, 1)."""
    _check_size(N0)
    return TOKENS_PER_CALL // N0


def workload(name: str, N0: int = 4096, seed: int = 0) -> Workload:
    """Build seed workload ``name`` at nominal size ``N0``.

    Args:
        name: one of ``"causal"``, ``"hstu"``, ``"shared_prompt"``, ``"clear"``.
        N0: nominal size, one of 1024, 4096, 16384, 32768.
        seed: the generator's seed for the random draws (hstu users, shared_prompt
            responses); 0 is the workload of ``docs/workloads.md``. causal and clear draw
            nothing.

    Returns:
        A :class:`Workload`; the same arguments always give the same mask.

    Raises:
        CompileMaskError: unknown ``name`` or ``N0`` (the message lists the choices).

    Example::

        >>> workload("clear", 1024).N
        1024
    """
    if name not in SEED_WORKLOADS:
        raise CompileMaskError(
            f"unknown workload {name!r}; choose one of {', '.join(SEED_WORKLOADS)}"
        )
    B = batch_for(N0)
    if name == "clear":
        h, w = CLEAR_GRIDS[N0]
        mask = masks.clear((h, w), CLEAR_RADIUS, CLEAR_TEXT_TOK)
        return Workload(name, N0, CLEAR_TEXT_TOK + h * w, B, mask)
    N = N0
    g = torch.Generator().manual_seed(seed)
    if name == "causal":
        mask = masks.causal()
    elif name == "hstu":
        lengths, targets = hstu_users(N, g)
        mask = masks.hstu(lengths, targets, contextual=HSTU_CONTEXTUAL)
    else:
        prompts, responses = shared_prompt_groups(N, g)
        if len(prompts) == 1:
            mask = masks.shared_prompt(prompts[0], responses[0])
        else:
            mask = masks.shared_prompt(prompts, responses)
    return Workload(name, N0, N, B, mask)


def hstu_users(N: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """User lengths and target counts of one ``hstu`` row of ``N`` tokens (consumes ``g``).

    ``cap = min(N, 4096)``; users of ``L = randint(cap // 2, cap + 1)`` tokens are packed until
    the row is full (the last one is cut to fit); each user has ``T = min(256, max(1, L // 8))``
    targets at its end.
    """
    cap = min(N, HSTU_MAX_USER_TOK)
    lengths: list[int] = []
    targets: list[int] = []
    pos = 0
    while pos < N:
        L = int(torch.randint(cap // 2, cap + 1, (1,), generator=g))
        L = min(L, N - pos)
        T = min(HSTU_MAX_TARGETS, max(1, L // 8))
        if T >= L:  # a 1-token user would be all target and no history; the rule has no answer
            raise CompileMaskError(
                f"hstu: user {len(lengths)} has length {L}, too short for {T} target(s)"
            )
        lengths.append(L)
        targets.append(T)
        pos += L
    return lengths, targets


def shared_prompt_params(G: int) -> tuple[int, int]:
    """Prompt length ``P`` and response count ``K`` of a group of ``G`` tokens."""
    if G == 1024:
        return 384, 2
    if G == 4096:
        return 1024, 4
    return G // 8, 8


def shared_prompt_groups(N: int, g: torch.Generator) -> tuple[list[int], list[list[int]]]:
    """Prompt lengths and response lengths per group of one ``shared_prompt`` row (consumes ``g``).

    Groups of ``G = min(N, 16384)`` tokens ``[P | R1 .. RK]``; per group
    ``w = 1 + 0.6 * (rand(K) - 0.5)``, ``r = floor(w / w.sum() * (G - P))`` in float32, and the
    last response takes the remainder.
    """
    G = min(N, SHARED_PROMPT_MAX_GROUP_TOK)
    if N % G:
        raise CompileMaskError(f"shared_prompt: N = {N} is not a multiple of the group size {G}")
    P, K = shared_prompt_params(G)
    prompts: list[int] = []
    responses: list[list[int]] = []
    for _ in range(N // G):
        w = 1 + 0.6 * (torch.rand(K, generator=g) - 0.5)
        r = torch.floor(w / w.sum() * (G - P)).to(torch.int64).tolist()
        r[-1] = G - P - sum(r[:-1])
        prompts.append(P)
        responses.append(r)
    return prompts, responses


def _check_size(N0: int) -> None:
    if isinstance(N0, bool) or not isinstance(N0, int) or N0 not in NOMINAL_SIZES:
        raise CompileMaskError(
            f"unknown nominal size {N0!r}; choose one of {', '.join(map(str, NOMINAL_SIZES))}"
        )
