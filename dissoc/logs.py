"""Logging what peers can make happen at will, without letting them fill the log.

A hostile peer can repeat a failure (a bad frame, a refused request, a failed stream) as fast as it likes;
:class:`RateLimitedLog` writes at most one line per kind every few seconds and says how many it left out.
Ground floor: used by the transports and the servers alike.
"""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog", "peer_log"]

logger = logging.getLogger("dissoc.peers")


class RateLimitedLog:
    """At most one line per kind per ``interval`` seconds; the next line says how many were left out.

    ``kind`` is any hashable (a string naming what happened); a hostile peer repeating a failure cannot fill
    the log, and a kind that is never repeated costs one dict entry.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[object, float] = {}
        self._suppressed: dict[object, int] = {}

    def log(self, level: int, kind: object, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless a line of ``kind`` was logged less than ``interval`` ago;
        returns whether it was logged."""
        if not self._logger.isEnabledFor(level):
            return False
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return False
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            self._logger.log(
                level,
                msg + " (%d more like this in the last %.0f s not logged)",
                *args,
                suppressed,
                now - last if last is not None else 0.0,
            )
        else:
            self._logger.log(level, msg, *args)
        return True


#: Rate-limited logging of what peers cause (failures they can repeat at will).
peer_log = RateLimitedLog(logger)
