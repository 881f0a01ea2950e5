"""The ``tileops`` command: what TileOPs will do on this machine, and why."""

from .main import main

__all__ = ["main"]
