"""Whether a new backend's workers can be, and are being, placed on the cluster: what a rollout checks before
and while a backend starts, so that one the cluster cannot hold fails with what it lacks instead of waiting
forever. Ray's public API does not say what is pending, so this reads its state tables."""

from __future__ import annotations

import time

from orchestrator.errors import AerieError


def shortfall(needs: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    """What `have` lacks of `needs` (empty when it covers them)."""
    return {k: v - have.get(k, 0.0) for k, v in needs.items() if v - have.get(k, 0.0) > 1e-9}


def fmt_resources(resources: dict[str, float]) -> str:
    shown = {k: round(v, 3) for k, v in sorted(resources.items()) if not k.startswith(("node:", "memory", "object_"))}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def pending() -> dict[str, str]:
    """The actors and placement groups not created yet: {id: what it is}. An actor whose constructor runs in a
    worker process of its own (a Pid) is left out: a vLLM replica importing its engine takes minutes on a busy
    node."""
    import ray

    actors = ray._private.state.state.actor_table(None)
    groups = ray.util.placement_group_table()
    return {
        a: (v.get("ActorClassName") or "actor").rsplit(".", 1)[-1]
        for a, v in actors.items()
        if v.get("State") == "PENDING_CREATION" and not v.get("Pid")
    } | {g: "placement group" for g, v in groups.items() if v.get("state") == "PENDING"}


def demand_beyond_free() -> list[dict[str, float]]:
    """The resource shapes the cluster is asked for (actors, tasks, placement-group bundles) that what is free
    now cannot give. An actor waiting for a worker process (Ray starts a few at a time: Ray Serve LLM's
    TelemetryAgent waited 3 min behind vLLM's on 2 cores) holds its resources already: it is not here."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
    shapes = [dict(r.request.resources_bundle) for r in state.pending_resource_requests]
    shapes += [dict(b.resources_bundle) for g in state.pending_gang_resource_requests for b in g.requests]
    free = ray.available_resources()
    return [shape for shape in shapes if shortfall(shape, free)]


def known() -> set[str]:
    """Every actor and placement group the cluster knows now."""
    import ray

    return set(ray._private.state.state.actor_table(None)) | set(ray.util.placement_group_table())


def check_placeable(app: str, needs: dict[str, float]) -> bool:
    """Raise when the whole cluster could never hold `needs`; returns whether what is free now holds them."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    if lacking := shortfall(needs, total):
        raise AerieError(
            f"backend {app} can never be placed: its workers need {fmt_resources(needs)}, the whole cluster has "
            f"{fmt_resources(total)} (short of {fmt_resources(lacking)}): lower the workers' resources or add nodes"
        )
    return not shortfall(needs, free)


class PlacementWatch:
    """While backend `app` starts: after `timeout_s`, actors or placement groups of it still waiting for resources
    nobody has free fail the start, naming what they lack; workers that hold their resources and are still
    starting are waited for."""

    def __init__(self, app: str, needs: dict[str, float], timeout_s: float) -> None:
        self.app, self.needs, self.timeout_s = app, needs, timeout_s
        self.before = known()

    def not_created(self) -> dict[str, str]:
        """Its actors and placement groups not created yet."""
        return {k: v for k, v in pending().items() if k not in self.before}

    def check(self, elapsed: float) -> None:
        """Raise once `timeout_s` has passed with some of it waiting for resources nobody has free."""
        import ray

        if elapsed < self.timeout_s:
            return
        if (unplaced := self.not_created()) and (lacking := demand_beyond_free()):
            raise AerieError(
                f"backend {self.app} could not be placed within {self.timeout_s:g} s: its workers need "
                f"{fmt_resources(self.needs)} ({', '.join(sorted(set(unplaced.values())))} waiting for "
                f"{', '.join(fmt_resources(x) for x in lacking)}), the cluster has "
                f"{fmt_resources(ray.available_resources())} free of {fmt_resources(ray.cluster_resources())}: "
                "free resources (lower target.num_cpus / draft.num_cpus, stop a backend) or add nodes, or "
                "raise placement_timeout_s where nodes are added on demand"
            )


def failure_reason(status) -> str:
    """What Serve says went wrong with an application: its message ("Failed to update the deployments [...]") and,
    for each deployment that says more, the last line of that (the exception a replica's constructor raised)."""
    if status is None:
        return "not found"
    reasons = [status.message] if status.message else []
    for name, deployment in (getattr(status, "deployments", None) or {}).items():
        lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        if lines:
            reasons.append(f"{name}: {lines[-1]}")
    return " ".join(reasons) or "no reason given"


def wait_running(app: str, timeout_s: float, tick=None) -> None:
    """Until Serve reports `app` RUNNING (`tick(elapsed_s)` every second meanwhile); a failed deploy raises."""
    from ray import serve

    began = time.monotonic()
    while True:
        status = serve.status().applications.get(app)
        state = str(status.status) if status else "MISSING"
        if state.endswith("RUNNING"):
            return
        if state.endswith(("DEPLOY_FAILED", "UNHEALTHY")) or time.monotonic() - began > timeout_s:
            raise AerieError(f"backend {app} did not come up ({state}): {failure_reason(status)[-500:]}")
        if tick is not None:
            tick(time.monotonic() - began)
        time.sleep(1)
