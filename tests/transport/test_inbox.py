"""The held-message store against a plain model: any mix of arrivals and masked claims, same answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.transport._inbox import TaggedStore
from dissoc.transport.base import TaggedMessage

MASKS = [0xFFFF_FFFF_FFFF_FFFF, 0x0000_0000_FFFF_FFFF, 0xFF00_0000_0000_0000, 0, 0x3, 0x1, 0x2, 0x5, 0x6, 0x7]
TAGS = st.sampled_from([0, 1, 2, 3, 5, 1 << 56 | 1, 1 << 56 | 2, 2 << 56 | 1, 0xFFFF_FFFF_FFFF_FFFF])
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), TAGS, st.booleans()),
        st.tuples(st.just("take"), TAGS, st.sampled_from(MASKS)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_store_matches_a_linear_scan(operations: list[tuple[str, int, object]]) -> None:
    store = TaggedStore()
    model: list[TaggedMessage] = []
    serial = 0
    for operation, tag, extra in operations:
        if operation == "add":
            serial += 1
            message = TaggedMessage(tag, serial.to_bytes(4, "little"))
            if extra:  # a message put back at the front (a cancelled consumer's)
                store.add(message, 4, front=True)
                model.insert(0, message)
            else:
                store.add(message, 4)
                model.append(message)
        else:
            assert isinstance(extra, int)
            expected = next((m for m in model if (m.tag & extra) == (tag & extra)), None)
            found = store.take(tag, extra)
            if expected is None:
                assert found is None
            else:
                assert found is not None
                assert found.message is expected
                model.remove(expected)
        assert len(store) == len(model)
