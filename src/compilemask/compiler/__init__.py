"""The compiler: mask IR -> exact row intervals -> column intervals and tile schedule ->
MaskPlan."""
