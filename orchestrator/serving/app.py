"""The disaggregated speculative-decoding server: an OpenAI-compatible Ray Serve application.

    HTTP ──> SpecServer replica (FastAPI ingress + SpecScheduler) ──> TargetWorker actor  (target node group)
                                                                └──> DraftWorker actor   (draft node group)

A token's path: this file (the request is parsed and validated by `protocol.py`, then submitted) ->
`runtime/scheduler.py` (rounds) -> `runtime/workers.py` (the target's forward, accept, emit) ->
`spec/verify.py` (which token) -> back through the scheduler's `text_events` (`runtime/detok.py`: text and
stop strings) to the SSE chunks or the JSON response here.

Each replica owns one TargetWorker and one DraftWorker, placed by resources, custom resources (`target`,
`draft`), node labels or a placement group; more replicas serve in parallel (data parallel). The replica
pins the drafter (a directory, s3:// or models:/) and reads only its config.json, to have the target capture
its aux layers; the DraftWorker fetches that exact version on its own node (`tracking/store.py`). Endpoints:
`/v1/chat/completions`, `/v1/completions` (SSE streaming or not), `/v1/models`, `/health` (503 when the
target cannot admit work), and `/stats` (the scheduler's totals, KV slots, queue, and the round timeline,
for benchmarks and rollouts). Every route but `/health` needs an API key, and a replica holds at most
`max_batch + limits.max_queued` requests (then 429): `serving/guard.py`.

`serve run configs/smollm2-135m/serve.yaml`, `serve deploy ...` or `aerie serve --config ...` start it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from ray import serve

from orchestrator.cluster import Placement, WorkerResources
from orchestrator.data.prompts import render_chat
from orchestrator.data.traffic import TapConfig
from orchestrator.errors import AerieError
from orchestrator.models.device import DtypeName
from orchestrator.runtime.detok import TextStream
from orchestrator.runtime.scheduler import SchedulerConfig, SpecScheduler
from orchestrator.serving.backends import ServedModel, import_object
from orchestrator.serving.guard import Guard, api_keys, key_id
from orchestrator.serving.protocol import Chunker, Limits, RequestError, check_request, sse, status_body, usage
from orchestrator.spec.proposer import SpecConfig
from orchestrator.tracking.store import DrafterRef

log = logging.getLogger(__name__)
CAPTURE_HEADER = "x-aerie-capture"  # "off": the traffic tap never keeps this request


class SpecServeConfig(ServedModel):
    """The application's `args` in a Serve config file."""

    dtype: DtypeName = Field("auto", description="weights and KV caches: auto = bfloat16 on CUDA, float32 on CPU")
    max_model_len: int | None = Field(
        None, ge=16, description="context per request (prompt + output); sizes the KV caches (default: the model's)"
    )
    spec: SpecConfig = Field(default_factory=SpecConfig, description="draft tree shape per request")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="how requests are batched and drafted"
    )
    target: WorkerResources = Field(
        default_factory=WorkerResources, description="what the target worker of each replica reserves and where it runs"
    )
    draft: WorkerResources = Field(
        default_factory=WorkerResources, description="what the draft worker of each replica reserves and where it runs"
    )
    server: Placement = Field(
        default_factory=Placement,
        description="where each replica (its scheduler, which calls both workers every round) runs; across nodes "
        "put it on its target's node group ({label_selector: {aerie/group: target}}): the target's pairs for the "
        "drafter then cross one link, not two, and losing a draft node leaves it serving target-only",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None, description="put the two workers in one placement group with this strategy"
    )
    num_replicas: int = Field(1, ge=1, description="data-parallel replicas, each with its own workers")
    limits: Limits = Field(default_factory=Limits, description="what one request may ask; the queue's bound")
    default_max_tokens: int = Field(512, ge=1, description="when a request sets none")
    tap: TapConfig = Field(
        default_factory=TapConfig, description="capture served traffic for training (off by default: user content)"
    )
    proposer_factory: str | None = Field(None, description="'module:callable' building a Proposer (tests)")
    proposer_args: dict = Field({}, description="keyword arguments of proposer_factory")
    drafter_cache_dir: str = Field(
        "runs/drafter-cache", description="where each draft worker puts s3:// and models:/ drafters, on its node"
    )


def context_length(max_model_len: int | None, hf: dict) -> int:
    """Tokens per request (prompt + output): the configured max_model_len, at most the model's context."""
    model_max = int(hf.get("max_position_embeddings", 2048))
    if max_model_len is None:
        return model_max
    if max_model_len > model_max:
        raise AerieError(f"max_model_len {max_model_len} exceeds the model's context of {model_max} tokens")
    return max_model_len


