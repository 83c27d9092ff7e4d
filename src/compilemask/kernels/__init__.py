"""Attention kernels that read a :class:`~compilemask.MaskPlan`.

- :mod:`.reference`: plain PyTorch, chunked, float32 / float64 (the oracle);
- :mod:`.triton`: Triton kernels (Triton is imported only inside that package, lazily).
"""
