"""How the scheduler calls a worker: in this process (`LocalWorker`) or as a Ray actor (`RemoteWorker`), with
one interface and one failure vocabulary:

    await worker.call("verify", keep, trees, returns=2) -> (RoundOutput, Pairs or a Ray ref to them)
    worker.cast("release", ids)                          -> fire and forget (ordered after earlier calls)

`WorkerLost`: the worker died or did not answer in time; what it held of the call's requests is unknown (a
late call may still complete). `WorkerFailed`: the call raised; the worker is alive.
"""

from __future__ import annotations

import asyncio


class WorkerLost(Exception):
    """A worker call failed because the worker died, restarted, or did not answer in time."""


class WorkerFailed(Exception):
    """A worker call raised (the worker is alive)."""


class LocalWorker:
    """A worker object in this process: the in-process engine, the scheduler's tests."""

    def __init__(self, worker) -> None:
        self.worker = worker

    async def call(self, method: str, *args, returns: int = 1, timeout_s: float | None = None):
        try:
            return getattr(self.worker, method)(*args)
        except Exception as err:
            raise WorkerFailed(f"{method}: {type(err).__name__}: {err}") from err

    def cast(self, method: str, *args) -> None:
        getattr(self.worker, method)(*args)


class RemoteWorker:
    """A worker as a Ray actor (created with max_task_retries=0: a call in flight when it dies fails). With
    `returns=2` the second result stays a Ray ref, to be handed to the other worker without fetching it."""

    def __init__(self, handle, timeout_s: float) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    async def call(self, method: str, *args, returns: int = 1, timeout_s: float | None = None):
        """timeout_s: this call's bound (a call known to carry much work), else the worker's."""
        import ray

        remote = getattr(self.handle, method)
        refs = remote.options(num_returns=returns).remote(*args) if returns > 1 else remote.remote(*args)
        first = refs[0] if returns > 1 else refs
        try:
            out = await asyncio.wait_for(first, timeout=timeout_s or self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            raise WorkerLost(f"{method}: the worker died ({type(err).__name__})") from err
        except TimeoutError as err:
            raise WorkerLost(f"{method}: no answer within {timeout_s or self.timeout_s:g} s") from err
        except ray.exceptions.RayTaskError as err:
            raise WorkerFailed(f"{method}: {err}") from err
        except ray.exceptions.RayError as err:  # an object lost with its node, a worker crashed, ...
            raise WorkerLost(f"{method}: {type(err).__name__}: {err}") from err
        return (out, *refs[1:]) if returns > 1 else out

    def cast(self, method: str, *args) -> None:
        getattr(self.handle, method).remote(*args)
