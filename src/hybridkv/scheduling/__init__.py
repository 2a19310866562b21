"""Continuous batching on the manager: the scheduler that never deadlocks."""

from hybridkv.scheduling.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput, Status

__all__ = ["Request", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Status"]
