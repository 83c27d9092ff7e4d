"""Context parallelism: one masked sequence over several ranks of ``torch.distributed``,
balanced by the plan's visible pairs and fetching exactly the key chunks each rank's rows see
(docs/context-parallel.md).

- :func:`balance`: token chunks -> ranks, a :class:`ShardMap` (``shard``, ``unshard``,
  ``report``);
- :func:`attention`: forward and backward of every rank's rows (a ``torch.autograd.Function``);
- :func:`gather`: every rank's shard back into the whole sequence.

Example (every rank, after ``torch.distributed.init_process_group``)::

    >>> shard = balance(plan, dist.get_world_size())
    >>> q_r, k_r, v_r = (shard.shard(t, dist.get_rank()) for t in (q, k, v))
    >>> out_r = attention(q_r, k_r, v_r, shard)
"""

from .attention import attention, gather
from .balance import ShardMap, balance, default_chunk

__all__ = ["ShardMap", "attention", "balance", "default_chunk", "gather"]
