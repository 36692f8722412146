"""EventHub under random publish/consume interleavings: nothing is lost without being counted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvcache_offload.aio import EngineEvent, EventHub, EventType, GapMarker
from tests.unit._keys import keys

TYPES = list(EventType)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.sampled_from(TYPES)),
        st.tuples(st.just("consume"), st.integers(0, 2), st.integers(1, 5)),
    ),
    max_size=120,
)


@given(
    ops=ops,
    queue_sizes=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    filters=st.tuples(
        st.none(), st.none() | st.frozensets(st.sampled_from(TYPES), min_size=1), st.none()
    ),
)
def test_every_matching_event_is_delivered_or_counted_in_exactly_one_gap(
    ops: list[tuple], queue_sizes: tuple[int, int, int], filters: tuple
) -> None:
    hub = EventHub(buffer_size=1000, queue_size=8)
    subs = [hub.subscribe(types=f, queue_size=q) for f, q in zip(filters, queue_sizes, strict=True)]
    received: list[list[EngineEvent | GapMarker]] = [[], [], []]
    published: list[EngineEvent] = []
    for op in ops:
        if op[0] == "publish":
            published.append(hub.publish(op[1], keys(len(published))))
        else:
            _, idx, n = op
            for _ in range(n):
                item = subs[idx].get_nowait()
                if item is None:
                    break
                received[idx].append(item)
    for idx, sub in enumerate(subs):
        while (item := sub.get_nowait()) is not None:
            received[idx].append(item)
        wanted = [e for e in published if filters[idx] is None or e.type in filters[idx]]
        events = [i for i in received[idx] if isinstance(i, EngineEvent)]
        gaps = [i for i in received[idx] if isinstance(i, GapMarker)]
        # in order, each matching event at most once, and the rest accounted for by gaps
        assert [e.seq for e in events] == sorted({e.seq for e in events})
        assert {e.seq for e in events} <= {e.seq for e in wanted}
        assert len(events) + sum(g.missed for g in gaps) == len(wanted)
        # never two gap markers in a row, and a gap points at the next event delivered
        for a, b in zip(received[idx], received[idx][1:], strict=False):
            assert not (isinstance(a, GapMarker) and isinstance(b, GapMarker))
            if isinstance(a, GapMarker):
                assert isinstance(b, EngineEvent) and b.seq >= a.next_seq
    assert [e.seq for e in published] == list(range(1, len(published) + 1))
    assert hub.dropped == sum(g.missed for r in received for g in r if isinstance(g, GapMarker))
