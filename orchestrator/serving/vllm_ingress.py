"""Ray Serve LLM's OpenAI ingress with the Guard in front (`build_openai_app`'s steps, one model, our routes).

Separate from `vllm_app.py` because importing Ray Serve LLM's ingress is slow: only the builder needs it.
"""

from __future__ import annotations

import functools

from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init, make_fastapi_ingress
from ray.llm._internal.serve.core.server.builder import build_llm_deployment

from orchestrator.serving.guard import Guard, api_keys
from orchestrator.serving.protocol import ROUTES as SHARED_ROUTES
from orchestrator.serving.protocol import Limits, check_request

# The routes the disaggregated backend has too (`protocol.ROUTES`: Ray Serve LLM's, and `/health`, open, as there).
ROUTES = {
    **{k: DEFAULT_ENDPOINTS[k] for k in SHARED_ROUTES if k != "health"},
    "health": lambda app: app.get(SHARED_ROUTES["health"][1]),
}


class KeyedIngress(OpenAiIngress):
    """OpenAiIngress that does not start without an API key (the error says how to set one), with `/health`."""

    def __init__(self, *args, **kwargs) -> None:
        api_keys()
        super().__init__(*args, **kwargs)

    async def health(self) -> dict:
        """The ingress answers (Serve checks the engine's replicas itself: an unhealthy one is replaced)."""
        return {"status": "ok"}


def _check(limits: Limits, served: str, path: str, body: bytes) -> bytes | None:
    """The disaggregated backend's check; vLLM gets the request as validated (the fields the client set, without
    those we accept only at their neutral value: vLLM refuses `tools: []`)."""
    req = check_request(path, body, limits, served)
    return None if req is None else req.model_dump_json(exclude_unset=True).encode()


def guarded_openai_app(llm, limits: Limits, max_in_flight: int) -> serve.Application:
    app = init()
    app.add_middleware(
        Guard,
        max_body_bytes=limits.max_body_bytes,
        max_in_flight=max_in_flight,
        check=functools.partial(_check, limits, llm.model_id),
    )
    ingress = make_fastapi_ingress(KeyedIngress, endpoint_map=ROUTES, app=app)
    # The ingress only routes HTTP to the engine's replica: no CPU reserved for it (as for SpecServer), so a
    # small node's CPUs go to the engine's placement bundle. One replica: its Guard counts the whole queue.
    return serve.deployment(
        ingress, num_replicas=1, max_ongoing_requests=max_in_flight + 32, ray_actor_options={"num_cpus": 0}
    ).bind(
        llm_deployments={llm.model_id: build_llm_deployment(llm)},
        model_cards={llm.model_id: to_model_metadata(llm.model_id, llm)},
        lora_paths={},
    )
