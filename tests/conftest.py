"""Fixtures shared by every test."""

from __future__ import annotations

import pytest

from tileops.core.registry import journal


@pytest.fixture
def scoped_registry():
    """Registrations made inside the test are undone after it, as a failed backend's are."""
    journal.open()
    try:
        yield
    finally:
        journal.close(undo=True)
