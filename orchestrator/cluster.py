"""The Ray cluster as this project meets it: which one (the only place RAY_ADDRESS is read), connecting to it,
and the resources a worker actor asks of it. Jobs, the server and library code all connect through here.

    configured_address(address)      address, else RAY_ADDRESS, else None
    init_ray(address)                that cluster, else a private Ray on loopback (a job's own)
    connect_to_running_cluster(a)    that cluster, else the Ray `aerie serve` started here; never a private one
    ray_logs_dir()                   where the connected Ray keeps its workers' logs (never streamed to the driver)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import Field

from orchestrator.config import StrictModel
from orchestrator.errors import AerieError
from orchestrator.models.device import DeviceName, device_name


def configured_address(address: str | None = None) -> str | None:
    """The cluster named by `address`, else by RAY_ADDRESS (what `ray job submit` sets); None: none named."""
    return address or os.environ.get("RAY_ADDRESS") or None


def init_ray(address: str | None = None) -> None:
    """Connect to the configured cluster; without one, start a private Ray bound to loopback."""
    import ray

    if ray.is_initialized():
        return
    if starts_private_ray(address):
        _start_private_ray()
    else:
        ray.init(address=configured_address(address), log_to_driver=False)


def _start_private_ray() -> None:
    """A new Ray on loopback with its own dashboard, which its processes' state API asks (RAY_API_SERVER_ADDRESS
    in their environment). Without both, Ray finds the cluster `ray start` last noted on this machine instead: a
    bare `ray.init()` joins it (and ends with it), and Ray Train's placement-group cleaner, not finding its
    controller there, removes the training's placement group (seen: a training killed when a test head started)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = os.environ.get("RAY_API_SERVER_ADDRESS")
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"  # inherited by the raylet and its workers
    try:
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=port,
            log_to_driver=False,
        )
    finally:  # this process's own later clients (`ray job submit --address`, other clusters) are not redirected
        if before is None:
            os.environ.pop("RAY_API_SERVER_ADDRESS", None)
        else:
            os.environ["RAY_API_SERVER_ADDRESS"] = before


def ray_logs_dir() -> str | None:
    """Where the Ray this process is connected to keeps its workers' logs (workers, Ray Train, Ray Serve:
    `init_ray` does not stream them to the driver), or None while not connected."""
    import ray

    if not ray.is_initialized():
        return None
    from ray._private import worker

    node = worker._global_node
    return node.get_logs_dir_path() if node is not None else None


def starts_private_ray(address: str | None = None) -> bool:
    """Whether `init_ray(address)` would start this process's own Ray (nobody else can reach it)."""
    import ray

    return not (ray.is_initialized() or configured_address(address))


def local_cluster_file() -> Path:
    """Where `aerie serve` notes the address of the Ray it started on this machine (removed when it exits)."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "aerie" / "ray-address.json"


def note_local_cluster() -> None:
    """`aerie serve`, having started a local Ray: tell this machine's jobs where it is, until it exits."""
    import atexit

    import ray

    path = local_cluster_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    noted = {
        "address": ray.get_runtime_context().gcs_address,
        "pid": os.getpid(),
        "auth_mode": os.environ.get("RAY_AUTH_MODE", "disabled"),  # a new local Ray turns token auth on itself
    }
    path.write_text(json.dumps(noted) + "\n")
    atexit.register(lambda: path.unlink(missing_ok=True))


def _noted_local_cluster() -> str | None:
    """The address `aerie serve` noted, if it still runs; this process then speaks its auth mode (the token
    itself is the user's, in ~/.ray/auth_token)."""
    try:
        noted = json.loads(local_cluster_file().read_text())
        os.kill(noted["pid"], 0)  # the `aerie serve` that started it still runs
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if noted.get("auth_mode") == "token" and "RAY_AUTH_MODE" not in os.environ:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()  # RAY_AUTH_MODE=token, and Ray's configuration (read at import) refreshed
    return noted["address"]


def connect_to_running_cluster(address: str | None = None) -> str:
    """For jobs that change a running deployment: connect to the configured cluster, else the Ray that `aerie
    serve` started on this machine; returns its address. Never a private Ray: a deployment made there would die
    with the job. None running: an AerieError saying how to start one or name it."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    target = configured_address(address) or _noted_local_cluster()
    if target is None:
        raise AerieError(
            "no running cluster to deploy to: start the server first (`aerie serve --config "
            "configs/smollm2-135m/serve.yaml`), or set RAY_ADDRESS=HEAD:6379 (or address=...) for a cluster"
        )
    try:
        ray.init(address=target, log_to_driver=False)
    except ConnectionError as err:
        raise AerieError(f"the Ray cluster at {target} does not answer ({err}): is it running?") from err
    return target


# Ray's own resource of the head node (Ray Train puts its state actor there the same way): the control plane,
# which lives as long as the cluster, so that losing a worker node never takes the router with it.
HEAD_NODE = {"node:__internal_head__": 0.001}


class Placement(StrictModel):
    """Where an actor may run: custom resources it takes and node labels it needs."""

    resources: dict[str, float] = Field({}, description="custom resources, e.g. {draft: 1} for the draft node group")
    label_selector: dict[str, str] = Field({}, description="Ray node labels it must run on, e.g. {aerie/group: target}")

    def placement_options(self) -> dict:
        """The `resources` and `label_selector` options of an actor (or a Serve replica's ray_actor_options)."""
        opts: dict = {"resources": self.resources} if self.resources else {}
        return opts | ({"label_selector": self.label_selector} if self.label_selector else {})


class WorkerResources(Placement):
    """What a worker actor reserves on the cluster, where it may run, and how it computes: one model for the
    capture workers and the serving workers."""

    num_cpus: float = Field(1.0, ge=0, description="logical CPUs reserved")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved")
    device: DeviceName = Field("auto", description="auto: CUDA when the worker has a GPU, else the CPU")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's)")
    env_vars: dict[str, str] = Field({}, description="environment of the worker process, e.g. GOMP_SPINCOUNT")

    def torch_device(self) -> str:
        """The worker's torch device: `device`, where auto means its GPU when it reserves one."""
        return device_name(self.device, self.num_gpus)

    def bundle(self, devices: int = 1) -> dict[str, float]:
        """The placement-group bundle of a worker spanning `devices` of these (tensor parallelism)."""
        out = {"CPU": self.num_cpus * devices, "GPU": self.num_gpus * devices, **self.resources}
        return {k: v for k, v in out.items() if v > 0} or {"CPU": 0.001}

    def actor_options(self, devices: int = 1, **extra) -> dict:
        """`ray.remote(...).options(...)` of such a worker (spanning `devices`), plus `extra`."""
        opts: dict = dict(num_cpus=self.num_cpus * devices, num_gpus=self.num_gpus * devices)
        if self.env_vars:
            opts["runtime_env"] = {"env_vars": self.env_vars}
        return opts | self.placement_options() | extra
