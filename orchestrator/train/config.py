"""`python -m jobs.train_drafter` settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from orchestrator.config import StrictModel


class DrafterSpec(StrictModel):
    variant: Literal["eagle3", "eagle3.1"] = Field(
        description="eagle3, or eagle3.1 (fc_norm + norm_output); the explicit flags below override it"
    )
    fc_norm: bool | None = Field(None, description="RMSNorm per target hidden state before fc")
    norm_output: bool | None = Field(None, description="feed the post-norm hidden state to the next step")
    norm_before_fc: bool | None = Field(None, description="one RMSNorm over the concatenated aux states")
    draft_vocab_size: int = Field(8192, ge=1, description="most frequent loss-masked target tokens")
    draft_vocab_coverage: float | None = Field(
        None,
        gt=0,
        le=1,
        description="size the vocabulary by coverage instead: the fewest most frequent tokens that cover this share"
        " of the loss-masked training tokens, rounded up to a multiple of 64 (overrides draft_vocab_size)",
    )
    num_hidden_layers: int = Field(1, ge=1, description="the drafter's decoder layers")
    init_from: str | None = Field(
        None, description="warm start: a drafter directory, s3:// URI or models:/NAME/VERSION | models:/NAME@ALIAS"
    )
    init_layer_from: int | None = Field(
        None,
        ge=0,
        description="start the drafter's decoder layer from the target's layer N (a fresh drafter only; the head and "
        "norm always start from the target's)",
    )
    continue_from: str | None = Field(
        None,
        description="a committed drafter directory (aerie convert-drafter's, with provenance.json) to go on training "
        "when it holds one: its weights, vocabulary, data position and token count carry on; AdamW's moments do not "
        "(the optimizer restarts with its warmup). Empty or absent: train from scratch",
    )
    seed: int = Field(0, description="seed of a fresh drafter's initial weights")

    @model_validator(mode="after")
    def _one_vocabulary(self):
        if self.init_from and self.draft_vocab_coverage is not None:
            raise ValueError("init_from keeps the warm drafter's vocabulary: drop draft_vocab_coverage")
        if self.init_from and self.continue_from:
            raise ValueError("set init_from (a warm start) or continue_from (the same drafter, trained on), not both")
        return self

    def flags(self) -> dict:
        """Explicit flag overrides on top of the variant."""
        names = ("fc_norm", "norm_output", "norm_before_fc")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if self.num_hidden_layers != 1:
            out["num_hidden_layers"] = self.num_hidden_layers
        return out


class OptimConfig(StrictModel):
    lr: float = Field(3e-4, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay, on matrices only (not on norms)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2)")
    warmup_steps: int = Field(50, ge=0, description="optimizer steps of linear warm-up to lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay ends at lr * this")
    grad_clip: float = Field(0.5, gt=0, description="max global gradient norm")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")


class WorkerConfig(StrictModel):
    num_cpus: float = Field(1.0, ge=0, description="CPUs each Ray Train worker reserves")
    use_gpu: bool = Field(False, description="each worker reserves a GPU and trains on it")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per worker")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per worker")
    allocator: Literal["jemalloc", "glibc"] = Field(
        "jemalloc",
        description="host memory allocator of the workers: jemalloc (Ray's own copy, preloaded) or the C library's, "
        "whose heap a long CPU run fragments (docs/benchmarks.md)",
    )


class CheckpointSpec(StrictModel):
    storage_path: str = Field(
        "runs/train", description="Ray Train storage: a local directory or s3://bucket/prefix (shared on clusters)"
    )
    every_steps: int = Field(100, ge=1, description="optimizer steps between checkpoints (and one at the end)")
    num_to_keep: int = Field(2, ge=1, description="checkpoints kept, the newest")


class MlflowSpec(StrictModel):
    tracking_uri: str | None = Field(None, description="None: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db")
    experiment: str = Field("aerie-drafters", description="MLflow experiment of the training run")
    registered_model: str | None = Field(None, description="register the exported drafter under this name")
    aliases: list[str] = Field(default_factory=list, description="aliases set on the new version, e.g. candidate")


class OnlineData(StrictModel):
    """`data: online`: hidden states captured while training, from the collection config's conversations."""

    collect: str = Field(description="the collection's config file (jobs.collect_hidden_states'); its output is unused")
    overrides: list[str] = Field([], description="key=value overrides of it")
    prefetch_shards: int = Field(2, ge=1, description="shards captured ahead of each trainer (the memory bound)")


class TrainConfig(StrictModel):
    """Drafter training with the EAGLE-3 training-time test on Ray Train."""

    name: str = Field(description="run name: the Ray Train run (a rerun resumes it) and the MLflow run")
    model: str = Field(description="target: a Hugging Face directory or a packaged model name")
    models_dir: str = Field("models", description="where packaged models are prepared")
    data: str = Field(
        description="a finished collection (local directory or s3://, see jobs.collect_hidden_states), or 'online'"
    )
    online: OnlineData | None = Field(None, description="with data: online, what is captured and how far ahead")
    output: str = Field(description="where the vLLM-format drafter is exported: local directory or s3://")
    drafter: DrafterSpec = Field(description="the drafter: architecture, vocabulary and starting weights")
    ttt_steps: int = Field(7, ge=1, description="drafting steps unrolled per position")
    step_weight: float = Field(0.8, gt=0, le=1, description="loss weight of step j is step_weight**j")
    batch_tokens: int = Field(4096, ge=1, description="padded tokens per micro-batch per worker")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps")
    max_time_minutes: float | None = Field(None, gt=0, description="training time budget (resumes included)")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="bf16: autocast matmuls (weights stay fp32); auto: bf16 on GPUs, fp32 on CPUs"
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and the learning-rate schedule")
    num_workers: int = Field(1, ge=1, description="Ray Train workers (DDP: gloo on CPU, NCCL on GPU)")
    worker: WorkerConfig = Field(default_factory=WorkerConfig, description="what each Ray Train worker reserves")
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="where and how often checkpoints go (a rerun resumes the latest)"
    )
    mlflow: MlflowSpec = Field(default_factory=MlflowSpec, description="the MLflow run and the registered version")
    eval_every_steps: int = Field(200, ge=1, description="validation loss/accuracy every this many steps")
    eval_max_sequences: int = Field(64, ge=1, description="validation sequences per evaluation (per worker)")
    eval_answer_tokens: int = Field(
        96,
        ge=1,
        description="val_tau_chain replays each held-out first answer up to this many tokens (evaluator's max_tokens)",
    )
    log_every_steps: int = Field(10, ge=1, description="optimizer steps between training metrics logged to MLflow")
    max_failures: int = Field(0, ge=0, description="Ray Train worker-group restarts on failure")
    ray_address: str | None = Field(None, description="None: RAY_ADDRESS if set, else a local Ray")
    seed: int = Field(0, description="order the training sequences are read in (reshuffled each epoch)")

    @model_validator(mode="after")
    def _budget(self) -> TrainConfig:
        if self.max_steps is None and self.max_time_minutes is None:
            raise ValueError("set max_steps or max_time_minutes (or both): training needs an end")
        if (self.data == "online") != (self.online is not None):
            raise ValueError("data: online needs online.collect (a collection config), and online needs data: online")
        if self.drafter.fc_norm and self.drafter.norm_before_fc:
            raise ValueError("drafter.fc_norm and drafter.norm_before_fc are mutually exclusive")
        return self
