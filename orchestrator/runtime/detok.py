"""Output text of a request, released as tokens arrive, with stop strings (the one stop-string check: the
server and the in-process engine both read their requests through `SpecScheduler.text_events`).

Text is released only when it is final: not ending inside a multi-byte character (the tokenizer's U+FFFD)
and not possibly the start of a stop string. When a stop string appears, the text is cut before it and the
token ids after the one that completed it are dropped.

    stop ["\\n\\n"]: tokens "Hi", "\\n", "\\nthere" -> deltas "Hi", "" (held: may start a stop), then stop

Without a tokenizer (and without stop strings) it only collects token ids.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer=None, stop: tuple[str, ...] | list[str] = ()) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly released text (sets `stopped` when a stop string matched)."""
        before = len(self.ids)
        self.ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        full = self._decode(self.ids)
        hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            for n in range(before + 1, len(self.ids) + 1):  # the first token that completes a stop string
                if any(s in self._decode(self.ids[:n]) for s in self.stop):
                    del self.ids[n:]
                    break
            return self._release(full[: min(hits)])
        safe = full.rstrip("\ufffd")
        hold = max((len(s) - 1 for s in self.stop), default=0)
        for n in range(min(hold, len(safe)), 0, -1):  # keep back a tail that may begin a stop string
            if any(s.startswith(safe[-n:]) for s in self.stop):
                safe = safe[:-n]
                break
        return self._release(safe)

    def finish(self) -> str:
        """Everything still held back (the request ended without a stop string)."""
        if self.stopped:
            return ""
        return self._release(self._decode(self.ids))

    def _release(self, text: str) -> str:
        if len(text) < len(self.text) or not text.startswith(self.text):
            return ""  # a re-tokenisation changed earlier text: keep what was sent (rare, never for ASCII)
        delta, self.text = text[len(self.text) :], text
        return delta
