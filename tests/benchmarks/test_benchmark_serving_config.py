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


def test_deployments_that_cannot_all_be_placed_are_refused_naming_the_shortfall(tiny_chat):
    """Every (arm, mode) deployment is up at once; on a private Ray nothing joins, so what does not fit now would
    leave Serve waiting forever (seen: a twin arm on 2 CPUs hung at its third deployment)."""
    from orchestrator.benchmarks.serving import check_fits, reservations

    app = {"import_path": "orchestrator.serving.app:build_app", "args": app_args(tiny_chat)}
    app["args"] |= {"target": {"num_cpus": 0.5}, "draft": {"num_cpus": 0.5, "resources": {"draft": 1}}}
    vllm = {"import_path": "orchestrator.serving.vllm_app:build_app", "args": {"model": "m"}}
    needed = reservations([(app, "spec"), (app, "no-spec"), (app, "spec"), (app, "no-spec"), (vllm, "spec")])
    assert needed == {"CPU": 3.0, "draft": 2.0}  # no draft worker without speculation; vLLM sizes itself
    check_fits(needed, {"CPU": 3.0, "draft": 2.0, "memory": 1e9})
    with pytest.raises(AerieError) as err:
        check_fits(needed, {"CPU": 2.0, "draft": 2.0})
    assert str(err.value).startswith("the benchmark's deployments run at once and their workers reserve 3 CPU")
    assert "(the cluster has 2)" in str(err.value) and "draft" not in str(err.value).split(":")[0]


def test_answer_lengths_spread_over_the_range_and_pair_across_modes(monkeypatch):
    """`max_tokens_range`: request i asks for its own length, every length of the range before one repeats, the
    same list on every call (so request i of one mode is paired with a request of the same length in the other);
    run_requests sends request i with length i. A reversed range is refused naming both ends."""
    import asyncio

    from orchestrator.benchmarks import serving

    cfg = BenchmarkServingConfig(app="a.yaml", output_dir="out", max_tokens_range=[32, 96])
    lengths = serving.answer_lengths(cfg, 130)
    assert sorted(lengths[:65]) == list(range(32, 97)) and lengths[65:] == lengths[:65]
    assert lengths == serving.answer_lengths(cfg, 130) and len(set(lengths[:8])) == 8
    assert serving.answer_lengths(BenchmarkServingConfig(app="a", output_dir="o"), 3) == [64, 64, 64]
    with pytest.raises(ValueError, match=r"max_tokens_range \[96, 32\]: give \[lo, hi\] with lo <= hi"):
        BenchmarkServingConfig(app="a.yaml", output_dir="out", max_tokens_range=[96, 32])

    sent = []

    async def fake(client, url, model, prompt, max_tokens):
        sent.append((prompt["i"], max_tokens))
        return {"tokens": max_tokens}

    monkeypatch.setattr(serving, "stream_request", fake)
    prompts = [{"i": i} for i in range(4)]
    results, _ = asyncio.run(serving.run_requests("http://x", "m", prompts, 3, 6, lengths[:6]))
    assert sorted(sent) == sorted((i % 4, lengths[i]) for i in range(6))
    assert [r["tokens"] for r in results] == lengths[:6]


def test_identical_deployments_pool_their_pairs_and_other_arms_are_compared_with_the_app():
    """An arm with no overrides is the app deployed again: speculation on / off is pooled over every such pair
    (a deployment's luck averages out; each pair keeps its own ratio), and an arm with overrides is only compared
    with the app, mode by mode."""
    from orchestrator.benchmarks.serving import compare

    def level(*tok_s: float) -> dict:
        return {"per_request_tok_s": list(tok_s)}

    modes = {  # the first spec deployment ran 10% fast, its twin 10% slow: on / off is 1.0 in truth
        "spec": {4: level(11, 11, 11, 11)},
        "no-spec": {4: level(10, 10, 10, 10)},
        "twin-spec": {4: level(9, 9, 9, 9)},
        "twin-no-spec": {4: level(10, 10, 10, 10)},
        "tap-spec": {4: level(8, 8, 8, 8)},
        "tap-no-spec": {4: level(10, 10, 10, 10)},
    }
    cfg = BenchmarkServingConfig(
        app="unused.yaml", arms={"twin": [], "tap": ["tap.enabled=true"]}, concurrency=[4], output_dir="unused"
    )
    result = {"modes": modes}
    compare(result, cfg, ["", "twin-", "tap-"])
    assert result["speedup"][4]["ratio"] == pytest.approx(1.1) and result["twin_speedup"][4]["ratio"] == 0.9
    pooled = result["speedup_pooled"][4]
    assert pooled["ratio"] == pytest.approx(1.0) and pooled["n"] == 8 and result["pooled_deployments"] == 2
    assert result["arm_ratios"]["tap"]["spec"][4]["ratio"] == pytest.approx(8 / 11)
    assert result["arm_ratios"]["twin"]["no-spec"][4]["ratio"] == 1.0
    assert result["tap_speedup"][4]["ratio"] == pytest.approx(0.8) and "vllm_speedup" not in result
