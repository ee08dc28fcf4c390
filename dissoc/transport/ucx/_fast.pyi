# The C module dissoc/transport/ucx/_fast.c (see dissoc.transport.ucx.calls).
from collections.abc import Callable

ABI: int

def bind(
    tag_probe_nb: int,
    tag_msg_recv_nbx: int,
    tag_send_nbx: int,
    am_send_nbx: int,
    request_check_status: int,
    request_free: int,
    /,
) -> None: ...
def tag_probe(worker: int, tag: int, mask: int, remove: bool, /) -> tuple[int, int, int] | None: ...
def tag_probe_take(worker: int, tag: int, mask: int, most: int, /) -> tuple[int, int, int] | None: ...
def tag_take_run(
    worker: int,
    most: int,
    lander: Callable[[int, int], tuple[object, int] | None],
    done: list[tuple[int, object, int]],
    param: int,
    stop_tag: int,
    max_length: int,
    /,
) -> tuple[int, int, int, int, object, int]: ...
def tag_msg_recv(worker: int, address: int, length: int, message: int, param: int, /) -> int: ...
def tag_send(ep: int, data: int | bytes, length: int, tag: int, param: int, /) -> int: ...
def am_send(
    ep: int,
    am_id: int,
    header: int | bytes,
    header_length: int,
    data: int | bytes,
    length: int,
    param: int,
    /,
) -> int: ...
def request_test(request: int, /) -> int: ...
def am_setup(
    queues: dict[int, tuple[Callable[[bytes], None], int]], fallback: Callable[[int, int, int, int], None], /
) -> int: ...
