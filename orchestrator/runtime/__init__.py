"""The runtime of speculative decoding: the target and draft workers (one implementation each), the messages
between them, how they are called (in-process or as Ray actors), the scheduler that drives them, its
policies, the output text stream and the serving metrics."""

from orchestrator.runtime.clients import LocalWorker, RemoteWorker, WorkerFailed, WorkerLost
from orchestrator.runtime.detok import TextStream
from orchestrator.runtime.scheduler import Event, Request, SchedulerConfig, SpecScheduler
from orchestrator.runtime.workers import DraftWorker, TargetWorker, finish_reason

__all__ = [
    "DraftWorker",
    "Event",
    "LocalWorker",
    "RemoteWorker",
    "Request",
    "SchedulerConfig",
    "SpecScheduler",
    "TargetWorker",
    "TextStream",
    "WorkerFailed",
    "WorkerLost",
    "finish_reason",
]
