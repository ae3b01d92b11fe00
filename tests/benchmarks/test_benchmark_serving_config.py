"""The serving benchmark's config is checked before Ray starts: it measures one replica's scheduler."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.benchmarks.serving import BenchmarkServingConfig, run_serving_benchmark
from orchestrator.errors import AerieError
from tests.serving.conftest import app_args


def test_a_multi_replica_app_is_refused_before_anything_starts(tiny_chat, tmp_path, monkeypatch):
    import ray

    app = tmp_path / "serve.yaml"
    args = app_args(tiny_chat, speculation=False)
    app.write_text(
        yaml.safe_dump({"applications": [{"import_path": "orchestrator.serving.app:build_app", "args": args}]})
    )
    cfg = BenchmarkServingConfig(app=str(app), app_overrides=["num_replicas=2"], output_dir=str(tmp_path / "out"))
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray must not start"))
    with pytest.raises(AerieError, match=r"serves 2 replicas: set app_overrides=\[num_replicas=1\]"):
        run_serving_benchmark(cfg, tmp_path / "out")
