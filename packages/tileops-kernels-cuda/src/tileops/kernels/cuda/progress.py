"""The one-line progress bar on stderr that work taking seconds on a kernel's first use draws
(tuning compiles and times one kernel per candidate), ending with what came of it."""

from __future__ import annotations

import sys
import threading

# How many bars are drawn now; while one is, the per-kernel build lines stay quiet (``compile``).
_drawn = 0
_drawn_lock = threading.Lock()


def drawing() -> bool:
    """Whether a progress bar is being drawn on stderr now."""
    return _drawn > 0


class Progress:
    """``tuning <what> [####....] done/total  best 1.23 us``, redrawn in place on stderr."""

    _WIDTH = 24

    def __init__(self, what: str, total: int) -> None:
        global _drawn
        self.what, self.total, self.done = what, total, 0
        with _drawn_lock:
            _drawn += 1
        self._draw(None)

    def advance(self, best_us: float | None) -> None:
        """One more step done; ``best_us``: the best time so far, None before any."""
        self.done += 1
        self._draw(best_us)

    def _draw(self, best_us: float | None) -> None:
        filled = self._WIDTH * self.done // self.total
        best = "" if best_us is None else f"  best {best_us:.2f} us"
        sys.stderr.write(f"\rtuning {self.what} [{'#' * filled}{'.' * (self._WIDTH - filled)}] "
                         f"{self.done}/{self.total}{best}")
        sys.stderr.flush()

    def finish(self, outcome: str) -> None:
        """Replace the bar by ``tuning <what>: <outcome>`` and end the line."""
        global _drawn
        with _drawn_lock:
            _drawn -= 1
        sys.stderr.write(f"\rtuning {self.what}: {outcome}\n")
        sys.stderr.flush()
