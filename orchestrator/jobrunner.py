"""What every `python -m jobs.X --config FILE [key=value ...]` entrypoint shares: config loading, one-line
user errors, SIGTERM as an interrupt, and writing `result.json`. Connecting to Ray: `orchestrator.cluster`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from orchestrator.config import StrictModel, load_config
from orchestrator.errors import AerieError
from orchestrator.redaction import redact_text

C = TypeVar("C", bound=StrictModel)


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
