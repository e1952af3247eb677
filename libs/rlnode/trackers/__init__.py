"""Job events into the experiment trackers users already read: each tracker takes a job's
events in order (`log`) and turns them into its own runs, steps and scalars, from one
mapping of events to metrics (`metrics`). `rlnode job export` replays a job into one."""

from rlnode.trackers.metrics import Metrics, metrics_of
from rlnode.trackers.registry import TRACKERS, Tracker, TrackerUnavailable, open_tracker

__all__ = ["TRACKERS", "Metrics", "Tracker", "TrackerUnavailable", "metrics_of", "open_tracker"]
