"""The collection job end to end: hidden states equal transformers', S3 (moto on loopback) equals local
byte for byte after a stop and a corrupted shard, chunked synthetic data, vLLM's states, `ray job submit`, and
clear errors before any work."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orchestrator.data import corpus
from orchestrator.data.collect import first_user, sample_conversations
from orchestrator.data.conversations import Conversation, LoadReport, load_chitchat, split_of
from orchestrator.data.shards import read_shard
from orchestrator.data.synthetic import normalise
from tests.helpers import ray_cli_env, start_ray_head, stop_ray_cluster

pytestmark = [pytest.mark.slow, pytest.mark.ray]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config(tmp_path_factory, smollm2_dir) -> Path:
    """Ten chitchat conversations plus a malformed line and one without an answer; two template variants."""
    root = tmp_path_factory.mktemp("collect")
    convs = load_chitchat(LoadReport())[:10]
    lines = [json.dumps({"id": c.id, "messages": c.messages}) for c in convs]
    lines.insert(3, "{not json")
    lines.append(json.dumps({"messages": [{"role": "user", "content": "alone"}]}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    cfg = {
        "model": str(smollm2_dir),
        "sources": [{"kind": "jsonl", "path": str(root / "data.jsonl")}],
        "validation_fraction": 0.3,
        "templates": [{"name": "chatml"}, {"name": "sys", "system_prompts": ["You are terse.", "Answer kindly."]}],
        "max_length_tokens": 256,
        "shard_tokens": 600,
        "batch_tokens": 1024,
        "measure_baseline": False,
        "output": str(root / "unused"),
    }
    path = root / "collect.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _collect(config: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.collect_hidden_states", "--config", str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    return proc


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def local_run(config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local")
    _ok(_collect(config, f"output={out}", "measure_baseline=true"))
    return out


def test_manifest_and_counts(local_run):
    manifest = json.loads((local_run / "manifest.json").read_text())
    result = json.loads((local_run / "result.json").read_text())
    assert manifest["aux_layer_ids"] == [2, 15, 27] and manifest["dtype"] == "bfloat16"
    assert manifest["compute_dtype"] == "auto"  # fp32 on the CPU: the states are compared with transformers' below
    (source,) = manifest["datasets"]["sources"]
    assert source["malformed"] == 1 and source["malformed_lines"] == ["data.jsonl:4"]
    assert source["skipped_no_assistant"] == 1 and source["used"] == 10
    assert sum(s["num_sequences"] for s in manifest["splits"].values()) == 20  # 10 conversations x 2 templates
    assert result["complete"] and result["capture_vs_baseline"] > 0
    assert abs(result["bytes_per_token"] - 2 * (3 * 576 + 576) - 5) < 10  # bf16 states + int32 id + bool mask


def test_captured_states_equal_transformers(local_run, smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    shard = read_shard((local_run / "train-00000.safetensors").read_bytes())
    ids, lens = shard["input_ids"].long(), shard["seq_lens"].tolist()
    offset = 0
    for n in lens[:3]:
        with torch.no_grad():
            ref = hf(ids[offset : offset + n][None], output_hidden_states=True).hidden_states
        got = shard["aux_hidden"][offset : offset + n].float().view(n, 3, 576)
        for j, layer in enumerate((2, 15, 27)):
            scale = ref[layer][0].abs().max().item()
            torch.testing.assert_close(got[:, j], ref[layer][0], rtol=1.6e-2, atol=1e-2 * scale)
        torch.testing.assert_close(
            shard["final_hidden"][offset : offset + n].float(), ref[-1][0], rtol=1.6e-2, atol=0.05
        )
        offset += n


def test_s3_resumes_after_a_stop_and_after_corruption_to_the_local_bytes(config, local_run, s3_env):
    """To S3 (moto on loopback): stopped after 2 shards, one of them corrupted, resumed: the good one reused,
    the corrupted one written again; manifest and every shard byte for byte the local run's."""
    env, client = s3_env

    def get(key: str) -> bytes:
        return client.get_object(Bucket="aerie-test", Key=f"run1/{key}")["Body"].read()

    def keys() -> list[str]:
        listed = client.list_objects_v2(Bucket="aerie-test", Prefix="run1/").get("Contents", [])
        return [o["Key"].removeprefix("run1/") for o in listed]

    _ok(_collect(config, "output=s3://aerie-test/run1", "max_new_shards=2", env=env))
    written = sorted(k for k in keys() if k.endswith(".safetensors"))
    assert "manifest.json" not in keys() and len(written) == 2
    victim = written[1]
    data = bytearray(get(victim))
    data[-10] ^= 0xFF
    client.put_object(Bucket="aerie-test", Key=f"run1/{victim}", Body=bytes(data))

    _ok(_collect(config, "output=s3://aerie-test/run1", env=env))
    expected = (local_run / "manifest.json").read_bytes()
    assert get("manifest.json") == expected
    result = json.loads(get("result.json"))
    assert result["shards_reused"] == 1 and result["shards_written"] == result["shards_planned"] - 1
    for shard in json.loads(expected)["shards"]:
        assert get(shard["name"]) == (local_run / shard["name"]).read_bytes()
    assert not [k for k in keys() if k.startswith(".") or "/." in k], "no partial objects left behind"


