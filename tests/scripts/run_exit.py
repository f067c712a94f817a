"""Exits with the status given as its first argument (for exit-code tests)."""

import sys

sys.exit(int(sys.argv[1]))
