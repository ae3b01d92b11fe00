"""A progress bar in the training driver, wherever the Ray Train workers run: rank 0 logs its metrics to the
MLflow run every `log_every_steps`; this thread reads the newest ones back every few seconds and shows step,
loss, top-1 accuracy of the first drafting step and tokens/s against the step or time budget."""

from __future__ import annotations

import logging
import threading

from orchestrator.console import bar
from orchestrator.train.config import TrainConfig

log = logging.getLogger(__name__)
SHOWN = {"loss": "loss", "acc_step_0": "acc0", "val_acc_step_0": "val_acc0", "tokens_per_s": "tok/s"}


class TrainingBar:
    """Use as a context manager around `trainer.fit()`."""

    def __init__(self, mlflow_client, run_id: str, cfg: TrainConfig, poll_s: float = 5.0) -> None:
        self.client, self.run_id, self.cfg, self.poll_s = mlflow_client, run_id, cfg, poll_s
        self.by_time = cfg.max_steps is None
        total = cfg.max_time_minutes if self.by_time else cfg.max_steps
        unit = "min" if self.by_time else "step"
        fmt = "{l_bar}{bar}| {n:.1f}/{total:g} min [{elapsed}{postfix}]" if self.by_time else None
        self.bar = bar(total=total, desc=f"train {cfg.name}", unit=unit, bar_format=fmt)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="training-bar")

    def __enter__(self) -> TrainingBar:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.update()
        self.bar.close()

    def _run(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                self.update()
            except Exception as err:  # a store hiccup must not end training; the next poll tries again
                log.debug("training bar: %s", err)

    def update(self) -> None:
        metrics = self.client.get_run(self.run_id).data.metrics
        if "loss" not in metrics:
            return
        if self.by_time:
            done = metrics.get("elapsed_min", 0.0)
        else:
            history = self.client.get_metric_history(self.run_id, "loss")
            done = max(m.step for m in history) if history else 0
        self.bar.n = min(done, self.bar.total)
        self.bar.set_postfix(
            {short: f"{metrics[key]:.3g}" for key, short in SHOWN.items() if key in metrics}, refresh=False
        )
        self.bar.refresh()
