"""Attention benchmark table: qkv backends vs torch SDPA. See :mod:`qkv.apps.bench`.

Usage: ``python benchmarks/attention.py [--quick] [--repeats N] [--device cuda] [--threads N]``
"""

import sys

from qkv.apps.bench import main

if __name__ == "__main__":
    sys.exit(main())
