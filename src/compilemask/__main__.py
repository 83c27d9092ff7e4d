"""``python -m compilemask``: the command line of :mod:`compilemask.tools.cli`."""

from compilemask.tools.cli import main

if __name__ == "__main__":
    main()
