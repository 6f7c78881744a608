"""Attention benchmark table: qkv backends vs torch SDPA. See :mod:`qkv.apps.bench`.

Usage: ``python benchmarks/attention.py [--quick] [--repeats N] [--device cuda] [--threads N]``
(the options of ``qkv bench``, which this script runs).
"""

import sys

from qkv.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
