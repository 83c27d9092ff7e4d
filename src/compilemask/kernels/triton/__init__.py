"""Triton attention kernels over a plan's tile schedule.

Modules: ``configs`` (tile sizes per head_dim; no Triton import), ``schedule`` (kernel-ready
schedule tensors; no Triton import), ``common`` (masking helpers shared by forward and
backward), ``forward`` (FlashAttention-2 style forward). Importing this package does not
import Triton; ``common`` and ``forward`` do.
"""
