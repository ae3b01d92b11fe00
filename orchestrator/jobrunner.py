"""What every `python -m jobs.X --config FILE [key=value ...]` entrypoint shares: config loading, one-line
user errors, and writing `result.json`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from orchestrator.config import StrictModel, load_config
from orchestrator.errors import AerieError
from orchestrator.redaction import redact_text

C = TypeVar("C", bound=StrictModel)


def init_ray(address: str | None = None) -> None:
    """Connect to `address` (or RAY_ADDRESS, as `ray job submit` sets it); otherwise start a local Ray bound
    to loopback, which needs no other address."""
    import ray

    if ray.is_initialized():
        return
    if starts_private_ray(address):
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def starts_private_ray(address: str | None = None) -> bool:
    """Whether `init_ray(address)` would start this process's own Ray (nobody else can reach it)."""
    import ray

    return not (ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"))


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


def connect_to_running_cluster(address: str | None = None) -> None:
    """For jobs that change a running deployment: connect to `address`, else RAY_ADDRESS, else the Ray that
    `aerie serve` started on this machine. Never a private Ray: a deployment made there would die with the
    job. None running: an AerieError saying how to start one or name it."""
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or _noted_local_cluster()
    if target is None:
        raise AerieError(
            "no running cluster to deploy to: start the server first (`aerie serve --config "
            "configs/smollm2-135m/serve.yaml`), or set RAY_ADDRESS=HEAD:6379 (or address=...) for a cluster"
        )
    try:
        ray.init(address=target, log_to_driver=False)
    except ConnectionError as err:
        raise AerieError(f"the Ray cluster at {target} does not answer ({err}): is it running?") from err


def interrupt_on_sigterm() -> None:
    """SIGTERM (`ray job stop`, `kill`, a service manager) unwinds this process as Ctrl-C does."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)


def write_result(output_dir: str | Path, result: dict) -> Path:
    path = Path(output_dir) / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def run_job(description: str, config_cls: type[C], body: Callable[[C], int], argv: list[str] | None = None) -> int:
    """Parse `--config FILE key=value ...`, validate, run `body(config)`. A user error: one line, exit 2."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return body(load_config(config_cls, args.config, args.overrides))
    except AerieError as err:
        print(f"error: {redact_text(str(err))}", file=sys.stderr)
        return 2
