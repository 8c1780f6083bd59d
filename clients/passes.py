"""Which iteration of a loader takes its batches: DataLoader's contract on a loader
whose position (epoch, cursor) is one for all its iterators.

Each ``iter(loader)`` is a pass of its own, and begins when its first batch is asked
for. A pass that begins while an earlier one has taken batches of the epoch it stands
in, and has not finished it, starts that epoch again from where the earlier pass
began (the start of the epoch, or a resumed cursor), as a DataLoader's new iterator
would: a peek with ``next(iter(loader))`` before the loop, or a framework's sanity
check of two validation batches, does not shorten the epoch. The batches served again
are said in one log line; the earlier iterator ends (``RuntimeError`` if it is asked
for another batch). An explicit move (``set_epoch`` to another epoch,
``load_state_dict``) leaves the unfinished pass where it stands instead.

Once a pass has handed out its epoch's last batch the loader stays at that epoch's end
(``epoch`` still names it, and a state saved then resumes after it) until the pass is
asked for another (``StopIteration``, as a ``for`` loop does), ``set_epoch`` names the
next epoch, or a next pass begins: then it stands in the next epoch. So a loop that
takes exactly ``len(loader)`` batches and never asks for another, as Lightning's does,
gets a full epoch every time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Passes"]

log = logging.getLogger(__name__)


class Passes:
    """The passes of one loader (see the module's docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held while a batch is being taken
        self._current = 0  # the pass that may take batches (0: none began yet)
        self._origin: tuple[int, int] | None = None  # where the current pass began; None: it has nothing to undo
        self._taken = 0  # batches the current pass has handed out
        self.restarts = 0  # passes that started their epoch again

    def begin(self, where: tuple[int, int], name: str) -> tuple[int, tuple[int, int] | None]:
        """A pass begins with the loader at ``where`` (epoch, cursor); returns its number
        and the position to go back to first (an unfinished pass's start), or None."""
        with self._lock:
            back = self._origin if self._taken and self._origin is not None and self._origin[0] == where[0] else None
            if back is not None:
                self.restarts += 1
                log.warning("%s: a new pass began after %d batches of an unfinished one; epoch %d starts again at "
                            "sample %d (those batches come again, as with a DataLoader's new iterator)",
                            name, self._taken, back[0], back[1])
            self._current += 1
            self._origin, self._taken = back or where, 0
            return self._current, back

    @contextmanager
    def taking(self, number: int, name: str) -> Iterator[None]:
        """Pass ``number`` takes a batch (``handed`` it out when the block ends).

        Raises:
            RuntimeError: a later pass began, or another thread is taking a batch of
                this loader now.
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{name} is being iterated by another thread; one pass at a time: give each thread "
                               f"its own loader")
        try:
            if number != self._current:
                raise RuntimeError(f"{name}: this iterator ended when a new pass began (iter() was called again)")
            yield
        finally:
            self._lock.release()

    def current(self, number: int) -> bool:
        """Pass ``number`` is the latest to begin."""
        return number == self._current

    def handed(self) -> None:
        """The current pass handed out a batch (call inside :meth:`taking`)."""
        self._taken += 1

    def finished(self, where: tuple[int, int]) -> None:
        """The current pass handed out its epoch's last batch (or the loader went on to
        the next epoch): a next pass begins at ``where`` with nothing to undo."""
        self._origin, self._taken = where, 0

    def moved(self, where: tuple[int, int]) -> None:
        """The loader was moved to ``where`` explicitly: an unfinished pass is left as it stands."""
        with self._lock:
            self._origin, self._taken = where, 0
