"""Small builders shared by the tests: tiny random targets and drafters."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from orchestrator.models.drafter import Drafter, DrafterConfig
from orchestrator.spec.replay import ReplayProposer  # noqa: F401 (serving tests name tests.helpers:ReplayProposer)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "vocab_size": 96,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


QUESTIONS = [  # the serving tests' chat questions
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three uses of copper.",
    "How do I boil an egg?",
    "Tell me a joke about cats.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet.",
]

# The servers under test take this key (tests/conftest.py puts it in the environment before Ray starts).
API_KEY = "aerie-test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NO_CAPTURE_KEY = "aerie-test-key-never-captured-42"  # also accepted by the test servers; a tap may exclude it


def write_tiny_llama(out: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama in Hugging Face format (config.json + model.safetensors), written by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(TINY_LLAMA | overrides)))
    model.save_pretrained(out, safe_serialization=True)
    return out


def random_drafter(
    target_config: dict,
    variant: str = "eagle3.1",
    draft_vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **flags,
) -> Drafter:
    """A drafter with random weights (std 0.02, norm weights near 1) and a random draft vocabulary, in `dtype`."""
    from orchestrator.models.target import default_aux_layer_ids

    gen = torch.Generator().manual_seed(seed)
    aux = default_aux_layer_ids(target_config["num_hidden_layers"])
    config = DrafterConfig.for_target(target_config, aux, draft_vocab_size, variant, **flags)
    drafter = Drafter(config, dtype)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or ".weight" in name and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        vocab, draft = config.vocab_size, config.draft_vocab_size
        chosen = torch.randperm(vocab, generator=gen)[:draft].sort().values
        drafter.d2t.copy_(chosen - torch.arange(draft))
        drafter.t2d.zero_()
        drafter.t2d[chosen] = True
    return drafter


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


RAY_BIN = Path(sys.executable).parent / "ray"


def ray_cli_env() -> dict:
    """Environment for `ray` CLI calls against a cluster with token authentication (a token is generated)."""
    from orchestrator.netcluster import ray_token_env

    return ray_token_env()


def start_ray_head(env: dict, gcs_port: int, dashboard_port: int, num_cpus: int = 2, resources: dict | None = None):
    """`ray start --head` on loopback (stop it, and only it, with `stop_ray_cluster(gcs_port)`)."""
    cmd = [
        str(RAY_BIN),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_port}",
        f"--num-cpus={num_cpus}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        "--disable-usage-stats",
    ]
    if resources:
        cmd += ["--resources", json.dumps(resources)]
    started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr[-2000:]


def stop_ray_cluster(gcs_port: int, timeout_s: float = 30) -> None:
    """Stop every process of the Ray cluster whose GCS listens on `gcs_port` (its nodes, dashboard, workers and
    their children), and nothing else: `ray stop --force` would also end every other Ray on the machine, a
    developer's `aerie serve` or this test session's own cluster."""
    import psutil

    marks = (f":{gcs_port} ", f"={gcs_port} ")
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ()) + " "
        if proc.pid != os.getpid() and any(m in line for m in marks):
            found[proc.pid] = proc
            with contextlib.suppress(psutil.NoSuchProcess):
                found |= {c.pid: c for c in proc.children(recursive=True)}
    for proc in found.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(list(found.values()), timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    # `ray start` noted this cluster as the machine's latest: a plain `ray.init()` would try to join it (as
    # `ray stop` does, forget it)
    from ray._private.utils import get_ray_address_file, read_ray_address

    if (read_ray_address() or "").endswith(f":{gcs_port}"):
        Path(get_ray_address_file(None)).unlink(missing_ok=True)


def draft_two_steps(drafter: Drafter, embedding: torch.nn.Embedding | None = None, seed: int = 0):
    """Two drafting steps (aux -> fc, then the drafter's own state) for a ragged batch of 2 sequences; a drafter
    that shares the target's embedding gets `embedding`. Returns the two DraftOutputs."""
    if embedding is not None:
        drafter.share_embedding(embedding)
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(7, drafter.fc.in_features, generator=gen)  # [N, k*Ht]
    tokens = torch.randint(0, drafter.config.vocab_size, (7,), generator=gen)
    cache, slots = drafter.new_cache(2, 32), torch.arange(2)
    with torch.no_grad():
        first = drafter(tokens, drafter.combine_aux(aux), cache, slots, torch.tensor([4, 3]))
        second = drafter(tokens[[3, 6]], first.next_hidden[[3, 6]], cache, slots, torch.tensor([1, 1]))
    return first, second


def vllm_generate(model_dir: Path, prompts: Path, out: Path, drafter: Path | None = None) -> list[dict]:
    """`aerie generate --engine vllm` (greedy, 32 tokens, 3 speculative tokens with a drafter): its rows."""
    args = ["generate", "--engine", "vllm", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out)]
    args += ["--max-tokens", "32", "--num-spec-tokens", "3"]
    if drafter is not None:
        args += ["--drafter", str(drafter)]
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def captured_request(i: int, n: int = 6, aux_width: int = 12, hidden: int = 4):
    """A finished request as the target worker offers it to the traffic tap: n random token ids (the second
    half the answer) and random states, seeded by i."""
    from orchestrator.data.traffic import Captured

    g = torch.Generator().manual_seed(i)
    ids, aux = torch.randint(0, 100, (n,), generator=g), torch.randn(n, aux_width, generator=g)
    return Captured(ids, torch.arange(n) >= n // 2, aux, torch.randn(n, hidden, generator=g))


def wait_written(tap, shards: int) -> None:
    """Until the tap's writer thread has written (or failed) `shards` shards in all: synchronisation, not timing."""
    import time

    for _ in range(3000):
        if tap.stats.shards + tap.stats.write_errors >= shards:
            return
        time.sleep(0.01)
    raise AssertionError(f"the tap wrote {tap.stats.shards} shards, not {shards}")


def write_traffic(tap, clock, requests: int, every_s: float, first: int = 0) -> None:
    """`requests` requests offered to `tap` (one shard each when shard_tokens fits one), `clock.t` moving on by
    `every_s` before each; returns once all are written."""
    for i in range(requests):
        clock.t += every_s
        tap.offer(captured_request(first + i))
        wait_written(tap, tap.stats.shards + tap.stats.write_errors + 1)


def tiny_training(root: Path, smollm2_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (root/tiny-chat, returned), 24 chitchat
    conversations (root/data.jsonl), and the job configs that collect them (root/collect.yaml -> root/data) and
    train an EAGLE-3.1 drafter on two Ray Train workers (root/train.yaml -> root/drafter, checkpoints root/ckpt,
    MLflow root/mlflow.db)."""
    import shutil

    from orchestrator.data.conversations import LoadReport, load_chitchat

    tiny = write_tiny_llama(root / "tiny-chat", vocab_size=49152, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(smollm2_dir / name, tiny / name)
    convs = load_chitchat(LoadReport())[:24]
    (root / "data.jsonl").write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in convs))
    collect = {
        "model": str(tiny),
        "sources": [{"kind": "jsonl", "path": str(root / "data.jsonl")}],
        "validation_fraction": 0.2,
        "templates": [{"name": "chatml"}],
        "max_length_tokens": 256,
        "shard_tokens": 1200,
        "batch_tokens": 2048,
        "measure_baseline": False,
        "output": str(root / "data"),
    }
    (root / "collect.yaml").write_text(json.dumps(collect))
    train = {
        "name": "tiny",
        "model": str(tiny),
        "data": str(root / "data"),
        "output": str(root / "drafter"),
        "drafter": {"variant": "eagle3.1", "draft_vocab_size": 512},
        "ttt_steps": 3,
        "batch_tokens": 512,
        "max_steps": 40,
        "optim": {"warmup_steps": 2, "lr": 1e-3},
        "num_workers": 2,
        "checkpoint": {"storage_path": str(root / "ckpt"), "every_steps": 2},
        "mlflow": {
            "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
            "registered_model": "tiny-drafter",
            "aliases": ["candidate"],
        },
        "eval_every_steps": 10,
        "log_every_steps": 2,
    }
    (root / "train.yaml").write_text(json.dumps(train))
    return tiny


def committed_checkpoint(storage: Path) -> bool:
    """Ray Train has recorded a checkpoint of a run under `storage`: a rerun resumes from it."""
    from orchestrator.train.run import ray_train_checkpointed

    return storage.is_dir() and any(ray_train_checkpointed(str(storage), None, p.name) for p in storage.iterdir())


def wait_for(cond, timeout_s: float, what: str, period_s: float = 0.5):
    """cond()'s first true value, polled every period_s; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")
