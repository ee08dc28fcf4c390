"""The client's machinery, below its public face (:mod:`dissoc.client`): one stream's session and what it
needs, a file per job.

* :mod:`~dissoc.session.options` -- :class:`ClientOptions`, :class:`FetchStats` and :class:`FetchPath`.
* :mod:`~dissoc.session.connect`, :mod:`~dissoc.session.pool` -- connections, made or reused.
* :mod:`~dissoc.session.session` -- :class:`Session`: the pump around :class:`dissoc.protocol.ClientStream`.
* :mod:`~dissoc.session.landing` -- where small packed bodies land (slabs).
* :mod:`~dissoc.session.decoding` -- one decode-and-account step for every body kind, and the path taken.
* :mod:`~dissoc.session.frees` -- free_data for the arena ranges batches are done with.
* :mod:`~dissoc.session.reading` -- a stream as bursts of batches, counted in the metrics.
* :mod:`~dissoc.session.runners` -- running all this from synchronous code.
"""

from __future__ import annotations

from dissoc.session.options import ClientOptions, FetchPath, FetchStats
from dissoc.session.session import Session

__all__ = ["ClientOptions", "FetchPath", "FetchStats", "Session"]
