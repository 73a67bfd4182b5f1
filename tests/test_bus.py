"""The event bus between the feed (events other servers commit) and a server's watchers.

A regression test for a stall seen with 200 watchers of one task on PostgreSQL: a watcher that
joined late replayed the whole log and moved the point the feed reads from past events the
earlier watchers had not been given; the task ended meanwhile, so nothing later came to show
them the gap, and they waited for ever."""

from __future__ import annotations

from jupyter_lmsp.services.bus import EventBus


def _events(first: int, last: int) -> list[dict[str, object]]:
    return [
        {"type": "response.output_text.delta", "sequence_number": n} for n in range(first, last)
    ]


def _drain(sub) -> list[int]:
    got = []
    while not sub.queue.empty():
        _, event = sub.queue.get_nowait()
        got.append(event["sequence_number"])
    return got


def test_the_first_watchers_replay_sets_where_delivery_starts():
    bus = EventBus()
    with bus.subscribe("t") as sub:
        assert bus.watched() == {}  # nothing read yet: the feed waits for the replay
        sub.seen(4)
        assert bus.watched() == {"t": 4}
        bus.publish("t", _events(3, 8))  # 3 and 4 were replayed: not delivered again
        assert _drain(sub) == [5, 6, 7]
        assert bus.watched() == {"t": 7}


def test_a_late_watcher_that_replayed_further_does_not_skip_events_for_the_others():
    bus = EventBus()
    with bus.subscribe("t") as early:
        early.seen(10)
        bus.publish("t", _events(11, 21))
        assert _drain(early) == list(range(11, 21))
        # Events 21..48 are committed; the feed has not read them yet. A watcher joins and
        # replays the whole log, up to 48.
        with bus.subscribe("t") as late:
            late.seen(48)
            # The feed still reads after 20, so the early watcher gets 21..48.
            assert bus.watched() == {"t": 20}
            bus.publish("t", _events(21, 49))
            assert _drain(early) == list(range(21, 49))
            # The late one receives them too and drops what it replayed (follow.py: seq <= last).
            assert _drain(late) == list(range(21, 49))
    assert bus.watched() == {}
