"""Continuous batching on the manager: the scheduler that never deadlocks."""

from hybridkv.scheduling.scheduler import (
    Request,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Status,
)

__all__ = ["Request", "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Status"]