class _Workers:
    """The replica's two actors (created here, owned by the replica: they go when it goes)."""

    def __init__(
        self, cfg: SpecServeConfig, model_dir: str, aux_ids: list[int], eos: list[int], drafter: DrafterRef | None
    ) -> None:
        """drafter: the pinned drafter the draft worker fetches on its node (None: `proposer_factory` builds)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from orchestrator.runtime.workers import DraftWorker, TargetWorker
        from orchestrator.spec.proposer import load_eagle_proposer

        tag = serve.get_replica_context().replica_id.unique_id
        self.names = {"target": f"aerie-target-{tag}", "draft": f"aerie-draft-{tag}"}
        placements = {"target": cfg.target, "draft": cfg.draft}
        options = {}
        pg = None
        if cfg.placement_strategy:
            pg = placement_group([cfg.target.bundle(), cfg.draft.bundle()], strategy=cfg.placement_strategy)
            ray.get(pg.ready(), timeout=300)
        for i, (role, p) in enumerate(placements.items()):
            opts = p.actor_options(max_restarts=-1, max_task_retries=0, name=self.names[role], namespace="aerie")
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            options[role] = opts
        max_batch = cfg.scheduler.max_batch
        self.target = (
            ray.remote(TargetWorker)
            .options(**options["target"])
            .remote(
                model_dir,
                eos,
                max_batch,
                aux_ids,
                cfg.target.torch_threads,
                device=cfg.target.torch_device(),
                dtype=cfg.dtype,
                max_model_len=cfg.max_model_len,
                tap=cfg.tap if cfg.tap.enabled else None,
                tap_writer=self.names["target"],
            )
        )
        self.draft = None
        if cfg.speculation:
            depth, topk, _ = cfg.spec.shape()
            if cfg.proposer_factory:
                factory = functools.partial(import_object(cfg.proposer_factory), **cfg.proposer_args)
            else:
                factory = functools.partial(
                    load_eagle_proposer,
                    drafter,
                    model_dir,
                    depth,
                    topk,
                    max_batch,
                    cache_dir=cfg.drafter_cache_dir,
                    aux_layer_ids=aux_ids,
                    device=cfg.draft.torch_device(),
                    dtype=cfg.dtype,
                    max_model_len=cfg.max_model_len,
                )
            self.draft = (
                ray.remote(DraftWorker).options(**options["draft"]).remote(factory, max_batch, cfg.draft.torch_threads)
            )
        handles = {"target": self.target, "draft": self.draft}
        self.info = {role: _ready(role, h) for role, h in handles.items() if h is not None}


def may_capture(tap: TapConfig, headers) -> bool:
    """Whether the traffic tap may keep a request with these (lower-case) headers: the tap is on, the client did
    not opt out (`X-Aerie-Capture: off`), and its key is not one configured as never captured."""
    if not tap.enabled:
        return False
    if headers.get(CAPTURE_HEADER, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    _, _, key = headers.get("authorization", "").partition(" ")
    return key_id(key.strip()) not in tap.no_capture_key_ids


def _ready(role: str, handle) -> dict:
    """A worker's `ready()` answer; a worker that cannot serve (a drafter that does not load on its node) is an
    AerieError of one line (its traceback is in the worker's log)."""
    import ray

    from orchestrator.errors import AerieError

    try:
        return ray.get(handle.ready.remote(), timeout=600)
    except ray.exceptions.RayTaskError as err:
        raise AerieError(f"{role} worker: {err.cause}") from None


def _drafter_ref(cfg: SpecServeConfig) -> DrafterRef:
    """The drafter pinned to its exact version; only its config.json is read here (the draft worker fetches
    the weights on its own node, into its `drafter_cache_dir`)."""
    from orchestrator.errors import AerieError
    from orchestrator.tracking.store import read_drafter_ref

    if cfg.drafter is None:
        raise AerieError(
            "speculation=true needs a drafter (a directory, s3://... or models:/...), or speculation=false"
        )
    return read_drafter_ref(cfg.drafter, cfg.mlflow_tracking_uri)


def _error_body(event) -> dict:
    """A failed request's error event as OpenAI's error body (400: the request was at fault)."""
    return status_body(event.error, event.status)


# Serve pickles the ingress class when it is decorated: everything it calls is defined above it.
api = FastAPI(title="aerie-spec")


@serve.deployment
@serve.ingress(api)
class SpecServer:
    """OpenAI-compatible ingress over a SpecScheduler and its two workers."""

    def __init__(self, config: dict) -> None:
        from orchestrator.models.checkpoint import drafter_config_from_hf
        from orchestrator.models.prepare import resolve_model
        from orchestrator.models.target import default_aux_layer_ids, read_hf_config
        from orchestrator.models.tokenizer import eos_token_ids, load_tokenizer
        from orchestrator.runtime.clients import RemoteWorker
        from orchestrator.runtime.metrics import ServingMetrics

        cfg = SpecServeConfig.model_validate(config)
        api_keys()  # no key configured: the replica does not start (the error says how to set one)
        if not any(m.cls is Guard for m in api.user_middleware):
            in_flight = cfg.scheduler.max_batch + cfg.limits.max_queued
            api.add_middleware(Guard, max_body_bytes=cfg.limits.max_body_bytes, max_in_flight=in_flight)
        self.limits = cfg.limits
        self.tap = cfg.tap
        # Prompts are tokenized off the event loop (a long one would stall every stream of the replica), in one
        # thread: a tokenizer is not safe to share between threads.
        self.tokenize = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        model_dir = resolve_model(cfg.model, cfg.models_dir)
        hf = read_hf_config(model_dir)
        self.name = cfg.served_model_name or model_dir.name
        self.context = context_length(cfg.max_model_len, hf)
        self.default_max_tokens = cfg.default_max_tokens
        self.tokenizer = load_tokenizer(model_dir)
        eos = eos_token_ids(model_dir, self.tokenizer)
        aux = list(default_aux_layer_ids(hf["num_hidden_layers"]))
        drafter = None
        if cfg.speculation and cfg.proposer_factory is None:
            drafter = _drafter_ref(cfg)
            layers = hf["num_hidden_layers"]  # the target captures exactly the drafter's aux layers:
            aux = list(drafter_config_from_hf(drafter.config, target_num_layers=layers).aux_layer_ids)
        self.workers = _Workers(cfg, str(model_dir), aux, eos, drafter)
        timeouts = cfg.scheduler.draft_timeout_s, cfg.scheduler.worker_timeout_s
        draft = RemoteWorker(self.workers.draft, timeouts[0]) if self.workers.draft is not None else None
        target = RemoteWorker(self.workers.target, timeouts[1])
        self.scheduler = SpecScheduler(target, draft, cfg.scheduler, cfg.spec.shape()[2], ServingMetrics(self.name))
        self.started = False
        log.info("serving %s with workers %s", self.name, self.workers.info)

    # -- endpoints -------------------------------------------------------------------------------------------

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI chat completions (`ChatCompletionRequest`), streamed as SSE or not."""

        def tokenize(req) -> list[int]:
            try:
                return render_chat(self.tokenizer, req.chat())
            except ValueError as err:
                raise RequestError(str(err), "messages") from err

        return await self._serve(request, tokenize, "/v1/chat/completions")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        """OpenAI completions (`CompletionRequest`): a prompt as text or token ids, streamed as SSE or not."""

        def tokenize(req) -> list[int]:
            prompt = req.prompt
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt)["input_ids"])
            if any(not 0 <= t < len(self.tokenizer) for t in prompt):
                raise RequestError("prompt token ids must be within the vocabulary", "prompt")
            return list(prompt)

        return await self._serve(request, tokenize, "/v1/completions")

    @api.get("/v1/models")
    async def models(self):
        """The served model's card (its `max_model_len` included)."""
        card = {"id": self.name, "object": "model", "created": 0, "owned_by": "aerie", "max_model_len": self.context}
        return {"object": "list", "data": [card]}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str):
        """One model's card; 404 for another name."""
        if model != self.name:
            error = RequestError.of("model_not_found", f"The model `{model}` does not exist", "model")
            return JSONResponse(error.body(), status_code=error.status)
        return (await self.models())["data"][0]

    @api.get("/health")
    async def health(self):
        """503 when the target cannot admit work (SpecScheduler.health says why)."""
        self._start()
        problem = await self.scheduler.health()
        if problem is not None:
            error = RequestError.of("unavailable", f"target worker unavailable: {problem}")
            return JSONResponse(error.body(), status_code=error.status)
        return {
            "status": "ok",
            "draft_alive": self.scheduler.draft_alive,
            "workers": self.workers.info,
            "actor_names": self.workers.names,
        }

    @api.post("/measure")
    async def measure(self, request: Request):
        """A rollout's canary window: `share` of the rounds for `seconds` are measurement rounds, whole trees
        counted in /stats' acceptance_measured (SpecScheduler.measure; the same share again moves an open
        window's end)."""
        try:
            body = await request.json()
            share, seconds = float(body["share"]), float(body["seconds"])
            if not (0 <= share <= 1 and 0 <= seconds <= 86400):
                raise ValueError("share in [0, 1], seconds in [0, 86400]")
        except (ValueError, KeyError, TypeError) as err:
            error = RequestError(f"measure takes {{share, seconds}}: {err}", "share")
            return JSONResponse(error.body(), status_code=400)
        self._start()
        self.scheduler.measure(share, seconds)
        return {"share": share, "seconds": seconds}

    @api.get("/stats")
    async def stats(self, trace: bool = False):
        """The scheduler's totals, acceptance, KV slots and queue (`?trace=true`: its round timeline too)."""
        # A monitoring read (the rollout polls it): a worker busy with queued rounds does not hold it up, its
        # last known slot count is shown and `slots_stale` names it.
        answers = await self.scheduler.refresh_slots(timeout_s=2.0)
        out = self.scheduler.stats()
        out["replica"] = serve.get_replica_context().replica_id.unique_id  # these totals are this replica's
        out["slots_stale"] = sorted(name for name, answer in answers.items() if "error" in answer)
        if trace:
            out["trace"] = list(self.scheduler.trace)
        return out

    # -- generation ------------------------------------------------------------------------------------------

    async def _serve(self, request: Request, tokenize, path: str):
        chat = path == "/v1/chat/completions"
        try:
            req = check_request(path, await request.body(), self.limits, self.name)
            prompt_ids = await asyncio.get_running_loop().run_in_executor(self.tokenize, tokenize, req)
            asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
            params = req.sampling(self._max_tokens(len(prompt_ids), asked))
        except RequestError as err:
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        self._start()
        handle = self.scheduler.submit(prompt_ids, params, capture=may_capture(self.tap, request.headers))
        text = TextStream(self.tokenizer, params.stop)
        chunker = Chunker(chat, self.name)
        if req.stream:
            return StreamingResponse(
                self._stream(handle, text, chunker, len(prompt_ids), req.include_usage), media_type="text/event-stream"
            )
        return await self._complete(handle, text, chunker, len(prompt_ids))

    def __del__(self) -> None:
        """Serve shuts the replica down: the traffic tap writes what it still holds before the workers go."""
        workers, tap = getattr(self, "workers", None), getattr(self, "tap", None)
        if workers is None or tap is None or not tap.enabled:
            return
        import ray

        try:
            ray.get(workers.target.close_tap.remote(), timeout=40)
        except Exception as err:  # noqa: BLE001 (shutting down: nothing else to do but say so)
            log.warning("the traffic tap could not write what it held: %s", type(err).__name__)

    def _start(self) -> None:
        """The scheduler's loops start with the replica's event loop (the first request or health check)."""
        if not self.started:
            self.scheduler.start()
            self.started = True

    def _max_tokens(self, prompt_len: int, asked: int | None) -> int:
        cap = self.limits.max_prompt_tokens
        if cap is not None and prompt_len > cap:
            raise RequestError(f"the prompt has {prompt_len} tokens; this server takes at most {cap}", "messages")
        room = self.context - prompt_len
        if room < 1:
            raise RequestError(
                f"This model's maximum context length is {self.context} tokens; the prompt has {prompt_len}",
                "messages",
            )
        if asked is None:
            return min(room, self.default_max_tokens)
        if asked > room:
            raise RequestError(
                f"This model's maximum context length is {self.context} tokens. However, you requested "
                f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the completion).",
                "max_tokens",
            )
        return asked

    async def _complete(self, handle, text: TextStream, chunker: Chunker, prompt_len: int):
        parts, finish = [], None
        try:
            async for delta, reason, error in self.scheduler.text_events(handle, text):
                if error is not None:
                    return JSONResponse(_error_body(error), status_code=error.status)
                parts.append(delta)
                finish = reason or finish
        finally:
            self.scheduler.abort(handle.id)  # no-op when finished; frees the slots when the client left
        return chunker.response("".join(parts), finish, usage(prompt_len, len(text.ids)))

    async def _stream(self, handle, text: TextStream, chunker: Chunker, prompt_len: int, include_usage: bool):
        try:
            yield chunker.chunk("", first=True)
            async for delta, reason, error in self.scheduler.text_events(handle, text):
                if error is not None:
                    yield sse(_error_body(error) | {"status": error.status})
                    break
                if delta:
                    yield chunker.chunk(delta)
                if reason:
                    yield chunker.chunk(None, finish_reason=reason)
                    if include_usage:
                        yield chunker.usage_chunk(usage(prompt_len, len(text.ids)))
            yield sse("[DONE]")
        finally:
            self.scheduler.abort(handle.id)


def build_app(args: dict) -> serve.Application:
    """Application builder for Serve config files: `import_path: orchestrator.serving.app:build_app`."""
    cfg = SpecServeConfig.model_validate(args)
    deployment = SpecServer.options(
        num_replicas=cfg.num_replicas,
        # Serve sends a replica more than its Guard admits, so that the excess gets 429 at once (not a queue).
        max_ongoing_requests=cfg.scheduler.max_batch + cfg.limits.max_queued + 32,
        ray_actor_options={"num_cpus": 0, **cfg.server.placement_options()},
        health_check_period_s=10,
    )
    return deployment.bind(cfg.model_dump())