def test_capture_sample_is_fixed_by_the_ids_and_holds_both_splits():
    """capture_sample (a replay sample of a large corpus): the same conversations whatever their order, and each
    split in about its share; ranked by the split's own hash, the sample would be validation alone."""
    convs = [Conversation(f"c{i}", [{"role": "user", "content": "x"}]) for i in range(2000)]
    picked = sample_conversations(convs, 200)
    assert [c.id for c in sample_conversations(list(reversed(convs)), 200)] == [c.id for c in picked]
    assert [c.id for c in sample_conversations(convs, 100)] == [c.id for c in picked[:100]]
    held = sum(split_of(c.id, 0.05) == "validation" for c in picked)
    assert 2 <= held <= 25  # ~10 of 200 at 5%


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["sources=[{kind: reddit}]"], {}, "sources.0.kind: Input should be"),
        (["aux_layer_ids=[2,40]"], {}, "aux layer ids [40] are outside the 30-layer target"),
        (
            ["output=s3://aerie-nowhere/x"],
            {
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                "AWS_ACCESS_KEY_ID": "x",
                "AWS_SECRET_ACCESS_KEY": "x",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_MAX_ATTEMPTS": "1",
            },
            "cannot reach S3 bucket 'aerie-nowhere'",
        ),
    ],
    ids=["unknown-dataset", "layer-outside", "unreachable-s3"],
)
def test_bad_input_fails_before_any_work(config, tmp_path, overrides, env, message):
    proc = _collect(config, f"output={tmp_path / 'o'}", *overrides, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr.strip().splitlines()[-1]
    assert not list((tmp_path / "o").glob("*.safetensors")) if (tmp_path / "o").exists() else True


def test_reader_streams_every_sequence_once_across_workers(local_run):
    from orchestrator.data.reader import ShardReader

    manifest = json.loads((local_run / "manifest.json").read_text())
    expected = manifest["splits"]["train"]["num_sequences"]
    seen = []
    for rank in range(2):
        for seq in ShardReader(str(local_run), "train", rank=rank, world_size=2, seed=3, buffer_sequences=2):
            assert seq.aux_hidden.shape == (seq.input_ids.numel(), 3 * 576) and seq.loss_mask.any()
            seen.append((seq.conversation_id, int(seq.input_ids.sum())))
    assert len(seen) == len(set(seen)) == expected
    first = [s.conversation_id for s in ShardReader(str(local_run), seed=3)]
    assert first == [s.conversation_id for s in ShardReader(str(local_run), seed=3)]
    assert first != [s.conversation_id for s in ShardReader(str(local_run), seed=4)]


def test_held_out_set_from_the_config_equals_the_collections(config, local_run):
    """Online training keeps no collection: its evaluation renders the held-out split from the collect config, and
    must get the very prompts a finished collection's reader gives, in the same order."""
    from orchestrator.evaluation.sets import validation_set

    manifest = json.loads((local_run / "manifest.json").read_text())
    assert len([s for s in manifest["shards"] if s["split"] == "validation"]) > 1  # the shard order is exercised
    collected = validation_set(str(local_run), 100)
    rendered = validation_set(str(config), 100)
    assert collected and [p.ids for p in rendered] == [p.ids for p in collected]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRIVATE_RAY_PROBE = """
import ray
from orchestrator.cluster import init_ray
from ray.train.v2._internal.state.util import is_actor_alive

init_ray()

@ray.remote(num_cpus=0)
class Idle:
    def ping(self):
        return 1

@ray.remote(num_cpus=0)
def alive(actor_id):
    return bool(is_actor_alive(actor_id, timeout=30))

idle = Idle.remote()
ray.get(idle.ping.remote())
print(ray.get_runtime_context().gcs_address, ray.get(alive.remote(idle._actor_id.hex())))
"""


def test_ray_job_submit_against_a_started_head(config, local_run, tmp_path):
    """`ray start --head` on loopback, then `ray job submit --working-dir .`: same manifest as a direct run."""
    bin_dir = Path(sys.executable).parent
    env = ray_cli_env()
    gcs, dashboard = _free_port(), _free_port()
    start_ray_head(env, gcs, dashboard)
    try:
        out = tmp_path / "submitted"
        runtime_env = json.dumps({"excludes": [".venv", "models", "runs", ".git", "*.safetensors"]})
        submit = [
            str(bin_dir / "ray"),
            "job",
            "submit",
            f"--address=http://127.0.0.1:{dashboard}",
            f"--working-dir={REPO}",
            f"--runtime-env-json={runtime_env}",
            "--",
            "python",
            "-m",
            "jobs.collect_hidden_states",
            "--config",
            str(config),
            f"output={out}",
        ]
        for _ in range(30):  # a head just started may not have its job agent yet (seen on a busy machine)
            proc = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=900)
            if "No available agent to submit job" not in proc.stderr:
                break
            time.sleep(2)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert (out / "manifest.json").read_text() == (local_run / "manifest.json").read_text()
        # a job run without RAY_ADDRESS starts its own Ray, not this head (`ray start` noted it as the machine's
        # latest: a bare ray.init() joins it), and its workers' state API asks that Ray (else Ray Train's
        # placement-group cleaner, not finding its controller here, removes the training's placement group)
        alone = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
        own = subprocess.run(
            [sys.executable, "-c", PRIVATE_RAY_PROBE], env=alone, capture_output=True, text=True, timeout=300, cwd=REPO
        )
        assert own.returncode == 0, own.stderr[-2000:]
        address, alive = own.stdout.split()[-2:]
        assert not address.endswith(f":{gcs}") and alive == "True", own.stdout
    finally:
        stop_ray_cluster(gcs)


