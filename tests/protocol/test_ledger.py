"""The free_data ledger: per-client live ranges, atomic frees, drops on disconnect.

What a client holds is asked the way the server asks it: by free_data messages (:func:`holds`), by the
bytes each client holds, and by what frees and drops return."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dissoc.errors import ProtocolError
from dissoc.protocol.ledger import Ledger
from dissoc.protocol.pairs import decode_free, decode_pairs, encode_free, encode_pairs

#: An address no test lists.
NEVER = 0xFFFF_FFFF_FFFF_FFFF


def holds(led: Ledger, client: Hashable, offset: int) -> bool:
    """Whether ``client`` holds the live range at ``offset``, without freeing it: a free_data message naming
    ``offset`` and then an address never listed is refused whole, naming the first address that ``client``
    does not hold."""
    try:
        led.free_ranges(client, [offset, NEVER])
    except ProtocolError as e:
        return f"{NEVER:#x}" in str(e)
    raise AssertionError(f"{NEVER:#x} was freed")


def held(led: Ledger, client: Hashable, offsets: Iterable[int]) -> list[int]:
    """Which of ``offsets`` ``client`` holds, sorted (see :func:`holds`)."""
    return sorted(o for o in set(offsets) if holds(led, client, o))


def ranges(led: Ledger, client: Hashable, lengths: dict[int, int]) -> list[tuple[int, int]]:
    """The ranges ``client`` holds, sorted, of those listed (``lengths``: offset -> length)."""
    return [(o, lengths[o]) for o in held(led, client, lengths)]


def test_record_free_drop_basics() -> None:
    led = Ledger(1000)
    assert led.capacity_bytes == 1000
    assert led.record("a", [(0, 100), (0, 0), (128, 50)]) == 150
    assert led.record("b", [(256, 10)]) == 10
    assert led.live_bytes == 160
    assert led.live_bytes_of("a") == 150
    assert led.live_bytes_of("b") == 10
    assert led.live_bytes_of("nobody") == 0
    assert held(led, "a", [0, 128, 256, 1]) == [0, 128]
    assert held(led, "b", [0, 128, 256]) == [256]
    assert held(led, "nobody", [0, 128, 256]) == []
    assert "live_bytes=160" in repr(led) and "ranges=3" in repr(led) and "clients=2" in repr(led)

    assert led.free_ranges("a", [128]) == [(128, 50)]
    assert held(led, "a", [0, 128]) == [0]
    assert led.live_bytes == 110
    assert led.drop("b") == [(256, 10)]
    assert led.drop("b") == []
    assert led.live_bytes == 100
    assert led.free_ranges("a", [0]) == [(0, 100)]
    assert led.live_bytes == 0 and led.live_bytes_of("a") == 0
    assert led.drop("a") == []
    assert "live_bytes=0" in repr(led) and "clients=0" in repr(led)


def test_zero_length_entries_are_not_recorded() -> None:
    led = Ledger(10)
    assert led.record("a", [(0, 0), (0, 0), (64, 0)]) == 0
    assert led.live_bytes == 0
    assert led.live_bytes_of("a") == 0
    with pytest.raises(ProtocolError, match="0x0"):
        led.free_ranges("a", [0])
    assert led.drop("a") == []
    assert "clients=0" in repr(led)


def test_record_rejects_repeated_offsets_for_one_client_atomically() -> None:
    led = Ledger(1 << 20)
    led.record("a", [(64, 8)])
    with pytest.raises(ValueError, match="0x40"):
        led.record("a", [(128, 8), (64, 8)])  # 64 is already live for "a"
    with pytest.raises(ValueError, match="0x80"):
        led.record("b", [(128, 8), (128, 8)])
    with pytest.raises(ValueError, match="length 8"):
        led.record("b", [(128, 8), (64, 16)])  # 64 is live with length 8: a server bug
    assert held(led, "a", [64, 128]) == [64] and led.live_bytes_of("a") == 8
    assert held(led, "b", [64, 128]) == [] and led.live_bytes_of("b") == 0
    assert led.live_bytes == 8
    for bad in ([(-1, 8)], [(1, 2**64)], [(1.5, 8)], [(True, 8)], [(1, 2, 3)]):
        with pytest.raises(ValueError):
            led.record("b", bad)  # type: ignore[arg-type]
    assert led.live_bytes == 8
    # once freed, an offset may be listed again (the arena reuses it), with another length
    led.free_ranges("a", [64])
    assert led.record("b", [(64, 16)]) == 16
    assert holds(led, "b", 64) and not holds(led, "a", 64)
    assert led.drop("b") == [(64, 16)]


def test_a_shared_range_is_held_by_each_client_until_each_frees_it() -> None:
    led = Ledger(1 << 20)
    offsets = [0, 128, 256, 999]
    assert led.record("a", [(0, 100), (128, 50)]) == 150
    assert led.record("b", [(0, 100), (0, 0), (256, 10)]) == 110  # 0 is shared with "a"
    assert held(led, "a", offsets) == [0, 128]
    assert held(led, "b", offsets) == [0, 256]
    # shared bytes count once in live_bytes, and in each holder's own count
    assert led.live_bytes == 160
    assert "ranges=3" in repr(led)
    assert led.live_bytes_of("a") == 150 and led.live_bytes_of("b") == 110
    # "a" frees its listing: "b" still holds the range
    assert led.free_ranges("a", [0]) == [(0, 100)]
    assert held(led, "a", offsets) == [128]
    assert held(led, "b", offsets) == [0, 256] and led.live_bytes_of("b") == 110
    assert led.live_bytes == 160
    # "a" cannot free it twice, even though it is still live (for "b")
    with pytest.raises(ProtocolError, match="another client"):
        led.free_ranges("a", [0])
    # "a" may be listed it again (a new request), then both hold it again
    assert led.record("a", [(0, 100)]) == 100
    assert held(led, "a", offsets) == [0, 128]
    # drop returns exactly the dropped client's ranges; the other's stay
    assert led.drop("b") == [(0, 100), (256, 10)]
    assert held(led, "a", offsets) == [0, 128]
    with pytest.raises(ProtocolError, match="unknown address 0x100"):
        led.free_ranges("a", [256])  # live for nobody now
    assert led.live_bytes == 150
    assert led.drop("a") == [(0, 100), (128, 50)]
    assert led.live_bytes == 0 and "ranges=0" in repr(led) and "clients=0" in repr(led)


def test_unknown_or_foreign_address_frees_nothing() -> None:
    led = Ledger(1 << 20)
    led.record("a", [(0, 10), (64, 20)])
    led.record("b", [(128, 30)])
    with pytest.raises(ProtocolError, match="another client") as info:
        led.free_ranges("a", [0, 128])
    assert "0x80" in str(info.value)
    with pytest.raises(ProtocolError, match="unknown address 0x3e7"):
        led.free_ranges("a", [64, 999])
    with pytest.raises(ProtocolError, match="twice"):
        led.free_ranges("a", [0, 0])
    with pytest.raises(ProtocolError, match="another client"):
        led.free_ranges("stranger", [0])
    with pytest.raises(ProtocolError, match="unknown"):
        led.free_ranges("stranger", [1])
    with pytest.raises(ProtocolError, match="u64"):
        led.free_ranges("a", ["0"])  # type: ignore[list-item]
    assert held(led, "a", [0, 64, 128]) == [0, 64] and led.live_bytes_of("a") == 30
    assert held(led, "b", [0, 64, 128]) == [128] and led.live_bytes_of("b") == 30
    assert led.live_bytes == 60
    # double free: the second message is the bad one
    assert led.free_ranges("a", [0]) == [(0, 10)]
    with pytest.raises(ProtocolError, match="0x0"):
        led.free_ranges("a", [0])
    assert led.live_bytes == 50


def test_works_with_decoded_wire_values() -> None:
    """The driver feeds decode_pairs / decode_free output straight in (numpy uint64)."""
    led = Ledger(1 << 20)
    pl = decode_pairs(encode_pairs([(0, 100), (0, 0), (1 << 40, 7)]))
    assert led.record("c", pl.pairs) == 107
    assert led.record("d", np.array([[5000, 3]], dtype=np.uint64)) == 3
    assert led.free_ranges("c", decode_free(encode_free([1 << 40, 0]))) == [(1 << 40, 7), (0, 100)]
    assert led.free_ranges("d", np.array([5000], dtype=np.uint64)) == [(5000, 3)]
    assert led.live_bytes == 0


def test_empty_free_message_is_a_no_op() -> None:
    led = Ledger(10)
    led.record("a", [(0, 5)])
    assert led.free_ranges("a", []) == []
    assert led.live_bytes == 5 and led.live_bytes_of("a") == 5


_clients = st.sampled_from(["a", "b", "c"])


class LedgerMachine(RuleBasedStateMachine):
    """Any interleaving of record/free/drop keeps the ledger equal to a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.led = Ledger(1 << 30)
        self.model: dict[str, dict[int, int]] = {}
        self.lengths: dict[int, int] = {}  # every range ever listed: offset -> length
        self.next_offset = 0

    def _ranges(self, client: str) -> list[tuple[int, int]]:
        return ranges(self.led, client, self.lengths)

    @rule(client=_clients, lengths=st.lists(st.integers(0, 300), max_size=5))
    def record(self, client: str, lengths: list[int]) -> None:
        pairs = []
        for n in lengths:
            if n == 0:
                pairs.append((0, 0))
            else:
                pairs.append((self.next_offset, n))
                self.next_offset += 64 * (n // 64 + 1)
        assert self.led.record(client, pairs) == sum(lengths)
        self.model.setdefault(client, {}).update({o: n for o, n in pairs if n})
        self.lengths.update({o: n for o, n in pairs if n})

    @precondition(lambda self: any(self.model.values()))
    @rule(client=_clients, data=st.data())
    def share(self, client: str, data: st.DataObject) -> None:
        """List ranges live for other clients to ``client`` too (a resident placement), and a new one."""
        mine = self.model.get(client, {})
        pool = sorted(
            {(o, n) for c, rs in self.model.items() if c != client for o, n in rs.items()} - set(mine.items())
        )
        if not pool:
            return
        chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
        fresh = (self.next_offset, 64)
        self.next_offset += 128
        pairs = data.draw(st.permutations([*chosen, (0, 0), fresh]))
        before = {c: self._ranges(c) for c in ("a", "b", "c") if c != client}
        assert self.led.record(client, pairs) == sum(n for _, n in chosen) + 64
        self.model.setdefault(client, {}).update({o: n for o, n in pairs if n})
        self.lengths.update({o: n for o, n in pairs if n})
        # listing a shared range to one client never changes another's listing
        assert {c: self._ranges(c) for c in before} == before

    @precondition(lambda self: any(self.model.values()))
    @rule(client=_clients, data=st.data())
    def record_again_is_refused(self, client: str, data: st.DataObject) -> None:
        mine = sorted(self.model.get(client, {}).items())
        if not mine:
            return
        again = data.draw(st.sampled_from(mine))
        before = self._ranges(client)
        with pytest.raises(ValueError, match=hex(again[0])):
            self.led.record(client, [(self.next_offset, 8), again])
        assert self._ranges(client) == before and not holds(self.led, client, self.next_offset)

    @precondition(lambda self: any(self.model.values()))
    @rule(client=_clients, data=st.data())
    def free_own(self, client: str, data: st.DataObject) -> None:
        mine = sorted(self.model.get(client, {}))
        if not mine:
            return
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        expected = sorted((o, self.model[client][o]) for o in chosen)
        others = {c: self._ranges(c) for c in ("a", "b", "c") if c != client}
        assert sorted(self.led.free_ranges(client, chosen)) == expected
        for o in chosen:
            del self.model[client][o]
        # frees by one client never affect another's listing
        assert {c: self._ranges(c) for c in others} == others

    @rule(client=_clients, other=_clients, data=st.data())
    def free_with_a_bad_address(self, client: str, other: str, data: st.DataObject) -> None:
        mine = sorted(self.model.get(client, {}))
        mine_set = set(mine)
        theirs = sorted(set(self.model.get(other, {})) - mine_set) if other != client else []
        bad_pool = [*theirs, self.next_offset + 1]  # a range listed only to others, or one never listed
        bad = data.draw(st.sampled_from(bad_pool))
        good = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
        message = [*good, bad]
        message = data.draw(st.permutations(message))
        before_client = self._ranges(client)
        before_other = self._ranges(other)
        before_live = self.led.live_bytes
        with pytest.raises(ProtocolError, match=hex(bad)):
            self.led.free_ranges(client, message)
        assert self._ranges(client) == before_client
        assert self._ranges(other) == before_other
        assert self.led.live_bytes == before_live

    @rule(client=_clients)
    def drop(self, client: str) -> None:
        expected = sorted(self.model.pop(client, {}).items())
        others = {c: self._ranges(c) for c in ("a", "b", "c") if c != client}
        assert self.led.drop(client) == expected  # exactly that client's ranges
        assert {c: self._ranges(c) for c in others} == others

    @invariant()
    def totals_match(self) -> None:
        distinct = {o: n for rs in self.model.values() for o, n in rs.items()}
        assert self.led.live_bytes == sum(distinct.values())  # shared ranges count once
        holding = sum(1 for rs in self.model.values() if rs)
        assert f"ranges={len(distinct)}, clients={holding})" in repr(self.led)
        for client in ("a", "b", "c"):
            rs = self.model.get(client, {})
            # (so each range's holders are those of the model)
            assert self._ranges(client) == sorted(rs.items())
            assert self.led.live_bytes_of(client) == sum(rs.values())


LedgerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["record", "share", "free", "drop"]),
            st.integers(0, 3),
            st.lists(st.integers(0, 40), max_size=6),
        ),
        max_size=40,
    )
)
def test_any_interleaving_keeps_live_bytes_equal_to_live_ranges(
    ops: list[tuple[str, int, list[int]]],
) -> None:
    """Arbitrary ops, including shared listings and illegal frees (duplicates, unknown, foreign, listed
    only to others) and illegal records (an offset again for the same client): totals always add up."""
    led = Ledger(1 << 20)
    lengths: dict[int, int] = {}  # every range ever listed: offset -> length
    next_offset = 1
    for op, client, values in ops:
        before = {c: ranges(led, c, lengths) for c in range(4)}
        known = sorted({r for c in range(4) for r in before[c]})
        if op == "record":
            pairs = [(next_offset + i * 64, v) for i, v in enumerate(values)]
            next_offset += 64 * (len(values) + 1)
            led.record(client, pairs)
            lengths.update({o: n for o, n in pairs if n})
        elif op == "share":
            # other clients' live ranges (and maybe some of this client's own, which makes it illegal)
            pairs = list(dict.fromkeys(known[v % len(known)] for v in values)) if known else []
            try:
                led.record(client, pairs)
            except ValueError:
                assert any(r in before[client] for r in pairs)
                assert {c: ranges(led, c, lengths) for c in range(4)} == before
            else:
                assert sorted({*before[client], *pairs}) == ranges(led, client, lengths)
        elif op == "free":
            offsets = [o for o, _ in known]
            addresses = [offsets[v % len(offsets)] if offsets and v % 3 else v for v in values]
            try:
                freed = sum(n for _, n in led.free_ranges(client, addresses))
            except ProtocolError:
                assert {c: ranges(led, c, lengths) for c in range(4)} == before
            else:
                assert freed == sum(n for o, n in before[client] if o in set(addresses))
        else:
            assert led.drop(client) == before[client]
        if op != "record":  # nothing but this client's own listing ever changes
            assert all(ranges(led, c, lengths) == before[c] for c in range(4) if c != client)
        now = {c: ranges(led, c, lengths) for c in range(4)}
        distinct = {o: n for c in range(4) for o, n in now[c]}
        assert led.live_bytes == sum(distinct.values())
        assert f"ranges={len(distinct)}," in repr(led)
        assert all(led.live_bytes_of(c) == sum(n for _, n in now[c]) for c in range(4))
