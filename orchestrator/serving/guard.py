"""Who may call a server and how much one replica takes on: one ASGI middleware in front of every application
(the disaggregated backend, the vLLM backend and the router).

    request ──> Guard: /health? ──yes──> the application (always open: probes carry no key)
                  │ no
                  ├─ Authorization: Bearer KEY, compared in constant time with every key ──no──> 401
                  ├─ body larger than max_body_bytes (Content-Length, or counted as it arrives) ──> 413
                  ├─ max_in_flight requests already in this replica ──> 429 with Retry-After
                  ├─ check(path, body): the OpenAI surface, for an application that does not check it itself ──> 4xx
                  └─> the application (the body replayed)

API keys come from the environment of the process that serves, never from a config value or a flag:
`AERIE_API_KEY` (one key, or several separated by commas: rotate by adding the new one first), or
`AERIE_API_KEY_FILE` (a file with one key per line: a Kubernetes Secret mounted as a file), or else the key
file `aerie serve` writes for a server on this machine (`~/.config/aerie/api-key`). Clients send the key as
`Authorization: Bearer KEY` (the openai client: `OPENAI_API_KEY`); the project's own clients (benchmarks,
rollouts, tests) read it from the same places (`auth_headers`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from orchestrator.errors import AerieError
from orchestrator.serving.protocol import RequestError

API_KEY_ENV = "AERIE_API_KEY"
API_KEY_FILE_ENV = "AERIE_API_KEY_FILE"
MIN_KEY_CHARS = 16
OPEN_PATHS = frozenset({"/health"})


def default_key_file() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "aerie" / "api-key"


def api_keys() -> list[str]:
    """The keys this process accepts (or sends: the first); AerieError when none is configured."""
    keys = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    path = os.environ.get(API_KEY_FILE_ENV)
    if path is None and not keys and default_key_file().is_file():
        path = default_key_file()
    if path:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise AerieError(f"{API_KEY_FILE_ENV}: cannot read the API key file {path} ({err.strerror})") from err
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise AerieError(
            f"no API key: set {API_KEY_ENV} or {API_KEY_FILE_ENV} (a file with one key per line) where the "
            f"server and its clients run, or start a local server with `aerie serve` (it writes {default_key_file()})"
        )
    if any(len(k) < MIN_KEY_CHARS for k in keys):
        raise AerieError(
            f"an API key has fewer than {MIN_KEY_CHARS} characters: use a random one (`openssl rand -hex 24`)"
        )
    return keys


def keys_for_servers(private_ray: bool) -> Path | None:
    """Before a job deploys servers it then calls: on its own private Ray (nobody else can reach it) a missing
    key is made as `aerie serve` makes it, and the written file returned; on a cluster one must be configured.
    AerieError (one line) when there is none, before anything is deployed."""
    written = ensure_local_key() if private_ray else None
    api_keys()
    return written


def ensure_local_key() -> Path | None:
    """For a server on this machine: when no key is configured, write a random one to the default key file
    (readable by this user only) and return its path; None when a key is configured already."""
    if os.environ.get(API_KEY_ENV) or os.environ.get(API_KEY_FILE_ENV) or default_key_file().is_file():
        return None
    path = default_key_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def auth_headers() -> dict[str, str]:
    """The Authorization header of the project's own clients."""
    return {"Authorization": f"Bearer {api_keys()[0]}"}


def key_id(key: str) -> str:
    """A key's id for configs and logs (16 hex digits of its sha256): names the key without revealing it."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def authorized(header: str | None, keys: list[str]) -> bool:
    """Whether an Authorization header carries one of `keys` (every key compared, each in constant time)."""
    scheme, _, token = (header or "").partition(" ")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token.strip().encode(), key.encode())
    return ok and scheme.lower() == "bearer"


class Guard:
    """ASGI middleware: `app.add_middleware(Guard, max_body_bytes=..., max_in_flight=..., check=...)`.

    `check(path, body)` runs for POST bodies before the application sees them: it raises `RequestError` to
    refuse one, or returns the body the application gets instead (None: the same). `max_in_flight` counts
    the requests inside this replica (a streamed response counts until its end). Keys are read when the
    middleware is built, in the serving process (the first request).
    """

    def __init__(
        self,
        app,
        max_body_bytes: int = 4 << 20,
        max_in_flight: int | None = None,
        check: Callable[[str, bytes], bytes | None] | None = None,
    ) -> None:
        self.app, self.max_body_bytes, self.max_in_flight, self.check = app, max_body_bytes, max_in_flight, check
        self.keys = api_keys()
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            if not authorized(headers.get("authorization"), self.keys):
                raise RequestError.of(
                    "invalid_api_key",
                    "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                    headers={"www-authenticate": "Bearer"},
                )
            if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
                raise RequestError.of(
                    "queue_full",
                    f"this replica holds {self.in_flight} requests (its limit): retry shortly",
                    headers={"retry-after": "1"},
                )
            self.in_flight += 1
        except RequestError as err:
            return await _reply(send, err)
        try:
            body = await self._body(headers, receive) if scope["method"] == "POST" else None
            if body is not None and self.check is not None:
                checked = self.check(path, body)
                if checked is not None and checked != body:
                    body, scope = checked, _with_length(scope, len(checked))
        except RequestError as err:
            self.in_flight -= 1
            return await _reply(send, err)
        try:
            await self.app(scope, _replay(body, receive) if body is not None else receive, send)
        finally:
            self.in_flight -= 1

    async def _body(self, headers: dict[str, str], receive) -> bytes:
        too_large = RequestError.of("body_too_large", f"the request body is larger than {self.max_body_bytes} bytes")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestError.of("client_disconnected", "the client disconnected")  # nobody reads the answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _with_length(scope: dict, length: int) -> dict:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect

    return replay


async def _reply(send, err: RequestError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
