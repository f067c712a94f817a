"""Prints its sys.argv as JSON so tests can see exactly what reached it."""

import json
import sys

print("ARGV=" + json.dumps(sys.argv))
print("NAME=" + __name__)
