"""The OpenAI-compatible request/response surface: pydantic request models, limits, error bodies, SSE chunks.

Requests are validated here, before anything is allocated for them; every user mistake (a field out of
range, a seed torch cannot take, a content part without text, a field this server does not implement, more
than the limits allow, ...) becomes a 4xx with OpenAI's error body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Both backends answer the same requests the same way: the disaggregated server validates with `check_request`
in its handlers, the vLLM backend in front of vLLM (`serving/guard.py`), so a field that one backend would
honour and the other drop is refused by both.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from orchestrator.config import StrictModel
from orchestrator.spec.sampling import SamplingParams


class HttpError(NamedTuple):
    """One kind of error answer: its HTTP status, OpenAI's error `type` and `code`, and when it happens."""

    status: int
    type: str
    code: str | None
    when: str


# Every error status the servers answer with (docs/reference/http.md is generated from this table). The Guard's, the
# handlers' and `check_request`'s refusals are `RequestError.of(NAME, ...)`; the scheduler's failures arrive as a
# status (`runtime/scheduler.py`, `runtime/workers.py`) and take the type of the first entry with that status.
ERRORS: dict[str, HttpError] = {
    "invalid_request": HttpError(
        400,
        "invalid_request_error",
        None,
        "a field out of range, unknown, not implemented, or over a limit; a body that is not a JSON object",
    ),
    "invalid_api_key": HttpError(
        401,
        "invalid_request_error",
        "invalid_api_key",
        "no `Authorization: Bearer KEY` header, or a key the server does not hold (every route but `/health`)",
    ),
    "model_not_found": HttpError(404, "invalid_request_error", "model_not_found", "`model` is not the served model"),
    "body_too_large": HttpError(
        413, "invalid_request_error", "body_too_large", "a body larger than `limits.max_body_bytes`"
    ),
    "queue_full": HttpError(
        429,
        "rate_limit_error",
        "queue_full",
        "the replica holds `scheduler.max_batch + limits.max_queued` requests already; `Retry-After: 1`",
    ),
    "client_disconnected": HttpError(
        499, "invalid_request_error", None, "the client left before its body arrived (nobody reads the answer)"
    ),
    "internal": HttpError(500, "server_error", None, "the scheduler failed on the request (a bug)"),
    "unavailable": HttpError(
        503,
        "server_error",
        None,
        "the target worker lost the request (retry it); `/health` while the target cannot admit work; "
        "the router with no backend taking traffic or the one drawn unreachable",
    ),
    "timeout": HttpError(504, "server_error", None, "the request ran past `scheduler.request_timeout_s`"),
}