def test_synthetic_prompts_and_regeneration_are_made_once_in_chunks_and_resumed(config, tmp_path):
    cache = tmp_path / "datasets"
    overrides = [
        "sources=[{kind: synthetic, synthetic: {num_conversations: 4, user_turns: 2, max_prompt_tokens: 48}},"
        f" {{kind: jsonl, path: {config.parent / 'data.jsonl'}, max_user_turns: 2}}]",
        "max_conversations=6",
        f"regenerate={{max_new_tokens: 12, cache_dir: {cache}, chunk_conversations: 2}}",
    ]
    _ok(_collect(config, f"output={tmp_path / 'a'}", *overrides))
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    synthetic = next(s for s in manifest["datasets"]["sources"] if s["kind"] == "synthetic")
    assert synthetic["kept"] == synthetic["used"] == 4 and synthetic["generated"] >= 4
    assert sum(synthetic["per_topic"].values()) == 4 and len(synthetic["datasets"]) == 2
    regenerated = manifest["datasets"]["regenerated"]
    assert regenerated["conversations"] == 3 and regenerated["tokens_per_s"] > 0 and len(regenerated["datasets"]) == 2
    rows = [c.messages for p in regenerated["datasets"] for c in corpus.load_chunk(Path(p))[0]]
    assert all(m["content"] and m["token_ids"] for r in rows for m in r if m["role"] == "assistant")
    assert all(sum(m["role"] == "user" for m in r) <= 2 for r in rows)
    listed = json.loads((cache / corpus.MANIFEST).read_text())
    assert listed["totals"]["chunks"] == 4 and listed["target_sha256"]
    assert manifest["datasets"]["corpus"]["manifest_sha256"] == corpus.sha256_bytes(
        (cache / corpus.MANIFEST).read_bytes()
    )

    # A run stopped while it wrote the first regenerated chunk, rerun asking for a larger synthetic corpus (data
    # only: max_new_shards=0 captures nothing and starts no Ray): the saved chunks are reused, the lost one is
    # written again (the same text: the project's engine is seeded).
    lost, chunks = Path(regenerated["datasets"][0]), synthetic["datasets"]
    text = lost.read_bytes()
    lost.unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.name.endswith(corpus.SUFFIX)}
    larger = [o.replace("num_conversations: 4", "num_conversations: 6") for o in overrides]
    proc = _collect(config, f"output={tmp_path / 'b'}", *larger, "max_new_shards=0")
    _ok(proc)
    assert "Started a local Ray instance" not in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if p.name in kept} == kept, "chunks must be reused"
    assert lost.read_bytes() == text
    result = json.loads((tmp_path / "b" / "result.json").read_text())
    assert result["shards_written"] == 0 and not result["complete"]
    again = result["datasets"]
    synthetic = next(s for s in again["sources"] if s["kind"] == "synthetic")
    assert synthetic["used"] == 6 and synthetic["datasets"][:2] == chunks
    prompts = [first_user(c) for p in synthetic["datasets"] for c in corpus.load_chunk(Path(p))[0]]
    assert len({normalise(p) for p in prompts}) == 6  # no chunk repeats another's prompt


