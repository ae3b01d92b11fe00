"""The documentation cannot drift from the code: the reference pages are generated (`make docs`) and current, a
field added to a config reaches them without editing a page, the routes the HTTP page lists are the servers', the
site builds with `mkdocs build --strict`, and every repository path the docs and the README name exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field, create_model

from orchestrator import reference

REPO = Path(__file__).resolve().parents[1]
TRACKED_DIRS = (
    "configs",
    "orchestrator",
    "jobs",
    "clusters",
    "dashboards",
    "drafters",
    "data",
    "demo",
    "tests",
    "docs",
)
TRACKED_FILES = ("Makefile", "pyproject.toml")


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return reference.render_all()


def test_the_reference_pages_are_current(pages):
    stale = reference.stale_pages(pages)
    assert not stale, f"{', '.join(stale)} differ from what the code says: run make docs"


def test_check_names_the_stale_page_and_writes_nothing(pages, tmp_path, monkeypatch, capsys):
    for path, text in pages.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    edited = tmp_path / "docs/reference/cli.md"
    edited.write_text("edited by hand\n")
    monkeypatch.setattr(reference, "REPO", tmp_path)
    monkeypatch.setattr(reference, "render_all", lambda: pages)

    assert reference.main(["--check"]) == 1
    assert capsys.readouterr().err.strip() == "docs/reference/cli.md is stale: run make docs"
    assert edited.read_text() == "edited by hand\n"
    assert reference.main([]) == 0
    assert edited.read_text() == pages["docs/reference/cli.md"]
    assert reference.main(["--check"]) == 0


class Retry(BaseModel):
    """How often to try again (fields documented the other ways the generator reads)."""

    attempts: int = Field(2, ge=1)  # tries before giving up
    # seconds between tries,
    # doubled each time
    backoff_s: float = 0.5
    jitter: bool = False
    """spread the tries of many workers"""


def _row(section: str, name: str) -> str:
    rows = [line for line in section.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"{name}: {rows}\n{section}"
    return rows[0]


def test_a_field_added_to_a_config_reaches_the_reference_without_editing_a_page():
    from orchestrator.train.config import TrainConfig

    Extended = create_model(
        "Extended",
        __base__=TrainConfig,
        __doc__="TrainConfig with three new fields.",
        warmup_ratio=(float, Field(0.05, ge=0, lt=1, description="share of the steps warming up")),
        schedule=(Literal["cosine", "linear"] | None, Field(None, description="the learning rate's decay")),
        retry=(Retry, Field(default_factory=lambda: Retry(attempts=3))),
        retries=(dict[str, Retry], {}),
    )
    section = reference.job_section("jobs.train_drafter", Extended)

    assert section.startswith("## jobs.train_drafter\n")
    assert "python -m jobs.train_drafter --config FILE" in section
    assert (
        _row(section, "warmup_ratio")
        == "| `warmup_ratio` | float | `0.05` | >= 0, < 1 | share of the steps warming up |"
    )
    assert _row(section, "schedule") == (
        '| `schedule` | "cosine" \\| "linear" \\| None | `null` |  | the learning rate\'s decay |'
    )
    assert _row(section, "retry") == '| `retry` | Retry | `{"attempts": 3}` |  | ' + Retry.__doc__.split("\n")[0] + " |"
    # the nested model's fields, with the parent's default instance and each way of documenting a field
    assert _row(section, "retry.attempts") == "| `retry.attempts` | int | `3` | >= 1 | tries before giving up |"
    assert _row(section, "retry.backoff_s") == (
        "| `retry.backoff_s` | float | `0.5` |  | seconds between tries, doubled each time |"
    )
    assert _row(section, "retry.jitter") == "| `retry.jitter` | bool | `false` |  | spread the tries of many workers |"
    assert _row(section, "retries.<key>.attempts").startswith("| `retries.<key>.attempts` | int | `2` |")
    assert _row(section, "name").endswith(
        "| str | required |  | " + TrainConfig.model_fields["name"].description + " |"
    )


def test_a_model_that_contains_itself_is_listed_once_per_level():
    class Node(BaseModel):
        label: str = ""
        children: list[Node] = []

    Node.model_rebuild()
    rows = reference.field_rows(Node, stack=(Node,))
    assert [r[0] for r in rows] == ["`label`", "`children`"]


def _undescribed(models: list[type[BaseModel]]) -> list[str]:
    """`Model.field` of every field the reference renders for `models` (nested models too, as `field_table`
    walks them) without `Field(description=...)`, named after the class that declares it."""
    missing = set()
    for model in models:
        for owner, name, _ in reference.field_entries(model, stack=(model,)):
            if not owner.model_fields[name].description:
                declared = next(k for k in owner.__mro__ if name in vars(k).get("__annotations__", {}))
                missing.add(f"{declared.__name__}.{name}")
    return sorted(missing)


def test_every_field_of_the_job_and_serve_configs_has_a_description():
    from orchestrator.serving.protocol import Limits

    models = [config for _, config, _ in reference.jobs()] + [*reference.serve_models().values(), Limits]
    missing = _undescribed(models)
    assert not missing, (
        "config fields in docs/reference/jobs.md and serve.md without a description: give each a "
        "Field(..., description=...): " + ", ".join(missing)
    )


def test_a_field_without_a_description_is_named():
    class Inner(BaseModel):
        depth: int = 1

    class Outer(BaseModel):
        inner: Inner = Field(default_factory=Inner, description="nested")
        rate: float = Field(0.5, description="share of requests")

    class Derived(Outer):
        count: int = 2

    assert _undescribed([Derived]) == ["Derived.count", "Inner.depth"]


def test_the_shared_routes_are_the_disaggregated_servers():
    from fastapi.routing import APIRoute

    from orchestrator.serving.app import api
    from orchestrator.serving.protocol import ROUTES

    served = {(m, r.path) for r in api.routes if isinstance(r, APIRoute) for m in r.methods}
    assert set(ROUTES.values()) <= served


@pytest.mark.slow  # imports Ray Serve LLM and vLLM (~15 s)
def test_the_vllm_backend_serves_exactly_the_shared_routes():
    from fastapi import FastAPI
    from fastapi.routing import APIRoute

    from orchestrator.serving.protocol import ROUTES
    from orchestrator.serving.vllm_ingress import ROUTES as ENDPOINTS

    app = FastAPI()
    for name, route in ENDPOINTS.items():

        async def endpoint():
            return {}

        endpoint.__name__ = name
        route(app)(endpoint)
    served = {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    assert served == set(ROUTES.values())


def test_the_site_builds_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _code_spans(markdown: str) -> list[str]:
    """The inline code spans of a Markdown text (fenced blocks left out)."""
    text = re.sub(r"^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?^[ \t]*\1[^\n]*$", "", markdown, flags=re.S | re.M)
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)


def _repository_path(span: str) -> str | None:
    """The path a span names when it is one of the repository's tracked files or folders (not a placeholder, a
    glob, a command or generated output), without a `:line` or `:name` suffix."""
    if any(c in span for c in " *<>{}$") or "..." in span:
        return None
    path = span.split("#")[0].split(":")[0].rstrip("/")
    if path in TRACKED_FILES or path.split("/")[0] in TRACKED_DIRS and "/" in span:
        return path
    return None


def test_the_repository_paths_the_docs_name_exist():
    sources = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    missing = []
    for source in sources:
        for span in _code_spans(source.read_text()):
            path = _repository_path(span)
            if path is not None and not (REPO / path).exists():
                missing.append(f"{source.relative_to(REPO)}: `{span}`")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_only_repository_paths_are_checked():
    spans = _code_spans("a `configs/x.yaml:3` b `runs/out`\n```yaml\n`jobs/in_a_block.py`\n```\n`jobs/*.py` `Makefile`")
    assert [s for s in spans if _repository_path(s)] == ["configs/x.yaml:3", "Makefile"]
    assert _repository_path("orchestrator/serving/app.py:build_app") == "orchestrator/serving/app.py"
    assert _repository_path("configs/<model>/serve.yaml") is None
    assert _repository_path("data") is None


def test_the_architecture_page_names_every_layer_and_module_of_layout():
    """docs/architecture.md's hand-written layer table stays in step with orchestrator/layout.py."""
    from orchestrator.layout import LAYERS

    page = (REPO / "docs" / "architecture.md").read_text()
    missing = [
        f"{name}: {prefix}"
        for name, _, prefixes in LAYERS
        for prefix in prefixes
        if f"`{prefix.replace('.', '/')}/`" not in page and f"`{prefix.replace('.', '/')}.py`" not in page
    ]
    missing += [name for name, _, _ in LAYERS if f"| {name} |" not in page]
    assert not missing, f"docs/architecture.md does not name: {missing}"
