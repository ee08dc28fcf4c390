"""The free_data ledger: per-client live ranges, atomic frees, drops on disconnect."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dissoc.errors import ProtocolError
from dissoc.protocol.ledger import Ledger
from dissoc.protocol.pairs import decode_free, decode_pairs, encode_free, encode_pairs


def test_record_free_drop_basics() -> None:
    led = Ledger(1000)
    assert led.record("a", [(0, 100), (0, 0), (128, 50)]) == 150
    assert led.record("b", [(256, 10)]) == 10
    assert led.live_bytes == 160
    assert led.live_bytes_of("a") == 150
    assert led.live_bytes_of("b") == 10
    assert led.live_bytes_of("nobody") == 0
    assert led.ranges_of("a") == [(0, 100), (128, 50)]
    assert led.ranges_of("nobody") == []
    assert led.owner_of(128) == "a"
    assert led.owner_of(1) is None
    assert len(led) == led.live_ranges == 3
    assert sorted(map(str, led.clients())) == ["a", "b"]

    assert led.free("a", [128]) == 50
    assert led.ranges_of("a") == [(0, 100)]
    assert led.live_bytes == 110
    assert led.drop("b") == [(256, 10)]
    assert led.drop("b") == []
    assert led.live_bytes == 100
    assert led.free_ranges("a", [0]) == [(0, 100)]
    assert led.live_bytes == 0
    assert led.clients() == []
    assert "live_bytes=0" in repr(led)


def test_zero_length_entries_are_not_recorded() -> None:
    led = Ledger(10)
    assert led.record("a", [(0, 0), (0, 0), (64, 0)]) == 0
    assert led.live_bytes == 0
    assert led.ranges_of("a") == []
    assert led.clients() == []
    with pytest.raises(ProtocolError, match="0x0"):
        led.free("a", [0])


def test_would_fit() -> None:
    led = Ledger(100)
    assert led.capacity_bytes == 100
    assert led.would_fit(100)
    assert not led.would_fit(101)
    led.record(1, [(0, 60)])
    assert led.would_fit(40)
    assert not led.would_fit(41)
    led.free(1, [0])
    assert led.would_fit(100)
    with pytest.raises(ValueError):
        led.would_fit(-1)


def test_record_rejects_repeated_offsets_for_one_client_atomically() -> None:
    led = Ledger(1 << 20)
    led.record("a", [(64, 8)])
    with pytest.raises(ValueError, match="0x40"):
        led.record("a", [(128, 8), (64, 8)])  # 64 is already live for "a"
    with pytest.raises(ValueError, match="0x80"):
        led.record("b", [(128, 8), (128, 8)])
    with pytest.raises(ValueError, match="length 8"):
        led.record("b", [(128, 8), (64, 16)])  # 64 is live with length 8: a server bug
    assert led.ranges_of("a") == [(64, 8)]
    assert led.ranges_of("b") == []
    assert led.live_bytes == 8
    for bad in ([(-1, 8)], [(1, 2**64)], [(1.5, 8)], [(True, 8)], [(1, 2, 3)]):
        with pytest.raises(ValueError):
            led.record("b", bad)  # type: ignore[arg-type]
    assert led.live_bytes == 8
    # once freed, an offset may be listed again (the arena reuses it), with another length
    led.free("a", [64])
    assert led.record("b", [(64, 16)]) == 16
    assert led.owner_of(64) == "b"
    assert led.holders_of(64) == ["b"]


def test_a_shared_range_is_held_by_each_client_until_each_frees_it() -> None:
    led = Ledger(1 << 20)
    assert led.record("a", [(0, 100), (128, 50)]) == 150
    assert led.record("b", [(0, 100), (0, 0), (256, 10)]) == 110  # 0 is shared with "a"
    assert led.holders_of(0) == ["a", "b"]
    assert led.owner_of(0) == "a"
    assert led.holders_of(128) == ["a"] and led.holders_of(999) == []
    # shared bytes count once in live_bytes, and in each holder's own count
    assert led.live_bytes == 160
    assert led.live_ranges == len(led) == 3
    assert led.live_bytes_of("a") == 150 and led.live_bytes_of("b") == 110
    # "a" frees its listing: "b" still holds the range
    assert led.free_ranges("a", [0]) == [(0, 100)]
    assert led.holders_of(0) == ["b"]
    assert led.live_bytes == 160
    assert led.ranges_of("b") == [(0, 100), (256, 10)]
    # "a" cannot free it twice, even though it is still live (for "b")
    with pytest.raises(ProtocolError, match="another client"):
        led.free("a", [0])
    # "a" may be listed it again (a new request), then both hold it again
    assert led.record("a", [(0, 100)]) == 100
    assert led.holders_of(0) == ["b", "a"]
    # drop returns exactly the dropped client's ranges; the other's stay
    assert led.drop("b") == [(0, 100), (256, 10)]
    assert led.holders_of(0) == ["a"] and led.holders_of(256) == []
    assert led.live_bytes == 150
    assert led.drop("a") == [(0, 100), (128, 50)]
    assert led.live_bytes == 0 and len(led) == 0 and led.clients() == []


def test_unknown_or_foreign_address_frees_nothing() -> None:
    led = Ledger(1 << 20)
    led.record("a", [(0, 10), (64, 20)])
    led.record("b", [(128, 30)])
    with pytest.raises(ProtocolError, match="another client") as info:
        led.free("a", [0, 128])
    assert "0x80" in str(info.value)
    with pytest.raises(ProtocolError, match="unknown address 0x3e7"):
        led.free("a", [64, 999])
    with pytest.raises(ProtocolError, match="twice"):
        led.free("a", [0, 0])
    with pytest.raises(ProtocolError, match="another client"):
        led.free("stranger", [0])
    with pytest.raises(ProtocolError, match="unknown"):
        led.free("stranger", [1])
    with pytest.raises(ProtocolError, match="u64"):
        led.free("a", ["0"])  # type: ignore[list-item]
    assert led.ranges_of("a") == [(0, 10), (64, 20)]
    assert led.ranges_of("b") == [(128, 30)]
    assert led.live_bytes == 60
    # double free: the second message is the bad one
    assert led.free("a", [0]) == 10
    with pytest.raises(ProtocolError, match="0x0"):
        led.free("a", [0])
    assert led.live_bytes == 50


def test_works_with_decoded_wire_values() -> None:
    """The driver feeds decode_pairs / decode_free output straight in (numpy uint64)."""
    led = Ledger(1 << 20)
    pl = decode_pairs(encode_pairs([(0, 100), (0, 0), (1 << 40, 7)]))
    assert led.record("c", pl.pairs) == 107
    assert led.record("d", np.array([[5000, 3]], dtype=np.uint64)) == 3
    assert led.free("c", decode_free(encode_free([1 << 40, 0]))) == 107
    assert led.free("d", np.array([5000], dtype=np.uint64)) == 3
    assert led.live_bytes == 0


def test_empty_free_message_is_a_no_op() -> None:
    led = Ledger(10)
    led.record("a", [(0, 5)])
    assert led.free("a", []) == 0
    assert led.live_bytes == 5


_clients = st.sampled_from(["a", "b", "c"])


class LedgerMachine(RuleBasedStateMachine):
    """Any interleaving of record/free/drop keeps the ledger equal to a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.led = Ledger(1 << 30)
        self.model: dict[str, dict[int, int]] = {}
        self.next_offset = 0

    def _holders(self, offset: int) -> set[str]:
        return {c for c, rs in self.model.items() if offset in rs}

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
        before = {c: self.led.ranges_of(c) for c in ("a", "b", "c") if c != client}
        assert self.led.record(client, pairs) == sum(n for _, n in chosen) + 64
        self.model.setdefault(client, {}).update({o: n for o, n in pairs if n})
        # listing a shared range to one client never changes another's listing
        assert {c: self.led.ranges_of(c) for c in before} == before

    @precondition(lambda self: any(self.model.values()))
    @rule(client=_clients, data=st.data())
    def record_again_is_refused(self, client: str, data: st.DataObject) -> None:
        mine = sorted(self.model.get(client, {}).items())
        if not mine:
            return
        again = data.draw(st.sampled_from(mine))
        before = self.led.ranges_of(client)
        with pytest.raises(ValueError, match=hex(again[0])):
            self.led.record(client, [(self.next_offset, 8), again])
        assert self.led.ranges_of(client) == before

    @precondition(lambda self: any(self.model.values()))
    @rule(client=_clients, data=st.data())
    def free_own(self, client: str, data: st.DataObject) -> None:
        mine = sorted(self.model.get(client, {}))
        if not mine:
            return
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        expected = sorted((o, self.model[client][o]) for o in chosen)
        others = {c: self.led.ranges_of(c) for c in ("a", "b", "c") if c != client}
        assert sorted(self.led.free_ranges(client, chosen)) == expected
        for o in chosen:
            del self.model[client][o]
        # frees by one client never affect another's listing
        assert {c: self.led.ranges_of(c) for c in others} == others

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
        before_client = self.led.ranges_of(client)
        before_other = self.led.ranges_of(other)
        before_live = self.led.live_bytes
        with pytest.raises(ProtocolError, match=hex(bad)):
            self.led.free(client, message)
        assert self.led.ranges_of(client) == before_client
        assert self.led.ranges_of(other) == before_other
        assert self.led.live_bytes == before_live

    @rule(client=_clients)
    def drop(self, client: str) -> None:
        expected = sorted(self.model.pop(client, {}).items())
        others = {c: self.led.ranges_of(c) for c in ("a", "b", "c") if c != client}
        assert self.led.drop(client) == expected  # exactly that client's ranges
        assert {c: self.led.ranges_of(c) for c in others} == others

    @invariant()
    def totals_match(self) -> None:
        distinct = {o: n for rs in self.model.values() for o, n in rs.items()}
        assert self.led.live_bytes == sum(distinct.values())  # shared ranges count once
        assert self.led.live_ranges == len(self.led) == len(distinct)
        for client in ("a", "b", "c"):
            rs = self.model.get(client, {})
            assert self.led.ranges_of(client) == sorted(rs.items())
            assert self.led.live_bytes_of(client) == sum(rs.values())
        for offset in distinct:
            holders = self.led.holders_of(offset)
            assert len(holders) == len(set(holders))
            assert set(holders) == self._holders(offset)
            assert self.led.owner_of(offset) in self._holders(offset)
        assert sorted(map(str, self.led.clients())) == sorted(c for c, rs in self.model.items() if rs)


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
    next_offset = 1
    for op, client, values in ops:
        before = {c: led.ranges_of(c) for c in range(4)}
        known = sorted({r for c in range(4) for r in led.ranges_of(c)})
        if op == "record":
            pairs = [(next_offset + i * 64, v) for i, v in enumerate(values)]
            next_offset += 64 * (len(values) + 1)
            led.record(client, pairs)
        elif op == "share":
            # other clients' live ranges (and maybe some of this client's own, which makes it illegal)
            pairs = list(dict.fromkeys(known[v % len(known)] for v in values)) if known else []
            try:
                led.record(client, pairs)
            except ValueError:
                assert any(r in before[client] for r in pairs)
                assert {c: led.ranges_of(c) for c in range(4)} == before
            else:
                assert sorted({*before[client], *pairs}) == led.ranges_of(client)
        elif op == "free":
            offsets = [o for o, _ in known]
            addresses = [offsets[v % len(offsets)] if offsets and v % 3 else v for v in values]
            try:
                freed = led.free(client, addresses)
            except ProtocolError:
                assert {c: led.ranges_of(c) for c in range(4)} == before
            else:
                assert freed == sum(n for o, n in before[client] if o in set(addresses))
        else:
            assert led.drop(client) == before[client]
        if op != "record":  # nothing but this client's own listing ever changes
            assert all(led.ranges_of(c) == before[c] for c in range(4) if c != client)
        distinct = {o: n for c in range(4) for o, n in led.ranges_of(c)}
        assert led.live_bytes == sum(distinct.values())
        assert all(led.live_bytes_of(c) == sum(n for _, n in led.ranges_of(c)) for c in range(4))
        assert all(
            set(led.holders_of(o)) == {c for c in range(4) if (o, n) in led.ranges_of(c)}
            for o, n in distinct.items()
        )
