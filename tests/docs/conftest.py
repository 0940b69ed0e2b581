"""The doc tests: helpers to read the docs live in docblocks.py, next to this file."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