@pytest.mark.vllm
def test_vllm_backend_gives_the_same_states(config, local_run, smollm2_dir, tmp_path):
    """vLLM's extract_hidden_states (through the project's CPU connector) against the project's target in fp32,
    run here on the same sequences (`target_states`, what the target backend's capture workers run)."""
    from orchestrator.data.shards import Sequence, ShardPlan, target_states
    from orchestrator.models.target import TargetModel

    out = tmp_path / "vllm"
    _ok(_collect(config, f"output={out}", "backend=vllm", "dtype=float32"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "vllm"
    target = TargetModel.from_pretrained(smollm2_dir, tuple(manifest["aux_layer_ids"]), device="cpu")
    for shard in manifest["shards"]:
        got, bf16 = read_shard((out / shard["name"]).read_bytes()), read_shard((local_run / shard["name"]).read_bytes())
        assert torch.equal(got["input_ids"], bf16["input_ids"]) and torch.equal(got["loss_mask"], bf16["loss_mask"])
        ids = got["input_ids"].long().split(got["seq_lens"].tolist())
        plan = ShardPlan(shard["name"], "", [Sequence("", "", i, torch.ones_like(i, dtype=torch.bool)) for i in ids])
        aux, final = target_states(target, plan, batch_tokens=4096)
        ref = {"aux_hidden": aux, "final_hidden": final}
        for key in ("aux_hidden", "final_hidden"):
            scale = ref[key].abs().max().item()
            torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-5 * scale)


def test_online_shards_give_the_offline_batches_with_bounded_prefetch(config, local_run):
    """`train.data: online`: the trainer's first batches (two epochs' worth) are the offline collection's,
    tensor for tensor, with no more than `prefetch` shards captured ahead; a resumed stream too."""
    import itertools

    import ray

    from orchestrator.config import load_config
    from orchestrator.data.collect import CollectConfig, online_manifest, plan_collection, start_capture_workers
    from orchestrator.data.online import OnlineShards
    from orchestrator.train.loop import _FIELDS, batches, sequence_stream
    from orchestrator.train.state import DataPosition

    cfg = load_config(CollectConfig, config, [f"output={local_run}"])
    model_dir = Path(cfg.model)
    planned = plan_collection(cfg, model_dir)
    manifest = online_manifest(cfg, model_dir, planned)
    assert manifest["online"] and manifest["splits"] == json.loads((local_run / "manifest.json").read_text())["splits"]
    try:
        workers = start_capture_workers(cfg, model_dir, planned.aux, 1, write=False)

        def first(data, n: int, position=None):
            stream = sequence_stream(data, 0, 1, seed=3, position=position or DataPosition())
            return list(itertools.islice(batches(stream, 512), n))

        def same(a, b):
            assert [p for _, p in a] == [p for _, p in b]
            for (xs, _), (ys, _) in zip(a, b, strict=True):
                assert [x.conversation_id for x in xs] == [y.conversation_id for y in ys]
                for x, y in zip(xs, ys, strict=True):
                    assert all(torch.equal(getattr(x, f), getattr(y, f)) for f in _FIELDS)

        online = OnlineShards(manifest, planned.plans, workers, prefetch=2)
        offline, streamed = first(str(local_run), 12), first(online, 12)
        assert offline[-1][1].epoch >= 1  # past the first epoch: shards captured again, reshuffled
        same(offline, streamed)
        assert online.most_ahead <= 2 and not (local_run / "online").exists()
        position = offline[3][1]
        same(first(str(local_run), 3, position), first(OnlineShards(manifest, planned.plans, workers, 1), 3, position))
        # A committed drafter trained on in a later session: a new stream after the shards read whole (here: epoch
        # 0 after its first shard); online, the shards before are never captured again.
        order = [s["name"] for s in manifest["shards"] if s["split"] == "train"]
        random.Random(3).shuffle(order)  # epoch 0's order (seed 3 + epoch), as the reader draws it
        at = DataPosition(epoch=0, consumed=0, shards_read=1, first_shard=1)
        assert at == DataPosition(0, 5, 1, 0).continue_at()
        later, asked = OnlineShards(manifest, planned.plans, workers, 1), []
        submit = later._submit
        later._submit = lambda name: asked.append(name) or submit(name)
        again = first(later, 2, at)
        same(first(str(local_run), 2, at), again)
        assert asked[: len(order) - 1] == order[1:]  # the rest of epoch 0, its first shard not captured again
        assert all(p.first_shard == 1 for _, p in again if p.epoch == 0)
    finally:
        ray.shutdown()
