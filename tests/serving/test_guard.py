"""The Guard without Ray: keys, body size, the in-flight bound and the request check, over ASGI."""

from __future__ import annotations

import asyncio
import functools

import httpx
import pytest
from fastapi import FastAPI, Request

from orchestrator.errors import AerieError
from orchestrator.serving.guard import Guard, api_keys, authorized, ensure_local_key, keys_for_servers
from orchestrator.serving.protocol import Limits, check_request
from tests.helpers import API_KEY, AUTH


def _app(**guard) -> tuple[FastAPI, asyncio.Event]:
    release = asyncio.Event()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("wait"):
            await release.wait()
        return {"echo": body}

    app.add_middleware(Guard, **guard)
    return app, release


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_keys_come_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("AERIE_API_KEY", "k" * 16 + ", " + "j" * 20)
    assert api_keys() == ["k" * 16, "j" * 20]
    monkeypatch.delenv("AERIE_API_KEY")
    with pytest.raises(AerieError, match="no API key"):
        api_keys()
    key_file = tmp_path / "secret"
    key_file.write_text("# rotated 2026-11\n" + "a" * 32 + "\n\n")
    monkeypatch.setenv("AERIE_API_KEY_FILE", str(key_file))
    assert api_keys() == ["a" * 32]
    monkeypatch.setenv("AERIE_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(AerieError, match="cannot read"):
        api_keys()
    monkeypatch.delenv("AERIE_API_KEY_FILE")
    monkeypatch.setenv("AERIE_API_KEY", "short")
    with pytest.raises(AerieError, match="fewer than 16") as err:
        api_keys()
    assert "short" not in str(err.value)  # no key in an error message
    monkeypatch.delenv("AERIE_API_KEY")
    with pytest.raises(AerieError, match="no API key"):  # a job deploying on a cluster: configure one
        keys_for_servers(private_ray=False)
    written = keys_for_servers(private_ray=True)  # a job on its own Ray, or `aerie serve` on this machine
    assert written is not None and written.stat().st_mode & 0o077 == 0 and len(api_keys()[0]) >= 32
    assert ensure_local_key() is None and keys_for_servers(private_ray=True) is None  # kept, not replaced


def test_authorization_header_forms():
    keys = ["a" * 16, "b" * 16]
    assert authorized("Bearer " + "b" * 16, keys) and authorized("bearer " + "a" * 16, keys)
    for header in (None, "", "Bearer", "Bearer " + "a" * 15, "Basic " + "a" * 16, "a" * 16, "Bearer " + "a" * 17):
        assert not authorized(header, keys), header


def test_no_key_or_a_wrong_key_is_401_and_health_stays_open():
    app, _ = _app()

    async def main():
        async with _client(app) as c:
            assert (await c.get("/health")).status_code == 200
            for headers in ({}, {"Authorization": "Bearer " + "x" * 30}, {"Authorization": API_KEY}):
                r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert API_KEY not in r.text and r.headers["www-authenticate"] == "Bearer"
            r = await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            assert r.status_code == 200 and r.json()["echo"] == CHAT

    asyncio.run(main())


def test_bodies_over_the_limit_are_413_announced_or_streamed():
    app, _ = _app(max_body_bytes=1024)

    async def chunks():
        for _ in range(8):
            yield b" " * 200

    async def main():
        async with _client(app) as c:
            big = CHAT | {"pad": "x" * 2000}
            assert (await c.post("/v1/chat/completions", json=big, headers=AUTH)).status_code == 413
            r = await c.post("/v1/chat/completions", content=chunks(), headers=AUTH)  # no Content-Length
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200

    asyncio.run(main())


def test_a_full_replica_answers_429_with_retry_after_and_serves_what_it_took():
    app, release = _app(max_in_flight=3)

    async def main():
        async with _client(app) as c:
            held = [
                asyncio.create_task(c.post("/v1/chat/completions", json=CHAT | {"wait": True}, headers=AUTH))
                for _ in range(3)
            ]
            await asyncio.sleep(0.2)
            r = await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert (await c.get("/health")).status_code == 200  # probes are not queued
            release.set()
            assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200, 200]
            assert (await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200

    asyncio.run(main())


def _check(limits, path, body) -> None:
    check_request(path, body, limits)


def test_the_check_refuses_before_the_application_and_frees_the_slot():
    limits = Limits(max_stop_chars=8, max_messages=2, max_tokens=32)
    app, _ = _app(max_in_flight=1, check=functools.partial(_check, limits))
    bad = {
        "logprobs": (CHAT | {"logprobs": True}, 400, "logprobs"),
        "unknown field": (CHAT | {"guided_json": {}}, 400, "guided_json"),
        "long stop": (CHAT | {"stop": "x" * 9}, 400, "stop"),
        "messages": (CHAT | {"messages": CHAT["messages"] * 3}, 400, "messages"),
        "max_tokens": (CHAT | {"max_tokens": 33}, 400, "max_tokens"),
        "n": (CHAT | {"n": 2}, 400, "n"),
    }

    async def main():
        async with _client(app) as c:
            for body, status, param in bad.values():
                r = await c.post("/v1/chat/completions", json=body, headers=AUTH)
                assert r.status_code == status and r.json()["error"]["param"].startswith(param), r.text
            r = await c.post("/v1/chat/completions", content=b"{nope", headers=AUTH)
            assert r.status_code == 400
            neutral = CHAT | {"logprobs": False, "presence_penalty": 0, "tools": [], "user": "u", "max_tokens": 32}
            assert (await c.post("/v1/chat/completions", json=neutral, headers=AUTH)).status_code == 200

    asyncio.run(main())


def test_a_check_may_replace_the_body_the_application_gets():
    app, _ = _app(check=lambda path, body: b'{"replaced": true}')

    async def main():
        async with _client(app) as c:
            r = await c.post("/v1/chat/completions", json=CHAT | {"padding": "x" * 100}, headers=AUTH)
            assert r.status_code == 200 and r.json()["echo"] == {"replaced": True}

    asyncio.run(main())


def test_clients_that_leave_or_requests_that_fail_give_their_place_back():
    """The in-flight count returns to 0 whether the response ends, the client leaves mid-stream (send fails) or
    the application raises: a leaked place would turn every later request into a 429."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        if scope["path"] == "/v1/fails":
            raise RuntimeError("the application failed")
        await send({"type": "http.response.body", "body": b""})

    guard = Guard(app, max_in_flight=2)
    scope = {
        "type": "http",
        "method": "GET",
        "root_path": "",
        "headers": [(b"authorization", AUTH["Authorization"].encode())],
    }

    async def receive():
        return {"type": "http.disconnect"}

    async def main():
        sent = []

        async def send_ok(message):
            sent.append(message)

        async def send_gone(message):
            if message["type"] == "http.response.body":
                raise OSError("the client left")

        await guard(scope | {"path": "/v1/stream"}, receive, send_ok)
        with pytest.raises(OSError):
            await guard(scope | {"path": "/v1/stream"}, receive, send_gone)
        with pytest.raises(RuntimeError):
            await guard(scope | {"path": "/v1/fails"}, receive, send_ok)
        assert guard.in_flight == 0 and sent[0]["status"] == 200

    asyncio.run(main())
