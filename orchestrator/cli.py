"""`aerie`: the command line. A user error prints one line (`error: ...`) and exits 2; no traceback.

aerie prepare-model smollm2-135m-instruct --out models/smollm2-135m-instruct
aerie prompts mtbench --out prompts.jsonl [--limit N]
aerie generate --model DIR [--drafter DIR] --prompts IN.jsonl --out OUT.jsonl [--engine local|vllm]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from orchestrator.errors import AerieError
from orchestrator.redaction import redact_text

log = logging.getLogger(__name__)


def _prepare_model(args: argparse.Namespace) -> int:
    from orchestrator.models.prepare import prepare_model

    out = prepare_model(args.name, args.out)
    print(f"prepared {args.name} at {out}")
    return 0


def _init_drafter(args: argparse.Namespace) -> int:
    import torch

    from orchestrator.models.checkpoint import save_drafter
    from orchestrator.models.init import init_drafter
    from orchestrator.models.target import TargetModel

    target = TargetModel.from_pretrained(args.model, device="cpu")  # written in float32, whatever runs it
    if not 0 < args.draft_vocab_size <= target.vocab_size:
        raise AerieError(f"--draft-vocab-size must be in 1..{target.vocab_size}")
    draft_vocab = torch.arange(
        args.draft_vocab_size
    )  # without data: the first ids (BPE merges rank frequent ones first)
    out = save_drafter(init_drafter(target, args.variant, draft_vocab, args.seed), args.out)
    print(f"wrote an untrained {args.variant} drafter to {out}")
    return 0


def _prompts(args: argparse.Namespace) -> int:
    from orchestrator.data.prompts import mtbench_first_turns

    if args.name != "mtbench":
        raise AerieError(f"unknown prompt set {args.name!r} (known: mtbench)")
    records = mtbench_first_turns(args.limit)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {args.out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from orchestrator.data.prompts import encode_prompt, read_prompt_file
    from orchestrator.models.target import read_hf_config
    from orchestrator.spec.sampling import SamplingParams

    read_hf_config(args.model)
    if args.drafter is not None and not Path(args.drafter).is_dir():
        raise AerieError(f"drafter directory {args.drafter!r} does not exist")
    items = read_prompt_file(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)

    from orchestrator.models.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    good = [item for item in items if item.error is None]
    prompts = [encode_prompt(tokenizer, item) for item in good]
    started = time.perf_counter()
    if not prompts:
        rows = []
    elif args.engine == "local":
        rows = _generate_local(args, tokenizer, eos_token_ids(args.model, tokenizer), prompts, params)
    else:
        rows = _generate_vllm(args, prompts, params)
    elapsed = time.perf_counter() - started
    by_line = {item.line: row for item, row in zip(good, rows, strict=True)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    bad = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for item in items:
            error = item.error
            if error is None and "error" in by_line[item.line]:
                error = f"{args.prompts}:{item.line}: {by_line[item.line]['error']}"
            if error is not None:
                bad += 1
                print(f"error: {error}", file=sys.stderr)
                f.write(json.dumps({"line": item.line, "error": error}) + "\n")
                continue
            row = by_line[item.line]
            row["text"] = tokenizer.decode(row["token_ids"], skip_special_tokens=True)
            f.write(json.dumps({"line": item.line, **row}) + "\n")
    generated = sum(len(r.get("token_ids", ())) for r in rows)
    rate = generated / max(elapsed, 1e-9)
    summary = f"{len(rows)} prompts, {generated} tokens in {elapsed:.1f} s ({rate:.1f} tok/s) -> {args.out}"
    print(summary, file=sys.stderr)
    if bad:
        print(f"error: {bad} of {len(items)} prompt lines were unusable (see above)", file=sys.stderr)
        return 1
    return 0


def _generate_local(args, tokenizer, eos_ids, prompts, params) -> list[dict]:
    from orchestrator.engine import load_engine
    from orchestrator.spec.proposer import SpecConfig

    spec = SpecConfig(
        method=args.spec, num_spec_tokens=args.num_spec_tokens, depth=args.depth, topk=args.topk, budget=args.budget
    )
    engine = load_engine(
        args.model, args.drafter, spec, args.batch_size, tokenizer, eos_ids, device=args.device, dtype=args.dtype
    )
    rows = []
    for g in engine.generate(prompts, params, raise_errors=False):
        if g.error is not None:
            rows.append({"error": g.error})
            continue
        row = {"token_ids": g.token_ids, "num_prompt_tokens": len(g.prompt_ids), "finish_reason": g.finish_reason}
        if args.drafter is not None:
            row |= {"num_steps": g.acceptance.drafts, "acceptance_length": round(g.acceptance.acceptance_length, 4)}
        rows.append(row)
    return rows


def _generate_vllm(args, prompts, params) -> list[dict]:
    from orchestrator.engine.vllm_backend import VllmGenerator

    engine = VllmGenerator(args.model, args.drafter, num_spec_tokens=args.num_spec_tokens)
    if args.drafter is None:
        generations = engine.generate(prompts, params)
        return [
            {
                "token_ids": g.token_ids,
                "num_prompt_tokens": len(g.prompt_ids),
                "finish_reason": g.finish_reason,
            }
            for g in generations
        ]
    rows = []
    for prompt in prompts:  # one at a time: vLLM's acceptance counters are engine-wide, not per request
        before = engine.counters()
        (g,) = engine.generate([prompt], params)
        spec = engine.counters() - before
        rows.append(
            {
                "token_ids": g.token_ids,
                "num_prompt_tokens": len(g.prompt_ids),
                "finish_reason": g.finish_reason,
                "num_steps": spec.drafts,
                "acceptance_length": round(spec.acceptance_length, 4),
            }
        )
    return rows


def _convert_drafter(args: argparse.Namespace) -> int:
    """A drafter in another dtype (vLLM reads any), with where it came from in provenance.json."""
    from omegaconf import OmegaConf

    from orchestrator.data.collect import is_collect_config, planned_collection
    from orchestrator.models.checkpoint import load_drafter, save_drafter
    from orchestrator.train.run import read_manifest

    src = Path(args.src)
    drafter = load_drafter(src, dtype=args.dtype)
    provenance = {"converted_from": str(src), "dtype": args.dtype}
    if (src / "result.json").is_file():  # the training job's result: run, steps, tokens, metrics
        provenance["training"] = json.loads((src / "result.json").read_text())
    ran = src / "train_config.json"  # what the training job ran with, its overrides applied
    if ran.is_file():
        provenance["train_config"] = json.loads(ran.read_text())
    elif args.train_config:
        provenance["train_config"] = OmegaConf.to_container(OmegaConf.load(args.train_config))
    if args.train_config:
        provenance["train_config_file"] = args.train_config
    if args.data:  # a finished collection, or the collect config an online training read (its plan: same sha256)
        planned = planned_collection(args.data) if is_collect_config(args.data) else None
        manifest, sha = (planned["manifest"], planned["manifest_sha256"]) if planned else read_manifest(args.data)
        provenance["data"] = {"location": args.data, "manifest_sha256": sha, "datasets": manifest.get("datasets")}
        corpus = (manifest.get("datasets") or {}).get("corpus") or {}
        if corpus:  # the committed corpus the collection was made from (data/...): what remakes it
            provenance["corpus"] = corpus
    if args.evaluation:
        provenance["tau"] = tau_table(args.evaluation, args.evaluation_name)
    out = save_drafter(drafter, args.out)
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    size = (out / "model.safetensors").stat().st_size / 2**20
    print(f"wrote {args.dtype} {out} ({size:.1f} MiB) with provenance.json")
    return 0


def tau_table(result_path: str, name: str) -> dict:
    """One drafter's acceptance lengths from an evaluation's result.json: {method: {set: tau}}, vLLM's beside."""
    result = json.loads(Path(result_path).read_text())
    if name not in result.get("drafters", {}):
        raise AerieError(f"{result_path} evaluated no drafter named {name!r}: {sorted(result.get('drafters', {}))}")
    entry = result["drafters"][name]
    table = {
        method: {"all": e["overall"]["acceptance_length"], **{k: v["acceptance_length"] for k, v in e["sets"].items()}}
        for method, e in entry["engine"].items()
        if isinstance(e, dict) and "overall" in e
    }
    check = entry.get("vllm_check") or {}
    if check:
        table[f"vllm:{check['method']}"] = {k: v["vllm_tau"] for k, v in check.get("sets", {}).items()}
    return {"evaluation": result_path, "source": entry.get("source"), "table": table}


