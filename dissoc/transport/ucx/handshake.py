"""The dissoc handshake over UCX: its constants, the hello/reply messages and the small send/receive helpers
both sides use while setting a connection up (see :mod:`dissoc.transport.ucx`, "One worker per connection").
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from dissoc.errors import TransportError
from dissoc.transport.base import TAG_MASK_ALL
from dissoc.transport.ucx.driver import Driver
from dissoc.transport.ucx.library import ucx_array, ucx_mask, ucx_tag

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "BYE_TAG",
    "HELLO_TAG",
    "MAGIC",
    "MAX_HELLO",
    "REPLY_TAG",
    "parse_hello",
    "plausible_address",
    "recv_am",
    "recv_tagged",
    "send_am",
    "send_tagged",
]

#: First bytes of every handshake message (then the sender's UCX worker address).
MAGIC = b"DISSOC-UCX/1\0"
#: Tags of the connection-control messages ("DISSOC" then a number). Their top byte has bits the Dissociated
#: IPC tag layout reserves, so no data message carries them.
HELLO_TAG = 0x444953534F430001  # client -> the listener's worker, by worker address: MAGIC + its address
REPLY_TAG = 0x444953534F430002  # server -> the client's worker: MAGIC + the connection worker's address
BYE_TAG = 0x444953534F430003  # either side, on the data endpoint, before it closes the connection
#: Largest handshake message accepted (a UCX worker address is a few hundred bytes).
MAX_HELLO = 16 * 1024

#: Worker-address format versions this UCX reads (``UCP_OBJECT_VERSION_V1``/``V2``, the low 4 bits of the
#: first byte); UCX aborts the process, through an assertion, on any other.
_ADDRESS_VERSIONS = (0, 1)


def plausible_address(address: bytes) -> bool:
    """Whether ``address`` may be handed to UCX (deeper corruption is UCX's to detect)."""
    return len(address) >= 16 and address[0] & 0x0F in _ADDRESS_VERSIONS


def parse_hello(message: Buffer | None, description: str) -> bytes:
    """The worker address in a hello or reply (``MAGIC`` + address); TransportError when it is not one."""
    data = bytes(memoryview(message).cast("B")) if message is not None else b""
    if not data.startswith(MAGIC) or len(data) == len(MAGIC):
        raise TransportError(f"{description}: the peer is not a dissoc ucx endpoint (bad handshake)")
    address = data[len(MAGIC) :]
    if not plausible_address(address):
        raise TransportError(
            f"{description}: expected a UCX worker address of this UCX version in the handshake, got "
            f"{len(address)} bytes starting {address[:8].hex()}"
        )
    return address


async def recv_am(driver: Driver, endpoint: Any, what: str) -> Buffer | None:
    """Receive one active message on ``endpoint`` (into memory ucxx allocates)."""
    try:
        request = endpoint.am_recv()
    except Exception as exc:
        raise TransportError(f"{driver.description}: {what} failed: {exc}") from exc
    await driver.wait(request, None, what)
    buffer: Buffer | None = request.recv_buffer
    return buffer


async def send_am(driver: Driver, endpoint: Any, data: bytes, what: str) -> None:
    """Send ``data`` as one active message on ``endpoint`` and wait until UCX completed it."""
    try:
        array = ucx_array(data)
        request = endpoint.am_send(array)
    except Exception as exc:
        raise TransportError(f"{driver.description}: {what} failed: {exc}") from exc
    await driver.wait(request, (array, data), what)


async def send_tagged(driver: Driver, endpoint: Any, tag: int, data: bytes, what: str) -> None:
    """Send ``data`` as one message tagged ``tag`` on ``endpoint`` and wait until UCX completed it."""
    try:
        array = ucx_array(data)
        request = endpoint.tag_send(array, ucx_tag(tag))
    except Exception as exc:
        raise TransportError(f"{driver.description}: {what} failed: {exc}") from exc
    await driver.wait(request, (array, data), what)


async def recv_tagged(driver: Driver, tag: int, what: str) -> bytes:
    """Receive one message of exactly ``tag`` on the driver's worker (at most ``MAX_HELLO`` bytes)."""
    worker = driver.worker
    while True:
        probe = worker.tag_probe(ucx_tag(tag), ucx_mask(TAG_MASK_ALL), False)
        if probe.matched:
            break
        if driver.closed:
            raise TransportError(f"{driver.description}: {what}: the connection is closed")
        driver.kick()
        await asyncio.sleep(0.001)
    length = int(probe.length)
    if length > MAX_HELLO:
        raise TransportError(f"{driver.description}: {what}: the answer is {length} bytes, not a handshake")
    probe = worker.tag_probe(ucx_tag(tag), ucx_mask(TAG_MASK_ALL), True)
    buffer = bytearray(max(1, length))
    array = ucx_array(buffer)
    await driver.wait(worker.tag_recv_with_handle(array, probe), (array, buffer), what)
    return bytes(buffer[:length])
