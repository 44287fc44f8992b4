"""``python -m kvcore demo|bench``: see kvcore/cli."""
import sys

from kvcore.cli import main

if __name__ == "__main__":
    sys.exit(main())
