"""What each Ray Train worker runs: stream shards -> padded batches -> TTT loss -> AdamW (DDP).

worker r of W: ShardReader(train, rank=r) -> batches of <= batch_tokens -> DraftTrainingModel (DDP)
   every log_every_steps: stats all-reduced; rank 0 logs them to the MLflow run
   every checkpoint.every_steps: state -> ray.train.report(checkpoint) (rank 0 the model, each rank its
   data position), so a rerun of the same run name resumes where the last checkpoint left off
"""

from __future__ import annotations

import math
import resource
import tempfile
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from orchestrator.data.reader import HiddenStateSequence, ShardReader
from orchestrator.errors import AerieError
from orchestrator.models.checkpoint import load_drafter
from orchestrator.models.drafter import DrafterConfig
from orchestrator.models.init import copy_target_layer, new_drafter
from orchestrator.models.target import load_safetensors_dir, read_hf_config
from orchestrator.train.config import TrainConfig
from orchestrator.train.objective import (
    Batch,
    DraftTrainingModel,
    StepStats,
    chain_hits,
    chain_rounds,
    summarise,
    ttt_loss,
)
from orchestrator.train.state import DataPosition, Progress, load_position, load_state, save_position, save_state


def sequence_stream(
    data, rank: int, world: int, seed: int, position: DataPosition
) -> Iterator[tuple[HiddenStateSequence, DataPosition]]:
    """This worker's training sequences, epoch after epoch (reshuffled), from `position` on (data: a collection's
    location, or online shards)."""
    epoch, skip, first = position.epoch, position.consumed, position.first_shard
    while True:
        reader = ShardReader(data, "train", rank, world, seed=seed + epoch, start_shard=first)
        for k, seq in enumerate(reader):
            if k >= skip:
                yield seq, DataPosition(epoch, k + 1, reader.shards_read, first)
        epoch, skip, first = epoch + 1, 0, 0


def batches(stream, batch_tokens: int) -> Iterator[tuple[list[HiddenStateSequence], DataPosition]]:
    """Greedy padded batches: add sequences while batch_size * longest <= batch_tokens (longer ones are cut)."""
    pending, longest, last = [], 0, DataPosition()
    for seq, pos in stream:
        if seq.input_ids.numel() > batch_tokens:
            seq = HiddenStateSequence(seq.conversation_id, *(getattr(seq, f)[:batch_tokens] for f in _FIELDS))
        n = seq.input_ids.numel()
        if pending and (len(pending) + 1) * max(longest, n) > batch_tokens:
            yield pending, last
            pending, longest = [], 0
        pending.append(seq)
        longest, last = max(longest, n), pos
    if pending:
        yield pending, last


_FIELDS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")


def lr_factor(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio over the budget (steps or time, whichever is
    further along)."""
    o = cfg.optim
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    done = []
    if cfg.max_steps:
        done.append((step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps))
    if cfg.max_time_minutes:
        done.append(elapsed_s / (60 * cfg.max_time_minutes))
    frac = min(1.0, max(done))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def build_model(
    cfg: TrainConfig, model_dir: Path, vocab: torch.Tensor, aux: tuple[int, ...], init_from_dir: str | None = None
) -> DraftTrainingModel:
    """A fresh drafter initialised from the target's head and norm (or warm-started), plus frozen pieces."""
    hf = read_hf_config(model_dir)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]  # no lm_head: tied
    weights = load_safetensors_dir(model_dir, names, missing_ok=True)  # these three only, not the whole target
    missing = [n for n in names[:2] if n not in weights]
    if missing:
        raise AerieError(f"target {model_dir} has no {missing}: cannot initialise the drafter from it")
    embed = weights["model.embed_tokens.weight"].float()
    head = weights.get("lm_head.weight", embed).float()
    config = DrafterConfig.for_target(hf, aux, vocab.numel(), cfg.drafter.variant, **cfg.drafter.flags())
    drafter = new_drafter(config, head, weights["model.norm.weight"].float(), vocab, cfg.drafter.seed)
    if cfg.drafter.init_layer_from is not None and not init_from_dir:
        prefix = f"model.layers.{cfg.drafter.init_layer_from}."
        parts = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        names = [f"{prefix}{p}.{kind}" for p in parts for kind in ("weight", "bias")]
        names += [
            f"{prefix}{n}.weight"
            for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
        ]
        layer = load_safetensors_dir(model_dir, names, missing_ok=True)
        copy_target_layer(drafter, {k: v.float() for k, v in layer.items()}, cfg.drafter.init_layer_from)
    if init_from_dir:
        warm = load_drafter(init_from_dir, target_num_layers=hf["num_hidden_layers"])
        drafter.load_state_dict(warm.state_dict())
    return DraftTrainingModel(drafter, embed, head[vocab].clone())


