"""Config loading: YAML plus dotted overrides (into nested lists too), every mistake one AerieError line."""

from __future__ import annotations

import pytest

from orchestrator.config import load_config
from orchestrator.data.collect import CollectConfig
from orchestrator.errors import AerieError

BASE = """
model: m
output: out
sources:
  - kind: synthetic
    synthetic: {num_conversations: 10}
  - kind: chitchat
regenerate: {max_new_tokens: 12}
"""


@pytest.fixture
def path(tmp_path):
    (tmp_path / "c.yaml").write_text(BASE)
    return tmp_path / "c.yaml"


def test_overrides_reach_into_lists_and_merge_into_mappings(path):
    cfg = load_config(
        CollectConfig,
        path,
        ["sources.0.synthetic.num_conversations=250", "sources.1.max_user_turns=3", "regenerate={temperature: 0.5}"],
    )
    assert cfg.sources[0].synthetic.num_conversations == 250 and cfg.sources[1].max_user_turns == 3
    assert cfg.regenerate.max_new_tokens == 12 and cfg.regenerate.temperature == 0.5
    assert [s.kind for s in load_config(CollectConfig, path, ["sources=[{kind: chitchat}]"]).sources] == ["chitchat"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sources.5.kind=chitchat", "bad override 'sources.5.kind=chitchat': list index out of range"),
        ("sources.x.kind=chitchat", "bad override 'sources.x.kind=chitchat'"),
        ("output", "overrides must look like key=value"),
        ("=5", "overrides must look like key=value"),
        ("sources.1.max_user_turns=0", "sources.1.max_user_turns: Input should be greater than or equal to 1"),
    ],
)
def test_bad_overrides_are_one_line(path, override, message):
    with pytest.raises(AerieError) as err:
        load_config(CollectConfig, path, [override])
    assert message in str(err.value) and "\n" not in str(err.value)
