"""Fixtures for the transport tests: a connected pair of each kind (helpers.transport makes them)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from helpers.transport import make_pair

from dissoc.transport import Connection


@pytest.fixture(params=["tcp", "inproc"])
def kind(request: pytest.FixtureRequest) -> str:
    """The transport under test."""
    return str(request.param)


@pytest.fixture
async def pair(kind: str) -> AsyncIterator[tuple[Connection, Connection]]:
    """A connected pair (a, b) of the transport under test, with default limits."""
    async with make_pair(kind) as connections:
        yield connections
