"""Fixtures shared by every test."""

from __future__ import annotations

import pytest

from tileops.core.discovery import load_backends
from tileops.core.registry import journal


@pytest.fixture
def scoped_registry():
    """Registrations made inside the test are undone after it, as a failed backend's are."""
    load_backends()  # installed backends stay registered: they load outside the test's scope
    journal.open()
    try:
        yield
    finally:
        journal.close(undo=True)
