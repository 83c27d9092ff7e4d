"""The region language: IR (:mod:`.ast`), text syntax (:mod:`.parser`, :mod:`.printer`) and the
dense evaluator that is the specification (:mod:`.semantics`)."""
