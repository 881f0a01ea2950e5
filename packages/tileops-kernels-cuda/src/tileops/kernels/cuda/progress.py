"""The one-line progress bar on stderr that work taking seconds on a kernel's first use draws
(tuning compiles and times one kernel per candidate), ending with what came of it."""

from __future__ import annotations

import sys


class Progress:
    """``tuning <what> [####....] done/total  best 1.23 us``, redrawn in place on stderr."""

    _WIDTH = 24

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done = what, total, 0
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
        sys.stderr.write(f"\rtuning {self.what}: {outcome}\n")
        sys.stderr.flush()
