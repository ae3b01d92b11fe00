"""What a person watching a job sees, and the log file that takes everything else while a stage runs.

    with stage_log(Path("runs/pipeline/smollm2/logs/collect.log")):
        ...                          # the engines' output -> collect.log
        say("collect: 120 answers")  # -> the terminal (and collect.log)
        with bar(total=120, desc="answers", unit="answer") as answers:   # a tqdm bar on the terminal
            ...
        log.warning("...")           # from an `orchestrator.*` logger -> the terminal too (and collect.log)

While a stage log is open, file descriptors 1 and 2 point at its file. That one mechanism catches every writer:
vLLM's logging handler (bound to sys.stdout when vLLM was imported) and its EngineCore subprocess (which inherits
the descriptors), Ray's driver-side messages and the processes it starts, transformers' and torch's warnings,
MLflow's chatter, and whatever a C extension prints. Python-level redirection would miss the subprocesses and the
handlers that hold the old stream objects. The terminal stays reachable through duplicates of the original
descriptors, taken when the outermost stage log opens; `say`, `bar` and the warnings of `orchestrator.*` loggers
write there. Stage logs nest (the pipeline's own log around each stage's) and every descriptor and handler is
restored when one closes, also on an exception, whose traceback is written to the file.

Outside every stage log (a job run on its own) `say` prints to stdout and `bar` draws on stderr, as usual.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

WARNING_LOGGER = "orchestrator"  # its records at WARNING and above reach the terminal during a stage


@dataclass
class _Terminal:
    """The terminal while stage logs are open: streams on duplicates of fds 1 and 2 (or the streams themselves
    where they never wrote to those fds, as under pytest's capture), and the warnings' handler."""

    out: TextIO
    err: TextIO
    handler: logging.Handler
    owned: list[TextIO] = field(default_factory=list)


_terminal: _Terminal | None = None
_logs: list[TextIO] = []  # the open stage logs, innermost last


def stdout() -> TextIO:
    """Where lines for a person go: the terminal's stdout, also inside a stage log."""
    return _terminal.out if _terminal is not None else sys.stdout


def stderr() -> TextIO:
    """Where bars and warnings for a person go: the terminal's stderr, also inside a stage log."""
    return _terminal.err if _terminal is not None else sys.stderr


def say(text: str) -> None:
    """One line on the terminal (bars cleared and redrawn around it), and in the open stage log."""
    _write(stdout(), text + "\n")
    if _logs:
        sys.stdout.flush()
        sys.stderr.flush()
        _logs[-1].write(text + "\n")
        _logs[-1].flush()


def bar(**kwargs) -> tqdm:
    """A tqdm bar on the terminal (tqdm's arguments): as wide as the terminal, or `FALLBACK_SIZE` where the
    terminal says it has no size (a pseudo-terminal nobody sized, as `script` or `docker run -t` without a
    screen make: tqdm then draws an empty line)."""
    stream = stderr()
    size = {"dynamic_ncols": True} if _columns(stream) != 0 else {"ncols": FALLBACK_SIZE[0], "nrows": FALLBACK_SIZE[1]}
    return tqdm(**{"file": stream, **size, **kwargs})


FALLBACK_SIZE = (100, 40)  # columns, rows (tqdm hides a bar below the screen's last row: 0 rows hide them all)


def _columns(stream: TextIO) -> int | None:
    """The width of the terminal `stream` writes to; None where it is not a terminal."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def _write(stream: TextIO, text: str) -> None:
    with tqdm.external_write_mode(file=stderr()):  # the bars: on the terminal's stderr
        stream.write(text)
        stream.flush()


class _TerminalHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            _write(stderr(), self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def _on_terminal(stream: TextIO, fd: int) -> tuple[TextIO, bool]:
    """`stream` as it reaches the terminal once `fd` points elsewhere: a stream on a duplicate of `fd` when it
    writes there, else the stream itself; and whether the returned stream is a new one (to close)."""
    try:
        if stream.fileno() == fd:
            dup = os.fdopen(os.dup(fd), "w", buffering=1, encoding=stream.encoding or "utf-8", errors="replace")
            return dup, True
    except (AttributeError, OSError, ValueError):  # no fileno: pytest's capture, a notebook
        pass
    return stream, False


def _open_terminal() -> _Terminal:
    (out, own_out), (err, own_err) = _on_terminal(sys.stdout, 1), _on_terminal(sys.stderr, 2)
    handler = _TerminalHandler(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger(WARNING_LOGGER).addHandler(handler)
    owned = [s for s, own in ((out, own_out), (err, own_err)) if own]
    return _Terminal(out, err, handler, owned)


def _close_terminal(terminal: _Terminal) -> None:
    logging.getLogger(WARNING_LOGGER).removeHandler(terminal.handler)
    for stream in terminal.owned:
        stream.close()


@contextmanager
def stage_log(path: Path) -> Iterator[Path]:
    """Send this process's fds 1 and 2 (and so every process it starts) to `path`, appended to, until the block
    ends; `say`, `bar` and `orchestrator.*` warnings still reach the terminal. An exception's traceback goes to
    the file, and the exception on."""
    global _terminal
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("a", buffering=1, encoding="utf-8", errors="replace")
    log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {path.name} opened\n")
    log.flush()
    outermost = _terminal is None
    if outermost:
        _terminal = _open_terminal()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        _logs.append(log)
        try:
            yield path
        except BaseException:
            sys.stdout.flush()
            sys.stderr.flush()
            log.write(traceback.format_exc())
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        if _logs and _logs[-1] is log:
            _logs.pop()
        log.close()
        if outermost:
            terminal, _terminal = _terminal, None
            _close_terminal(terminal)
