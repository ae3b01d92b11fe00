"""The vLLM backend: vLLM's own EAGLE-3 / 3.1 speculative decoding (drafter colocated with the target) served
by Ray Serve LLM (`ray.serve.llm`), with the same OpenAI surface as the disaggregated backend.

    HTTP ──> Guard ──> OpenAiIngress (Ray Serve LLM) ──> LLMServer replica ──> vLLM AsyncLLM (target + EAGLE drafter)

The Guard (`serving/guard.py`) checks the API key, the body size and the replica's queue, and validates each
request with the disaggregated backend's own check (`protocol.check_request`): a request either backend would
refuse, or would read differently (a field the disaggregated backend does not implement), is refused by both.
Only the routes both backends have are exposed: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

The drafter comes from a directory, an `s3://` prefix or an MLflow model URI (`models:/NAME/VERSION`,
`models:/NAME@ALIAS`); remote ones are fetched to `drafter_cache_dir` when the application is built (a path
every node must see: one machine, or a shared filesystem). vLLM names EAGLE-3 and EAGLE-3.1 checkpoints alike
(`method: eagle3`): the 3.1 switches are in the drafter's config.

`serve run configs/smollm2-135m/serve-vllm.yaml`, `serve deploy ...` or
`aerie serve --backend vllm --config configs/smollm2-135m/serve-vllm.yaml` start it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from orchestrator.config import StrictModel
from orchestrator.serving.protocol import Limits


class VllmServeConfig(StrictModel):
    """The application's `args` in a Serve config file (backend `vllm`)."""

    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    served_model_name: str | None = Field(None, description="the `model` clients send (default: the model's name)")
    models_dir: str = Field("models", description="where packaged models are prepared")
    drafter: str | None = Field(None, description="drafter: a directory, s3://... or models:/NAME@ALIAS")
    speculation: bool = Field(True, description="False: no drafter (the baseline, same deployment code)")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="draft tokens per step (vLLM drafts chains)")
    max_model_len: int = Field(2048, ge=16, description="context length the engine is sized for")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("float32", description="vLLM model dtype")
    max_num_seqs: int = Field(64, ge=1, description="most sequences vLLM batches")
    kv_cache_gib: int = Field(2, ge=1, description="CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    engine_kwargs: dict = Field({}, description="more vLLM engine arguments (applied last)")
    env_vars: dict[str, str] = Field({}, description="environment of the engine's replica")
    num_cpus: float = Field(1, ge=0, description="CPUs of each replica's placement bundle")
    num_gpus: float = Field(0, ge=0, description="GPUs of each replica's placement bundle")
    num_replicas: int = Field(1, ge=1, description="engine replicas (data parallel)")
    tensor_parallel_size: int = Field(1, ge=1, description="devices per replica (one placement bundle each)")
    limits: Limits = Field(default_factory=Limits, description="what one request may ask; the queue's bound")
    drafter_cache_dir: str = Field("runs/drafter-cache", description="where s3:// and models:/ drafters go")

    @field_validator("limits")
    @classmethod
    def _prompt_limit(cls, v: Limits) -> Limits:
        if v.max_prompt_tokens is not None:
            raise ValueError("vLLM bounds the prompt by max_model_len: leave limits.max_prompt_tokens unset")
        return v


def llm_config(cfg: VllmServeConfig):
    """The `ray.serve.llm.LLMConfig` of this backend (model and drafter resolved to local directories)."""
    from ray.serve.llm import LLMConfig

    from orchestrator.errors import AerieError
    from orchestrator.models.prepare import resolve_model
    from orchestrator.tracking.store import fetch_drafter

    model_dir = resolve_model(cfg.model, cfg.models_dir)
    engine = {
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "enforce_eager": True,
    }
    if cfg.speculation:
        if cfg.drafter is None:
            raise AerieError("speculation=true needs a drafter (a directory, s3://... or models:/...)")
        drafter = fetch_drafter(cfg.drafter, cfg.drafter_cache_dir)
        engine["speculative_config"] = {
            "method": "eagle3",
            "model": str(drafter.resolve()),
            "num_speculative_tokens": cfg.num_speculative_tokens,
        }
    engine.update(cfg.engine_kwargs)
    bundle = {"CPU": cfg.num_cpus, **({"GPU": cfg.num_gpus} if cfg.num_gpus else {})}
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), **cfg.env_vars}
    return LLMConfig(
        model_loading_config={"model_id": cfg.served_model_name or model_dir.name, "model_source": str(model_dir)},
        engine_kwargs=engine,
        placement_group_config={"bundles": [bundle]},
        runtime_env={"env_vars": env},
        deployment_config={
            "num_replicas": cfg.num_replicas,
            "max_ongoing_requests": cfg.max_num_seqs + cfg.limits.max_queued,
            "health_check_period_s": 10,
        },
        log_engine_metrics=True,
    )


def build_app(args: dict):
    """Application builder for Serve config files: `import_path: orchestrator.serving.vllm_app:build_app`."""
    from orchestrator.serving.vllm_ingress import guarded_openai_app

    cfg = VllmServeConfig.model_validate(args)
    return guarded_openai_app(
        llm_config(cfg), cfg.limits, max_in_flight=cfg.max_num_seqs * cfg.num_replicas + cfg.limits.max_queued
    )
