"""The offset ledger: only the contiguous settled prefix of a partition is committable."""

from aiokafka import TopicPartition

from rlnode.bus import OffsetLedger

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)


def test_only_a_contiguous_settled_run_is_committable() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    for offset in (10, 11, 12):
        ledger.track(P0, offset)
    ledger.track(P1, 5)
    ledger.settle(P0, 11)
    assert ledger.committable() == {}  # 10 still open holds 11 back
    ledger.settle(P0, 10)
    assert ledger.committable() == {P0: 12}  # commit position = the next offset to read
    assert ledger.open == 2
    ledger.settle(P0, 12)
    ledger.settle(P1, 5)
    assert ledger.committable() == {P0: 13, P1: 6}
    assert ledger.committable() == {} and ledger.open == 0


def test_tagged_records_settle_when_their_effect_is_durable() -> None:
    """As the learner uses it: a trajectory (job, step) is settled once a checkpoint covers
    its step; an earlier unsettled one holds the later ones back."""
    ledger: OffsetLedger[tuple[str, int]] = OffsetLedger()
    for offset, step in [(0, 1), (1, 2), (2, 1), (3, 3)]:
        ledger.track(P0, offset)
        ledger.tag(P0, offset, ("job", step))
    ledger.track(P0, 4)  # handed out, not yet tagged: never settled by a predicate
    checkpointed = 1
    ledger.settle_where(lambda tag: tag[1] <= checkpointed)
    assert ledger.committable() == {P0: 1}  # step 2 at offset 1 holds 2 (step 1) back
    checkpointed = 3
    ledger.settle_where(lambda tag: tag[1] <= checkpointed)
    assert ledger.committable() == {P0: 4}
    assert ledger.open == 1


def test_a_revoked_partition_is_forgotten_and_late_settles_are_ignored() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    ledger.track(P0, 1)
    ledger.forget([P0])
    ledger.settle(P0, 1)  # a handler that finished after the revoke
    assert ledger.committable() == {} and ledger.open == 0
    ledger.track(P0, 1)  # the partition came back: the record is read again
    assert ledger.open == 1 and ledger.committable() == {}


def test_settling_twice_or_an_unknown_offset_changes_nothing() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    ledger.track(P0, 7)
    ledger.settle(P0, 7)
    ledger.settle(P0, 7)
    ledger.settle(P0, 99)
    ledger.settle(P1, 1)
    assert ledger.committable() == {P0: 8}
    assert ledger.committable() == {}


def test_the_settled_check_is_asked_once_per_tag_not_per_record() -> None:
    """A learner holds thousands of trajectories between checkpoints, a few steps' worth of
    tags: each commit asks about the tags, and a settled tag is not asked about again."""
    ledger: OffsetLedger[tuple[str, int]] = OffsetLedger()
    for offset in range(1000):
        ledger.track(P0, offset)
        ledger.tag(P0, offset, ("job", offset // 250))  # four steps of 250
    asked: list[tuple[str, int]] = []

    def durable_up_to_step_1(tag: tuple[str, int]) -> bool:
        asked.append(tag)
        return tag[1] <= 1

    ledger.settle_where(durable_up_to_step_1)
    assert sorted(asked) == [("job", 0), ("job", 1), ("job", 2), ("job", 3)]
    assert ledger.committable() == {P0: 500}
    asked.clear()
    ledger.settle_where(durable_up_to_step_1)
    assert sorted(asked) == [("job", 2), ("job", 3)]


def test_a_revoked_partitions_tags_are_dropped() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    ledger.track(P0, 1)
    ledger.tag(P0, 1, "a")
    ledger.track(P1, 1)
    ledger.tag(P1, 1, "a")
    ledger.forget([P0])
    asked: list[str] = []

    def always(tag: str) -> bool:
        asked.append(tag)
        return True

    ledger.settle_where(always)
    assert asked == ["a"] and ledger.committable() == {P1: 2}
    ledger.track(P0, 1)  # read again after the partition came back: not settled by the old tag
    assert ledger.committable() == {} and ledger.open == 1


def test_records_untracked_from_an_offset_stop_holding_the_position_back() -> None:
    ledger: OffsetLedger[str] = OffsetLedger()
    for offset in range(5):
        ledger.track(P0, offset)
    ledger.tag(P0, 3, "step")
    ledger.settle(P0, 0)
    ledger.untrack_from(P0, 2)  # 2.. go back to be read again
    assert ledger.open == 1  # 1 is still out
    ledger.settle(P0, 1)
    assert ledger.committable() == {P0: 2}
    ledger.settle_where(lambda _tag: True)  # the dropped record's tag is gone too
    assert ledger.committable() == {}