def _collective_device() -> torch.device:
    """Where this process group's collectives run: NCCL only reduces CUDA tensors, gloo CPU ones."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _allreduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the workers; returns a CPU tensor."""
    if dist.is_available() and dist.is_initialized():
        on = t.to(_collective_device())
        dist.all_reduce(on)
        return on.cpu()
    return t


def online_data(online: dict | None) -> tuple | None:
    """`data: online`: this worker's views of the shards captured for it (data/online.py), one for training and
    one for validation (each reader announces its own order), else None."""
    if not online:
        return None
    from orchestrator.data.online import OnlineShards

    args = (online["manifest"], online["plans"], online["workers"], online["prefetch"])
    return OnlineShards(*args), OnlineShards(*args)


def evaluate(model: DraftTrainingModel, cfg: TrainConfig, data, rank: int, world: int, device, autocast) -> dict:
    """Validation loss / accuracy per step, and `val_tau_chain`: greedy chain decoding of each sequence's first
    answer replayed (`objective.chain_rounds`), what serving the held-out prompts with a chain of ttt_steps
    measures. Over up to eval_max_sequences per worker (summed over workers). Runs the unwrapped model: DDP's
    forward syncs buffers, and workers may hold different numbers of batches."""
    model = getattr(model, "module", model)
    total = torch.zeros(3, cfg.ttt_steps)
    rounds = torch.zeros(2)  # rounds, accepted drafts
    reader = ShardReader(data, "validation", rank, world, seed=0, buffer_sequences=1)
    seqs = []
    for seq in reader:
        seqs.append(seq)
        if len(seqs) >= cfg.eval_max_sequences:
            break
    with torch.no_grad(), autocast():
        for group, _ in batches(((s, DataPosition()) for s in seqs), cfg.batch_tokens):
            batch = _to(Batch.pad(group), device)
            logits = model.step_logits(batch, cfg.ttt_steps)
            _, stats = ttt_loss(logits, model.target_logits(batch), batch, cfg.step_weight)
            total += stats.as_tensor().float().cpu()
            hits = chain_hits(logits, model.drafter.to_target_ids, batch)
            rounds += torch.tensor(chain_rounds(hits, _to(batch, "cpu"), cfg.eval_answer_tokens), dtype=torch.float)
    total = _allreduce(total)
    rounds = _allreduce(rounds)
    if total[2].sum() == 0:
        return {}
    out = {f"val_{k}": v for k, v in summarise(StepStats.from_tensor(total)).items()}
    if rounds[0] > 0:
        out["val_tau_chain"] = float(1 + rounds[1] / rounds[0])
    return out


def _to(batch: Batch, device) -> Batch:
    return Batch(
        *(getattr(batch, f).to(device) for f in ("input_ids", "loss_mask", "lengths", "aux_hidden", "final_hidden"))
    )


