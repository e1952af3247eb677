from aiokafka import TopicPartition

from rlnode_services.rollout_generator.work import OffsetTracker

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)


def test_only_a_contiguous_finished_run_is_committable() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.start(P0, offset)
    tracker.start(P1, 5)
    tracker.finish(P0, 11)
    assert tracker.committable() == {}  # 10 still in flight holds 11 back
    tracker.finish(P0, 10)
    assert tracker.committable() == {P0: 12}  # commit position = next offset to read
    assert tracker.in_flight == 2
    tracker.finish(P0, 12)
    tracker.finish(P1, 5)
    assert tracker.committable() == {P0: 13, P1: 6}
    assert tracker.committable() == {} and tracker.in_flight == 0


def test_revoked_partitions_are_forgotten() -> None:
    tracker = OffsetTracker()
    tracker.start(P0, 1)
    tracker.forget({P0})
    tracker.finish(P0, 1)
    assert tracker.committable() == {} and tracker.in_flight == 0
