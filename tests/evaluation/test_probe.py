"""The drafter probe on a tiny random target that speaks SmolLM2's tokenizer: every check it makes, no model hub."""

from __future__ import annotations

import shutil

from orchestrator.evaluation.probe import TEMPLATES, probe
from orchestrator.models.checkpoint import save_drafter
from orchestrator.models.init import init_drafter
from orchestrator.models.target import TargetModel
from tests.helpers import write_tiny_llama


def test_the_probe_reports_the_checks_and_a_rank_per_answer_token(tmp_path, smollm2_dir):
    tiny = write_tiny_llama(tmp_path / "tiny", vocab_size=49152, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(smollm2_dir / name, tiny / name)
    target = TargetModel.from_pretrained(tiny, (2, 4, 5))
    save_drafter(init_drafter(target, "eagle3.1"), tmp_path / "drafter")
    report = probe(str(tiny), str(tmp_path / "drafter"), TEMPLATES["llama3"], question=0, answer_tokens=6)
    assert report["finite"] and report["vocab_consistent"] and report["answer_in_vocab"] == 1.0
    assert len(report["rank_of_right_token"]) == 6 and all(r >= 0 for r in report["rank_of_right_token"])
    assert 0 <= report["step0_accuracy"] <= 1 and len(report["aux_absmax"]) == 3
