"""Serving fixtures: one local Ray + Serve per session (loopback), and the tiny chat target's greedy
references for chat prompts."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.helpers import QUESTIONS

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def references(tiny_chat, tmp_path_factory) -> dict:
    """Chat prompts and the tiny target's greedy continuations (32 tokens, EOS ignored), and the JSON file the
    replay proposer reads."""
    from orchestrator.engine import load_engine
    from orchestrator.models.tokenizer import load_tokenizer
    from orchestrator.spec import SamplingParams

    tok = load_tokenizer(tiny_chat)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [
        list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for m in messages
    ]
    outs = load_engine(tiny_chat, max_batch=8).generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    data = {"prompts": prompts, "outputs": [g.token_ids for g in outs]}
    path = tmp_path_factory.mktemp("refs") / "references.json"
    path.write_text(json.dumps(data))
    texts = [tok.decode(g.token_ids, skip_special_tokens=True) for g in outs]
    return {"messages": messages, "path": str(path), "texts": texts, "tokenizer": tok, **data}


@pytest.fixture(scope="session")
def serve_session():
    """Local Ray on loopback with Serve's HTTP proxy on a free port; yields the base URL."""
    import os

    import ray
    from ray import serve

    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=8,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}},
        _system_config={"metrics_report_interval_ms": 1000},  # rollouts read vLLM's counters from Prometheus
    )
    port = free_port()  # after ray.init: Ray's own processes take random ports as they start
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    if ray.is_initialized():  # test_two_nodes shuts it down for its own cluster
        serve.shutdown()
        ray.shutdown()


def app_args(model: Path, **overrides) -> dict:
    """Application args for the tiny target on this 2-core machine (half a logical CPU per worker)."""
    args = {
        "model": str(model),
        "served_model_name": "tiny",
        "target": {"num_cpus": 0.5, "torch_threads": 1},
        "draft": {"num_cpus": 0.5, "torch_threads": 1},
        "scheduler": {"max_batch": 16, "budget_tokens": 64, "request_timeout_s": 120, "worker_timeout_s": 60},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = args[key] | value
        else:
            args[key] = value
    return args


def deploy(name: str, args: dict, base: str) -> str:
    from ray import serve

    from orchestrator.serving.app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    return f"{base}/{name}"