class RequestError(Exception):
    """A request the server refuses: HTTP status + OpenAI error body (+ headers, e.g. Retry-After)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.headers = headers or {}

    @classmethod
    def of(
        cls, name: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> RequestError:
        """The error of kind `name` in ERRORS, with this message."""
        kind = ERRORS[name]
        return cls(message, param, kind.status, kind.type, kind.code, headers)

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def status_body(message: str, status: int) -> dict:
    """The error body of a failure that arrives as a status (the scheduler's): the type ERRORS gives that status."""
    kind = next((e for e in ERRORS.values() if e.status == status), ERRORS["internal"])
    return error_body(message, kind.type)


class Limits(StrictModel):
    """What one request may ask and how many a replica holds (the same for both backends)."""

    max_body_bytes: int = Field(4 << 20, ge=1024, description="larger bodies get 413")
    max_messages: int = Field(512, ge=1, description="messages in one chat request")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompt tokens (default: the model's context)")
    max_tokens: int = Field(4096, ge=1, description="the largest max_tokens a request may ask")
    max_stop: int = Field(4, ge=0, le=64, description="stop strings per request (OpenAI allows 4)")
    max_stop_chars: int = Field(256, ge=1, le=4096, description="characters per stop string")
    max_queued: int = Field(64, ge=0, description="requests a replica holds beyond its batch before answering 429")


# OpenAI (and vLLM) request fields this server does not implement, with the values that mean "not used". Any
# other value is a 400 naming the field; a field OpenAI does not know either is a 400 too (as OpenAI answers).
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
    "min_p": (None, 0),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


class _Common(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI's, plus vLLM's `top_k` and `ignore_eos`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(description="the served model's name; another is a 404")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="at most `limits.max_tokens` and the context left (none: the server's default_max_tokens)",
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: the smallest set with this mass")
    top_k: int = Field(0, ge=-1, description="vLLM extension; 0 or -1 = all")
    seed: int | None = Field(None, description="this request's sampling seed")
    stop: str | list[str] | None = Field(
        None, description="at most `limits.max_stop` strings of at most `limits.max_stop_chars` characters"
    )
    n: int = Field(1, ge=1, description="only 1: one request per completion")
    stream: bool = Field(False, description="answer as server-sent events")
    stream_options: dict | None = Field(None, description="only `include_usage`: a last chunk with the token counts")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS")
    user: str | None = Field(None, description="OpenAI's end-user id (not used)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v, info: ValidationInfo):
        limits = _limits(info)
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > limits.max_stop or any(not s for s in stops):
            raise ValueError(f"stop takes at most {limits.max_stop} non-empty strings")
        if any(len(s) > limits.max_stop_chars for s in stops):
            raise ValueError(f"a stop string has more than {limits.max_stop_chars} characters")
        return stops

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _max_tokens(cls, v, info: ValidationInfo):
        cap = _limits(info).max_tokens
        if v is not None and v > cap:
            raise ValueError(f"at most {cap} tokens per request on this server")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported: send one request per completion")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v):
        unknown = set(v or {}) - {"include_usage"}
        if unknown:
            raise ValueError(f"unsupported stream_options {sorted(unknown)} (only include_usage)")
        return v

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
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"] = Field(description="developer is read as system")
    content: str | list[dict] = Field(description='text, or text parts: [{"type": "text", "text": ...}]')

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
    messages: list[ChatMessage] = Field(min_length=1, description="at most `limits.max_messages`")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer max_tokens (wins over it)")

    @field_validator("messages")
    @classmethod
    def _count(cls, v, info: ValidationInfo):
        cap = _limits(info).max_messages
        if len(v) > cap:
            raise ValueError(f"at most {cap} messages per request on this server")
        return v

    def chat(self) -> list[dict]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(description="text, token ids, or a list of one text")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("a list of several prompts is not supported: send one request per prompt")
            v = v[0]
        if not v:
            raise ValueError("prompt is empty")
        return v


def parse(model: type[BaseModel], body, limits: Limits | None = None) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, value in body.items():
        if key in model.model_fields:
            continue
        if key not in UNSUPPORTED:
            raise RequestError(f"Unrecognized request argument supplied: {key}", key)
        if not any(type(value) is type(ok) and value == ok or value is ok for ok in UNSUPPORTED[key]):
            raise RequestError(f"{key} is not supported by this server (leave it out)", key)
    known = {k: v for k, v in body.items() if k in model.model_fields}
    try:
        return model.model_validate(known, context={"limits": limits or Limits()})
    except ValidationError as err:
        raise _request_error(err) from err


ENDPOINTS: dict[str, type[_Common]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}

# The routes both backends answer, by the name of the ingress method behind each on the vLLM backend (Ray Serve
# LLM's, which `vllm_ingress.py` exposes by these names) -> (HTTP method, path). `/health` is open (no API key).
ROUTES: dict[str, tuple[str, str]] = {
    "models": ("GET", "/v1/models"),
    "model_data": ("GET", "/v1/models/{model:path}"),
    "completions": ("POST", "/v1/completions"),
    "chat": ("POST", "/v1/chat/completions"),
    "health": ("GET", "/health"),
}


def check_request(path: str, body: bytes, limits: Limits, served: str | None = None) -> _Common | None:
    """The request to an OpenAI generation path (None for other paths), validated down to its sampling
    parameters and, given `served`, its model (404 otherwise): the one check both backends run."""
    model = ENDPOINTS.get(path)
    if model is None:
        return None
    try:
        data = json.loads(body)
    except ValueError as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from err
    req = parse(model, data, limits)
    req.sampling(1)  # the ranges of the sampling parameters
    if served is not None and req.model != served:
        raise RequestError.of(
            "model_not_found", f"The model `{req.model}` does not exist (this server serves `{served}`)", "model"
        )
    return req


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
