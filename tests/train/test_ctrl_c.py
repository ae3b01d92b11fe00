"""Ray Train's fit() leaves its own SIGINT handler installed; training puts the one from before back, so a
Ctrl-C during a later pipeline stage still stops the job."""

from __future__ import annotations

import signal

import pytest

from orchestrator.train.run import _ctrl_c_restored


def test_the_sigint_handler_from_before_fit_comes_back_even_after_an_error():
    before = signal.getsignal(signal.SIGINT)
    with _ctrl_c_restored():
        signal.signal(signal.SIGINT, lambda *_: None)  # what Ray Train's fit() does
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(RuntimeError), _ctrl_c_restored():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise RuntimeError("training failed")
    assert signal.getsignal(signal.SIGINT) is before
