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


def test_record_rejects_live_or_repeated_offsets_atomically() -> None:
    led = Ledger(1 << 20)
    led.record("a", [(64, 8)])
    with pytest.raises(ValueError, match="0x40"):
        led.record("b", [(128, 8), (64, 8)])  # 64 is live for "a"
    with pytest.raises(ValueError, match="0x80"):
        led.record("b", [(128, 8), (128, 8)])
    assert led.ranges_of("b") == []
    assert led.live_bytes == 8
    for bad in ([(-1, 8)], [(1, 2**64)], [(1.5, 8)], [(True, 8)], [(1, 2, 3)]):
        with pytest.raises(ValueError):
            led.record("b", bad)  # type: ignore[arg-type]
    assert led.live_bytes == 8
    # once freed, an offset may be listed again (the arena reuses it)
    led.free("a", [64])
    assert led.record("b", [(64, 16)]) == 16
    assert led.owner_of(64) == "b"


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

    def _owner(self, offset: int) -> str | None:
        return next((c for c, rs in self.model.items() if offset in rs), None)

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
    def free_own(self, client: str, data: st.DataObject) -> None:
        mine = sorted(self.model.get(client, {}))
        if not mine:
            return
        chosen = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        expected = sum(self.model[client][o] for o in chosen)
        assert self.led.free(client, chosen) == expected
        for o in chosen:
            del self.model[client][o]

    @rule(client=_clients, other=_clients, data=st.data())
    def free_with_a_bad_address(self, client: str, other: str, data: st.DataObject) -> None:
        mine = sorted(self.model.get(client, {}))
        theirs = sorted(self.model.get(other, {})) if other != client else []
        bad_pool = [*theirs, self.next_offset + 1]  # someone else's range, or one never listed
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
        assert self.led.drop(client) == expected

    @invariant()
    def totals_match(self) -> None:
        total = sum(n for rs in self.model.values() for n in rs.values())
        assert self.led.live_bytes == total
        assert self.led.live_ranges == sum(len(rs) for rs in self.model.values())
        for client in ("a", "b", "c"):
            rs = self.model.get(client, {})
            assert self.led.ranges_of(client) == sorted(rs.items())
            assert self.led.live_bytes_of(client) == sum(rs.values())
            for offset in rs:
                assert self.led.owner_of(offset) == client


LedgerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["record", "free", "drop"]),
            st.integers(0, 3),
            st.lists(st.integers(0, 40), max_size=6),
        ),
        max_size=40,
    )
)
def test_any_interleaving_keeps_live_bytes_equal_to_live_ranges(
    ops: list[tuple[str, int, list[int]]],
) -> None:
    """Arbitrary ops, including illegal frees (duplicates, unknown, foreign): totals always add up."""
    led = Ledger(1 << 20)
    next_offset = 1
    for op, client, values in ops:
        if op == "record":
            pairs = [(next_offset + i * 64, v) for i, v in enumerate(values)]
            next_offset += 64 * (len(values) + 1)
            led.record(client, pairs)
        elif op == "free":
            known = [o for c in range(4) for o, _ in led.ranges_of(c)]
            addresses = [known[v % len(known)] if known and v % 3 else v for v in values]
            before = {c: led.ranges_of(c) for c in range(4)}
            try:
                freed = led.free(client, addresses)
            except ProtocolError:
                assert {c: led.ranges_of(c) for c in range(4)} == before
            else:
                assert freed == sum(n for o, n in before[client] if o in set(addresses))
        else:
            led.drop(client)
        assert led.live_bytes == sum(n for c in range(4) for _, n in led.ranges_of(c))
        assert all(led.live_bytes_of(c) == sum(n for _, n in led.ranges_of(c)) for c in range(4))
