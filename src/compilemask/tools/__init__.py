"""Tools on top of the library: the ``compilemask`` CLI (:mod:`.cli`), pictures of masks and
their tiles (:mod:`.visualize`) and progress bars (:mod:`.progress`). Nothing below imports
from here."""
