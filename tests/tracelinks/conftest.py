"""Fixtures for the trace links tests; the helpers live in tracelinks_support.py, next to this
file."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tracelinks_support import json_log, spans, stepguard

__all__ = ["json_log", "spans", "stepguard"]
