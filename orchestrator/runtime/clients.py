"""How the scheduler calls a worker: in this process (`LocalWorker`) or as a Ray actor (`RemoteWorker`), with
one interface and one failure vocabulary:

    await worker.call("verify", keep, trees, returns=2) -> (RoundOutput, Pairs or a Ray ref to them)
    c = worker.submit("verify", keep, trees, returns=2)  -> the call in flight: c.refs its later results at once,
                                                           to hand to another worker's call; await c.result()
    worker.cast("release", ids)                          -> fire and forget (ordered after earlier calls)

A call given another call's ref (`draft.submit("propose", ..., verify.refs[0])`) is chained: Ray pushes it to
its worker as soon as that result exists, without waiting for the caller, and it runs after every call sent
to its worker before it; the calls sent after it wait for it (one caller's calls run in order).

`WorkerLost`: the worker died or did not answer in time; what it held of the call's requests is unknown (a
late call may still complete). `WorkerFailed`: the call raised; the worker is alive.
"""

from __future__ import annotations

import asyncio


class WorkerLost(Exception):
    """A worker call failed because the worker died, restarted, or did not answer in time."""


class WorkerFailed(Exception):
    """A worker call raised (the worker is alive)."""


class Client:
    """`call` from `submit`: what every client (`LocalWorker`, `RemoteWorker`, the simulation's, the tests'
    faulty one) shares."""

    def submit(self, method: str, *args, returns: int = 1):
        raise NotImplementedError

    async def call(self, method: str, *args, returns: int = 1, timeout_s: float | None = None):
        """The call's results: the first, then (returns > 1) the others as `refs` holds them."""
        c = self.submit(method, *args, returns=returns)
        out = await c.result(timeout_s)
        return (out, *c.refs) if returns > 1 else out


class Done:
    """A call that ran when it was submitted (a worker in this process): its result, or its error. `refs`: the
    results after the first, None when the call failed (there is nothing to hand on)."""

    def __init__(self, value=None, refs: tuple | None = (), error: Exception | None = None) -> None:
        self.value, self.refs, self.error = value, refs, error

    @classmethod
    def run(cls, fn, method: str, args: tuple, returns: int) -> Done:
        try:
            value = fn(*args)
        except Exception as err:  # noqa: BLE001 (the client's failure vocabulary)
            return cls(refs=None, error=WorkerFailed(f"{method}: {type(err).__name__}: {err}"))
        return cls(value[0], tuple(value[1:])) if returns > 1 else cls(value)

    async def result(self, timeout_s: float | None = None):
        if self.error is not None:
            raise self.error
        return self.value


class LocalWorker(Client):
    """A worker object in this process: the in-process engine. A call runs when it is submitted."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def submit(self, method: str, *args, returns: int = 1) -> Done:
        return Done.run(getattr(self.worker, method), method, args, returns)

    def cast(self, method: str, *args) -> None:
        getattr(self.worker, method)(*args)


class RemoteCall:
    """A Ray actor call in flight: `refs` are its results after the first (Ray refs)."""

    def __init__(self, method: str, refs: list, timeout_s: float) -> None:
        self.method, self.first, self.refs, self.timeout_s = method, refs[0], tuple(refs[1:]), timeout_s

    async def result(self, timeout_s: float | None = None):
        """The first result within `timeout_s` (None: the worker's bound) from now."""
        import ray

        method, bound = self.method, timeout_s or self.timeout_s
        try:
            return await asyncio.wait_for(self.first, timeout=bound)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            raise WorkerLost(f"{method}: the worker died ({type(err).__name__})") from err
        except TimeoutError as err:
            raise WorkerLost(f"{method}: no answer within {bound:g} s") from err
        except ray.exceptions.RayTaskError as err:
            raise WorkerFailed(f"{method}: {err}") from err
        except ray.exceptions.RayError as err:  # an object lost with its node, a worker crashed, ...
            raise WorkerLost(f"{method}: {type(err).__name__}: {err}") from err


class RemoteWorker(Client):
    """A worker as a Ray actor (created with max_task_retries=0: a call in flight when it dies fails). With
    `returns=2` the second result stays a Ray ref, to be handed to the other worker without fetching it."""

    def __init__(self, handle, timeout_s: float) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def submit(self, method: str, *args, returns: int = 1) -> RemoteCall:
        remote = getattr(self.handle, method)
        refs = remote.options(num_returns=returns).remote(*args) if returns > 1 else [remote.remote(*args)]
        return RemoteCall(method, refs, self.timeout_s)

    def cast(self, method: str, *args) -> None:
        getattr(self.handle, method).remote(*args)
