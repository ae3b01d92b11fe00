"""The OpenAI-compatible request/response surface: pydantic request models, error bodies, SSE chunks.

Requests are validated here, before anything is allocated for them; every user mistake (a field out of
range, a seed torch cannot take, a content part without text, ...) becomes HTTP 400 with OpenAI's error body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator.spec.sampling import SamplingParams


class RequestError(Exception):
    """A request the server refuses: HTTP status + OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class _Common(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI's, plus vLLM's `top_k` and `ignore_eos`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM extension; 0 or -1 = all")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (their ranges are checked there: a bad one is a 400 naming it)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=max(0, self.top_k),
                seed=self.seed,
                stop=tuple(self.stop or ()),
                ignore_eos=self.ignore_eos,
            )
        except ValidationError as err:
            raise _request_error(err) from err

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        for i, part in enumerate([] if isinstance(v, str) else v):
            if part.get("type") != "text":
                raise ValueError(f"part {i}: only text content parts are supported, not {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part needs a string 'text'")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def chat(self) -> list[dict]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]

    def prompt_value(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise RequestError("a list of several prompts is not supported: send one request per prompt", "prompt")
            return self.prompt[0]
        if not self.prompt:
            raise RequestError("prompt is empty", "prompt")
        return self.prompt


def parse(model: type[BaseModel], body) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise _request_error(err) from err


def _request_error(err: ValidationError) -> RequestError:
    """The first problem of a validation error, as a 400 naming the field."""
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    missing = e["type"] == "missing"
    return RequestError(f"'{loc}' is a required property" if missing else f"{loc}: {e['msg']}", loc)


class Chunker:
    """OpenAI response objects and SSE chunks for one request."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _wrap(self, choices: list[dict], obj: str, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def response(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._wrap([choice], self.object, usage)

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return sse(self._wrap([choice], "chat.completion.chunk"))
        return sse(
            self._wrap(
                [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}], "text_completion"
            )
        )

    def usage_chunk(self, usage: dict) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._wrap([], obj, usage))


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
