"""Fixtures of the end-to-end suite; the stack itself is refund_stack.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from refund_stack import StartStack, stack_starter


@pytest.fixture
def stack(tmp_path: Path) -> StartStack:
    """stack(mcp=None, vars=(), **settings): see `refund_stack.stack_starter`."""
    return stack_starter(tmp_path)
