"""`python -m oomdoc` is the same as the `oomdoc` console script."""

from oomdoc.cli import main

if __name__ == "__main__":
    main()
