"""The doctor's tests share their seeded-bug and tiny Hugging Face models as plain modules."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