def _demo(args: argparse.Namespace) -> int:
    from orchestrator.data.prompts import encode_prompt, read_prompt_file
    from orchestrator.demo import check_identical, format_demo, run_demo
    from orchestrator.models.checkpoint import read_drafter_hf
    from orchestrator.models.target import read_hf_config
    from orchestrator.models.tokenizer import load_tokenizer
    from orchestrator.spec.proposer import SpecConfig

    read_hf_config(args.model)
    read_drafter_hf(args.drafter)
    items = read_prompt_file(args.prompts)
    bad = next((item for item in items if item.error is not None), None)
    if bad is not None:
        raise AerieError(bad.error)
    if not items:
        raise AerieError(f"{args.prompts} has no prompts")
    tokenizer = load_tokenizer(args.model)
    prompts = [encode_prompt(tokenizer, item) for item in items]
    spec = SpecConfig(method=args.spec, num_spec_tokens=args.num_spec_tokens, depth=args.depth, budget=args.budget)
    labels = [item.messages[-1]["content"] if item.messages else item.prompt for item in items]
    result = run_demo(
        Path(args.model), Path(args.drafter), prompts, labels, spec, args.max_tokens, args.repeats, args.dtype
    )
    print(format_demo(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    check_identical(result)
    return 0


def _serve(args: argparse.Namespace) -> int:
    serve_app(args.config, args.overrides, args.address, args.host, args.port, backend=args.backend)
    return 0


def serve_app(
    path: str | Path | None,
    overrides: list[str] | None = None,
    address: str | None = None,
    host: str | None = None,
    port: int | None = None,
    blocking: bool = True,
    backend: str | None = None,
) -> str:
    """`aerie serve [--backend vllm|disaggregated] [--config FILE] [key=value ...]`: deploy the config's first
    application behind the router on Ray (local, or the cluster at `address`) as backend `NAME-1`, so that
    `jobs.deploy` can later roll a new drafter out to it; returns the URL clients use."""
    from orchestrator.cluster import configured_address
    from orchestrator.serving.backends import BACKENDS, backend_of
    from orchestrator.serving.guard import API_KEY_ENV, API_KEY_FILE_ENV, default_key_file, ensure_local_key
    from orchestrator.serving.launch import read_serve_config
    from orchestrator.serving.rollout import DeployConfig, deploy_initial

    if path is None:
        if backend is None:
            raise AerieError("give --config FILE or --backend vllm|disaggregated (its default config)")
        path = BACKENDS[backend][1]
    config, app = read_serve_config(path, overrides)
    if backend is not None and backend_of(app["import_path"]) != backend:
        raise AerieError(
            f"{path} is not a {backend} config (import_path {app['import_path']}); "
            f"the {backend} backend's is {BACKENDS[backend][1]}"
        )
    http = dict(config.get("http_options") or {})
    host, port = host or http.get("host", "127.0.0.1"), port or http.get("port", 8000)
    name, route = app.get("name", "aerie"), app.get("route_prefix") or "/"
    cfg = DeployConfig(
        app=str(path),
        app_overrides=list(overrides or []),
        name=name,
        route_prefix=route,
        address=address,
        host=host,
        port=port,
    )
    url = f"http://{host}:{port}{route.rstrip('/')}"
    if not configured_address(address):
        written = ensure_local_key()  # a server on this machine: a random key unless one is configured
        if written is not None:
            print(f"wrote a new API key to {written}", flush=True)
    log.info("deploying %s at %s", name, url)
    deploy_initial(cfg)
    print(f"serving {name} at {url}", flush=True)
    if not (os.environ.get(API_KEY_ENV) or os.environ.get(API_KEY_FILE_ENV)):
        print(f"clients need its API key: export OPENAI_API_KEY=$(cat {default_key_file()})", flush=True)
    if blocking:  # until Ctrl-C or SIGTERM (`kill`, a service manager): Ray and the noted address go with it
        from orchestrator.jobrunner import interrupt_on_sigterm

        interrupt_on_sigterm()
        while True:
            time.sleep(3600)
    return url


def _traffic(args: argparse.Namespace) -> int:
    """List or delete captured traffic (user content: the operator's to keep or remove)."""
    from orchestrator.data.storage import open_storage
    from orchestrator.data.traffic import delete_traffic, traffic_shards

    storage = open_storage(args.output)
    if args.action == "list":
        shards = traffic_shards(storage)
        tokens = sum(r["num_tokens"] for r in shards)
        size = sum(r["bytes"] for r in shards)
        print(
            f"{len(shards)} shards, {sum(r['num_sequences'] for r in shards)} requests, {tokens} tokens, {size} bytes"
        )
        return 0
    if args.older_than_hours is None and not args.all:
        raise AerieError("traffic delete: give --older-than-hours H, or --all to delete every captured request")
    deleted = delete_traffic(storage, None if args.all else args.older_than_hours)
    print(f"deleted {deleted} shards from {storage.uri()}")
    return 0


def _canary_replay(args: argparse.Namespace) -> int:
    """A canary's recorded counters, resampled and decided again `--replays` times (serving/canary.py)."""
    from orchestrator.serving.canary import replays

    path = Path(args.record)
    if not path.is_file():
        raise AerieError(f"{path} does not exist: give a rollout's record.json")
    if args.replays < 1 or args.block < 1:
        raise AerieError("--replays and --block must be at least 1")
    test = {"tolerance": args.tolerance, "min_drafts": args.min_drafts, "alpha": args.alpha, "window_s": args.window_s}
    if args.max_window_s is not None:
        test["max_window_s"] = args.max_window_s
    try:
        result = replays(json.loads(path.read_text()), args.replays, test, args.seed, args.block)
    except (ValueError, KeyError) as err:
        raise AerieError(f"{path}: {err}") from err
    sizes = [(v["canary_drafts"], v["stable_drafts"]) for v in result["verdicts"]]
    print(
        json.dumps(result["decisions"]),
        f"in {args.replays} replays; drafts per decision (canary, stable): median {sorted(sizes)[len(sizes) // 2]}",
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _load(args: argparse.Namespace) -> int:
    """Steady streaming load on a served model (benchmarks/load.py)."""
    import asyncio

    from orchestrator.benchmarks.load import steady_load
    from orchestrator.data.prompts import humaneval_prompts, mtbench_first_turns, read_prompt_file
    from orchestrator.serving.app import CAPTURE_HEADER
    from orchestrator.serving.guard import auth_headers

    if args.prompts == "humaneval":
        prompts = humaneval_prompts()
    elif args.prompts == "mtbench":
        prompts = mtbench_first_turns()
    else:
        items = [i for i in read_prompt_file(args.prompts) if i.error is None]
        prompts = [{"messages": i.messages} if i.messages else {"prompt": i.prompt} for i in items]
    headers = auth_headers() | ({CAPTURE_HEADER: "off"} if args.no_capture else {})
    summary = asyncio.run(
        steady_load(args.url.rstrip("/"), prompts, args.users, 60 * args.minutes, args.max_tokens, headers)
    )
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["failed"] else 0


def _key_id(args: argparse.Namespace) -> int:
    from orchestrator.serving.guard import key_id

    key = sys.stdin.readline().strip()
    if not key:
        raise AerieError("key-id reads the API key from stdin: `aerie key-id < keyfile` (never pass it as a flag)")
    print(key_id(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aerie", description="EAGLE-3 / 3.1 drafters: train, evaluate, serve")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="convert a packaged model into a Hugging Face directory")
    p.add_argument("name", help="packaged model name, e.g. smollm2-135m-instruct")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("init-drafter", help="write an untrained EAGLE drafter for a target (vLLM format)")
    p.add_argument("--model", required=True, help="target model directory")
    p.add_argument("--out", required=True)
    p.add_argument("--variant", choices=("eagle3", "eagle3.1"), default="eagle3.1")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_init_drafter)

    p = sub.add_parser("prompts", help="write a built-in prompt set as JSONL")
    p.add_argument("name", help="prompt set: mtbench (first turns)")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.set_defaults(func=_prompts)

    p = sub.add_parser("generate", help="generate completions for a JSONL prompt file")
    p.add_argument("--model", required=True, help="Hugging Face model directory (the target)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 / 3.1 drafter directory (vLLM format)")
    p.add_argument("--prompts", required=True, help='JSONL: {"messages": [...]} or {"prompt": "..."} per line')
    p.add_argument("--out", required=True, help="output JSONL, one line per input line")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--engine", choices=("local", "vllm"), default="local")
    p.add_argument("--batch-size", type=int, default=8, help="local engine: requests decoded together")
    p.add_argument("--spec", choices=("chain", "tree"), default="chain", help="local engine: draft shape")
    p.add_argument("--num-spec-tokens", type=int, default=3, help="chain: draft tokens per round")
    p.add_argument("--depth", type=int, default=4, help="tree: most draft levels")
    p.add_argument("--topk", type=int, default=4, help="tree: children per expanded node")
    p.add_argument("--budget", type=int, default=16, help="tree: draft tokens verified per request and round")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="local engine: auto = GPU if any")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help="auto: bf16 on GPU"
    )
    p.set_defaults(func=_generate)

    p = sub.add_parser("convert-drafter", help="rewrite a drafter in another dtype, with its provenance")
    p.add_argument("src", help="drafter directory (vLLM format)")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument(
        "--train-config",
        default=None,
        help="the training config file it started from (recorded; the config it ran with, overrides applied, "
        "comes from train_config.json beside the export)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="the collection it was trained on, or the collect config of an online training (its manifest sha256 is "
        "recorded)",
    )
    p.add_argument("--evaluation", default=None, help="an evaluation's result.json: its tau table is recorded")
    p.add_argument("--evaluation-name", default="eagle3.1", help="this drafter's name in that evaluation")
    p.set_defaults(func=_convert_drafter)

    p = sub.add_parser("demo", help="answer prompts with and without speculation; acceptance length and speed-up")
    p.add_argument("--model", required=True, help="target model directory")
    p.add_argument("--drafter", required=True, help="EAGLE-3 / 3.1 drafter directory (vLLM format)")
    p.add_argument("--prompts", required=True, help='JSONL: {"messages": [...]} or {"prompt": "..."} per line')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each prompt per mode (interleaved)")
    p.add_argument("--spec", choices=("chain", "tree"), default="chain")
    p.add_argument("--num-spec-tokens", type=int, default=5, help="chain: draft tokens per round")
    p.add_argument("--depth", type=int, default=5, help="tree: most draft levels")
    p.add_argument("--budget", type=int, default=16, help="tree: draft tokens verified per round")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="of both models (auto: bfloat16 on a GPU, float32 on the CPU; bfloat16 is exact on the CPU too, and "
        "fast where it has AVX512-BF16 or AMX)",
    )
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    p.set_defaults(func=_demo)

    p = sub.add_parser("serve", help="start an OpenAI-compatible server from a Ray Serve config file")
    p.add_argument(
        "--config", default=None, help="Serve config (default: the backend's configs/smollm2-135m/serve*.yaml)"
    )
    p.add_argument(
        "--backend",
        choices=("disaggregated", "vllm"),
        default=None,
        help="disaggregated: draft and target workers on Ray; vllm: vLLM's EAGLE on Ray Serve LLM",
    )
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--host", default=None, help="HTTP host (default: the config's)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the application's args")
    p.set_defaults(func=_serve)

    p = sub.add_parser("traffic", help="list or delete the traffic a server's tap captured")
    p.add_argument("action", choices=("list", "delete"))
    p.add_argument("--output", required=True, help="the tap's output (tap.output): a directory or s3://...")
    p.add_argument("--older-than-hours", type=float, default=None, help="delete: shards written before then")
    p.add_argument("--all", action="store_true", help="delete: every captured request")
    p.set_defaults(func=_traffic)

    p = sub.add_parser("load", help="steady streaming load on a served model (e.g. for the traffic tap)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (its OpenAI base, without /v1)")
    p.add_argument("--prompts", default="humaneval", help="humaneval (code), mtbench, or a JSONL prompt file")
    p.add_argument("--users", type=int, default=2, help="clients sending at once, each as soon as its last ended")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-capture", action="store_true", help="send X-Aerie-Capture: off (the tap keeps none)")
    p.add_argument("--out", default=None, help="also write the summary as JSON here")
    p.set_defaults(func=_load)

    p = sub.add_parser("canary-replay", help="decide a recorded canary again on resampled counter streams")
    p.add_argument("record", help="a rollout's record.json (jobs.deploy's output_dir/<time>/record.json)")
    p.add_argument("--replays", type=int, default=200, help="resampled streams, each decided once")
    p.add_argument("--tolerance", type=float, default=0.1)
    p.add_argument("--min-drafts", type=int, default=50)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--window-s", type=float, default=60.0, help="no decision before this many seconds")
    p.add_argument(
        "--max-window-s", type=float, default=None, help="undecided by then: inconclusive (default: the end)"
    )
    p.add_argument("--block", type=int, default=5, help="consecutive polls resampled together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write every decision as JSON here")
    p.set_defaults(func=_canary_replay)

    p = sub.add_parser("key-id", help="an API key's id (for tap.no_capture_key_ids), the key read from stdin")
    p.set_defaults(func=_key_id)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AerieError as err:
        print(f"error: {redact_text(str(err))}", file=sys.stderr)
        return 2
    except ValidationError as err:
        first = err.errors()[0]
        print(f"error: {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