def host_allocator() -> str:
    """Which malloc this process runs on: jemalloc when preloaded (`worker.allocator`), else the C library's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "jemalloc" if "libjemalloc" in maps else "glibc"


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    cfg = TrainConfig.model_validate(config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.worker.torch_threads)
    device = ray.train.torch.get_device()
    vocab = torch.tensor(config["draft_vocab"])
    model = build_model(
        cfg, Path(config["model_dir"]), vocab, tuple(config["aux_layer_ids"]), config.get("init_from_dir")
    )
    drafter = model.drafter
    optimizer = make_optimizer(drafter, cfg)
    progress, position = Progress(), DataPosition()
    starts = config.get("start_positions") or []  # a continued drafter's, when the world size is the same
    if len(starts) == world:
        position = DataPosition(**starts[rank])
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            progress = load_state(Path(d), drafter, optimizer)
            position = load_position(Path(d), rank)
    model = ray.train.torch.prepare_model(model)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
    mlflow = MlflowClient(config["tracking_uri"]) if rank == 0 else None
    run_id = config["run_id"]
    if mlflow is not None:
        mlflow.set_tag(run_id, "worker_allocator", host_allocator())

    def log(metrics: dict, step: int) -> None:
        if mlflow is not None and metrics:
            now = int(time.time() * 1000)
            mlflow.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def save(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                save_state(Path(tmp), drafter, optimizer, progress)
            save_position(Path(tmp), rank, position)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    if checkpoint:
        log({"resumed_from_step": progress.step}, progress.step)
    data, validation = online_data(config.get("online")) or (cfg.data, cfg.data)
    stream = batches(sequence_stream(data, rank, world, cfg.seed, position), cfg.batch_tokens)
    window = torch.zeros(3, cfg.ttt_steps, device=device)  # stays on the device: no host sync per step
    window_tokens, window_began = 0, time.perf_counter()
    began = time.perf_counter() - progress.elapsed_s
    while not _finished(cfg, progress):
        lr = cfg.optim.lr * lr_factor(cfg, progress.step, progress.elapsed_s)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        for micro in range(cfg.optim.grad_accum_steps):
            seqs, position = next(stream)
            padded = Batch.pad(seqs)
            batch = _to(padded, device)
            sync = micro == cfg.optim.grad_accum_steps - 1 or not hasattr(model, "no_sync")
            with nullcontext() if sync else model.no_sync(), autocast():
                loss, stats = model(batch, cfg.ttt_steps, cfg.step_weight)
            (loss / cfg.optim.grad_accum_steps).backward()
            window += stats.as_tensor().float()
            window_tokens += padded.num_tokens  # counted on the host: no wait for the device
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        progress.step += 1
        progress.elapsed_s = _agreed_elapsed(time.perf_counter() - began)
        if progress.step % cfg.log_every_steps == 0 or _finished(cfg, progress):
            metrics, tokens = window_metrics(cfg, window, window_tokens, time.perf_counter() - window_began)
            progress.tokens += tokens
            metrics.update(
                lr=lr,
                grad_norm=float(grad_norm),
                tokens_total=progress.tokens,
                epoch=position.epoch,
                elapsed_min=progress.elapsed_s / 60,
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # this worker's
            )
            log(metrics, progress.step)
            window.zero_()
            window_tokens, window_began = 0, time.perf_counter()
        if progress.step % cfg.eval_every_steps == 0 or _finished(cfg, progress):
            log(evaluate(model, cfg, validation, rank, world, device, autocast), progress.step)
        if progress.step % cfg.checkpoint.every_steps == 0 or _finished(cfg, progress):
            save({"step": progress.step, "elapsed_s": progress.elapsed_s})


def make_optimizer(drafter, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms)."""
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
    )


def window_metrics(cfg: TrainConfig, window: torch.Tensor, tokens: int, seconds: float) -> tuple[dict, int]:
    """The logging window's per-step sums [3, steps] and token count, summed over workers, summarised."""
    reduced = _allreduce(torch.cat([window.flatten().cpu(), torch.tensor([float(tokens)])]))
    tokens = int(reduced[-1])
    metrics = summarise(StepStats.from_tensor(reduced[:-1].view(3, cfg.ttt_steps)))
    metrics["loss"] = float(sum(cfg.step_weight**j * metrics[f"loss_step_{j}"] for j in range(cfg.ttt_steps)))
    metrics["tokens_per_s"] = tokens / max(seconds, 1e-9)
    return metrics, tokens


def _finished(cfg: TrainConfig, progress: Progress) -> bool:
    if cfg.max_steps is not None and progress.step >= cfg.max_steps:
        return True
    return cfg.max_time_minutes is not None and progress.elapsed_s >= 60 * cfg.max_time_minutes


def _agreed_elapsed(local_s: float) -> float:
    """Rank 0's clock for everyone, so all workers stop after the same step."""
    t = torch.tensor([local_s], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        t = t.to(_collective_device())
        dist.broadcast(t, src=0)
    return float(t)
