"""Output text of a request, released as tokens arrive, with stop strings (the one stop-string check: the
server and the in-process engine both read their requests through `SpecScheduler.text_events`).

Each token costs the same however long the output is: the tokenizer decodes only a window of the last few
tokens (`Incremental`, vLLM's prefix/read offsets), and stop strings are searched only in the text not yet
released (at most the longest stop string). Text is released only when it is final: not ending inside a
multi-byte character (the tokenizer's U+FFFD) and not possibly the start of a stop string. When a stop string
appears, the text is cut before it and the token ids after the one that completed it are dropped.

    stop ["\\n\\n"]: tokens "Hi", "\\n", "\\nthere" -> deltas "Hi", "" (held: may start a stop), then stop

Without a tokenizer (and without stop strings) it only collects token ids.
"""

from __future__ import annotations

# A UTF-8 character spans at most 4 bytes: a byte-level tokenizer may need 4 tokens to complete one. A window
# still ending inside a character after that many tokens is released as decoded (with U+FFFD, as a full decode).
_MAX_PENDING_TOKENS = 4


class Incremental:
    """The text of a growing list of token ids, a delta per step, decoding a window of a few tokens each time.

    `prefix..read` are tokens whose text was released (decoded again only as context, so that a token's text
    that depends on its left neighbour, such as a leading space, comes out as in a full decode); `read..` are
    new. The concatenated deltas equal `tokenizer.decode(ids)` for the tokenizers used here (checked in tests).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix = self.read = 0
        self.prefix_text = ""
        self.unfinished = ""  # the text so far of tokens held for an incomplete character (without the U+FFFD)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, ids: list[int], final: bool = False) -> str:
        """New text of `ids` (the whole list so far); "" while its end may still be an incomplete character."""
        if self.read == len(ids):
            return ""
        text = self._decode(ids[self.prefix :])
        delta = text[len(self.prefix_text) :]
        if text.endswith("\ufffd") and not final and len(ids) - self.read < _MAX_PENDING_TOKENS:
            self.unfinished = delta.rstrip("\ufffd")
            return ""
        self.unfinished = ""
        self.prefix, self.read = self.read, len(ids)
        self.prefix_text = self._decode(ids[self.prefix : self.read])
        return delta


class TextStream:
    def __init__(self, tokenizer=None, stop: tuple[str, ...] | list[str] = ()) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.stop = tuple(stop)
        self.decoder = Incremental(tokenizer) if tokenizer is not None else None
        self.hold = max((len(s) - 1 for s in self.stop), default=0)  # the longest tail that may begin a stop
        self.ids: list[int] = []
        self.parts: list[str] = []  # released so far
        self.pending = ""  # decoded, held back (may begin a stop string)
        self.stopped = False

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self.parts)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly released text (sets `stopped` when a stop string matched)."""
        out = []
        for token in token_ids:
            if self.stopped:
                break
            self.ids.append(token)
            if self.decoder is not None:
                out.append(self._release(self.decoder.step(self.ids)))
        return self._emit(out)

    def finish(self) -> str:
        """Everything still held back (the request ended without a stop string)."""
        if self.stopped or self.decoder is None:
            return ""
        text = self.pending + self.decoder.step(self.ids, final=True)
        self.pending = ""
        return self._emit([text])

    def _release(self, delta: str) -> str:
        """What of the held text and `delta` can go out now; sets `stopped` at a stop string."""
        buf = self.pending + delta  # a stop string cannot start in text already released
        seen = buf + self.decoder.unfinished  # a stop string may end before a character that is not complete
        hits = [i for i in (seen.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return seen[: min(hits)]
        keep = 0
        for n in range(min(self.hold, len(buf)), 0, -1):
            if any(s.startswith(buf[-n:]) for s in self.stop):
                keep = n
                break
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def _emit(self, out: list[str]) -> str:
        delta = "".join(out)
        if delta:
            self.parts.append(delta)
        return delta
