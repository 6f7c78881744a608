"""``python -m qkv`` (also what ``torchrun -m qkv`` runs)."""

import sys

from qkv.apps.cli import main

sys.exit(main())
