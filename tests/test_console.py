"""The console and the stage logs: while a stage log is open, what engines print (a child process's stdout and
stderr, a library's print, a foreign logger's INFO) goes to the file, while the stage line, the bar and the
project's warnings reach the terminal; everything is restored after, also after an exception."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import console
from orchestrator.console import stage_log

REPO = Path(__file__).resolve().parents[1]

JOB = """
import logging, subprocess, sys
from pathlib import Path
from orchestrator.console import bar, say, stage_log

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as jobs.run_job does
log = Path(sys.argv[1])
print("before the stage", flush=True)
with stage_log(log):
    say("collect: 3 answers (log: collect.log)")
    engine = "import sys; print('engine stdout'); print('engine stderr', file=sys.stderr)"
    subprocess.run([sys.executable, "-c", engine], check=True)
    print("a library's print")
    logging.getLogger("vllm.engine").info("engine info")
    logging.getLogger("orchestrator.data.collect").warning("a warning for a person")
    logging.getLogger("orchestrator.data.collect").info("detail for the log")
    with bar(total=3, desc="answers", unit="answer") as answers:
        answers.update(3)
try:
    with stage_log(log):
        print("the engine before it failed")
        raise ValueError("engine died")
except ValueError:
    pass
print("after the stages", flush=True)
logging.getLogger("vllm.engine").info("info after the stages")
"""


def test_the_engines_output_goes_to_the_log_and_the_persons_to_the_terminal(tmp_path):
    log = tmp_path / "logs" / "collect.log"
    proc = subprocess.run(
        [sys.executable, "-c", JOB, str(log)], capture_output=True, text=True, timeout=120, cwd=REPO, check=True
    )
    assert proc.stdout == "before the stage\ncollect: 3 answers (log: collect.log)\nafter the stages\n"
    assert "WARNING orchestrator.data.collect: a warning for a person" in proc.stderr
    assert "answers: 100%" in proc.stderr and "3/3" in proc.stderr
    assert "INFO vllm.engine: info after the stages" in proc.stderr  # logging goes back to the terminal
    written = log.read_text()
    for line in ["engine stdout", "engine stderr", "a library's print", "INFO vllm.engine: engine info"]:
        assert line in written and line not in proc.stdout + proc.stderr, line
    assert "INFO orchestrator.data.collect: detail for the log" in written
    assert "WARNING orchestrator.data.collect: a warning for a person" in written
    assert "collect: 3 answers (log: collect.log)" in written  # the stage line, for context
    assert "the engine before it failed" in written and "ValueError: engine died" in written  # its traceback
    assert "engine died" not in proc.stderr and "100%" not in written  # the bar stays on the terminal
    assert "before the stage" not in written and "after the stages" not in written
    assert written.count("collect.log opened") == 2  # appended to, not overwritten


def _fds() -> list[tuple[int, int]]:
    return [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)]


def test_stage_logs_nest_and_everything_is_restored_after_an_exception(tmp_path):
    before, handlers = _fds(), list(logging.getLogger("orchestrator").handlers)
    outer, inner = tmp_path / "pipeline.log", tmp_path / "train.log"
    with pytest.raises(KeyboardInterrupt), stage_log(outer):
        os.write(1, b"between the stages\n")
        with stage_log(inner):
            os.write(2, b"ray train output\n")
            raise KeyboardInterrupt
    assert _fds() == before
    assert logging.getLogger("orchestrator").handlers == handlers
    assert console.stdout() is sys.stdout and console.stderr() is sys.stderr
    assert "between the stages" in outer.read_text() and "ray train" not in outer.read_text()
    assert "ray train output" in inner.read_text() and "KeyboardInterrupt" in inner.read_text()
    assert "KeyboardInterrupt" in outer.read_text()  # it went through both


def test_outside_a_stage_log_the_console_is_stdout_and_stderr(capsys):
    console.say("a line")
    with console.bar(total=1, desc="work") as b:
        b.update()
    out, err = capsys.readouterr()
    assert out == "a line\n" and "work: 100%" in err


@pytest.mark.parametrize("in_stage", [True, False])
def test_bars_draw_on_a_terminal_that_says_it_has_no_size(tmp_path, in_stage):
    """A pseudo-terminal nobody sized (`script`, `docker run -t` without a screen) reports 0 x 0: tqdm sized to it
    drew empty lines (a fresh clone's `make pipeline` under `script` showed no bar at all)."""
    import pty

    job = (
        "import sys\nfrom pathlib import Path\nfrom orchestrator.console import bar, stage_log\n"
        "import contextlib\n"
        f"ctx = stage_log(Path(sys.argv[1])) if {in_stage} else contextlib.nullcontext()\n"
        "with ctx, bar(total=3, desc='answers', unit='answer') as b:\n    b.update(3)\n"
    )
    main, terminal = pty.openpty()  # a new pseudo-terminal is 0 x 0 until someone sets its size
    assert os.get_terminal_size(terminal).columns == 0
    try:
        proc = subprocess.run(
            [sys.executable, "-c", job, str(tmp_path / "stage.log")],
            stdout=subprocess.DEVNULL,
            stderr=terminal,
            timeout=120,
            cwd=REPO,
            check=True,
        )
        assert proc.returncode == 0
        os.close(terminal)
        terminal = -1
        shown = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the other end is closed: everything is read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(main)
        if terminal >= 0:
            os.close(terminal)
    assert b"answers: 100%" in shown and b"3/3" in shown
