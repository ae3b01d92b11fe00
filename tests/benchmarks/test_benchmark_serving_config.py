"""The serving benchmark's config is checked before Ray starts: it measures one replica's scheduler."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.benchmarks.serving import BenchmarkServingConfig, run_serving_benchmark
from orchestrator.errors import AerieError
from tests.serving.conftest import app_args


def test_a_multi_replica_app_is_refused_before_anything_starts(tiny_chat, tmp_path, monkeypatch):
    import ray

    app = tmp_path / "serve.yaml"
    args = app_args(tiny_chat, speculation=False)
    app.write_text(
        yaml.safe_dump({"applications": [{"import_path": "orchestrator.serving.app:build_app", "args": args}]})
    )
    cfg = BenchmarkServingConfig(app=str(app), app_overrides=["num_replicas=2"], output_dir=str(tmp_path / "out"))
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray must not start"))
    with pytest.raises(AerieError, match=r"serves 2 replicas: set app_overrides=\[num_replicas=1\]"):
        run_serving_benchmark(cfg, tmp_path / "out")


@pytest.mark.parametrize(
    ("events", "error"),
    [
        (
            [
                '{"choices": [{"delta": {"content": "hi"}}]}',
                '{"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 3}}',
                "[DONE]",
            ],
            None,
        ),
        (['{"choices": [{"delta": {"content": "hi"}}]}'], "the stream ended without [DONE]"),  # cut mid-way
        (['{"choices": [{"delta": {"content": "hi"}}]}', '{"error": {"message": "lost"}, "status": 503}'], "lost"),
    ],
)
def test_a_stream_counts_only_when_it_ends_with_done(events, error):
    """A client reading an SSE stream: a stream cut without [DONE] is a failed request, not a short answer."""
    import asyncio

    import httpx

    from orchestrator.benchmarks.serving import stream_request

    body = "".join(f"data: {e}\n\n" for e in events).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def one():
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, "http://test", "m", {"messages": []}, 4)

    out = asyncio.run(one())
    assert out.get("error") == error
