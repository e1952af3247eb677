"""Reading at-least-once topics once: a record's id seen again is a copy; the memory of ids
is bounded (a copy lands right behind its original, so the window need not be the topic)."""

from __future__ import annotations

from uuid import uuid4

from rlnode.bus.reader import RecentIds


def test_an_id_is_new_once_then_a_copy() -> None:
    once = RecentIds()
    first, second = uuid4(), uuid4()
    assert [once.first_time(i) for i in (first, first, second, first, second)] == [
        True,
        False,
        True,
        False,
        False,
    ]


def test_the_oldest_ids_are_forgotten_past_the_window() -> None:
    once = RecentIds(size=2)
    a, b, c = uuid4(), uuid4(), uuid4()
    assert once.first_time(a) and once.first_time(b) and once.first_time(c)
    assert not once.first_time(c) and not once.first_time(b)
    assert once.first_time(a)  # fell out of the window of 2
