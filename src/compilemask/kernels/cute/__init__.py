"""CuTe-DSL attention kernels (``backend="cute"``).

Modules: ``lower`` (a plan lowered to the kernel's work list and tile lists; torch only),
``backend`` (the backend object; imports ``cutlass`` lazily), ``forward_sm90`` (the
warp-specialised Hopper forward; imports ``cutlass``). Importing this package does not
import ``cutlass``.
"""
