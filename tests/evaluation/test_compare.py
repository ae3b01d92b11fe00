"""The evaluation's side-by-side comparison: tau per drafter with a bootstrap interval over prompts, and each
drafter's ratio to the first one, paired by prompt. No model: per-prompt counts written by hand."""

from __future__ import annotations

from orchestrator.evaluation.evaluate import compare, format_comparison


def _result(per_prompt: dict[str, list[list[int]]], sets: list[str]) -> dict:
    return {
        "prompt_labels": [[s, "x"] for s in sets],
        "drafters": {
            n: {"engine": {"chain-5": {"per_prompt": rows}, "draft_vocab_coverage": {}}}
            for n, rows in per_prompt.items()
        },
    }


def test_taus_ratios_and_intervals_per_set():
    sets = ["mtbench"] * 6 + ["templates"] * 4
    base = [[10, 5]] * 10  # tau 1.5 everywhere
    better = [[10, 10]] * 6 + [[10, 5]] * 4  # tau 2.0 on MT-Bench, 1.5 on templates
    result = compare(_result({"eagle3": base, "eagle3.1": better}, sets))
    mt = result["chain-5"]["mtbench"]
    assert mt["eagle3"]["tau"] == 1.5 and mt["eagle3"]["interval"] == [1.5, 1.5]
    assert mt["eagle3.1"]["ratio"] == 2.0 / 1.5 and mt["eagle3.1"]["ratio_interval"][0] > 1
    templates = result["chain-5"]["templates"]["eagle3.1"]
    assert templates["ratio"] == 1.0 and templates["ratio_interval"] == [1.0, 1.0]
    everything = result["chain-5"]["all"]["eagle3.1"]
    assert (
        everything["tau"] == 1 + 80 / 100 and everything["interval"][0] < everything["tau"] < everything["interval"][1]
    )
    assert "ratio" not in result["chain-5"]["all"]["eagle3"]  # the baseline
    table = format_comparison(result, ["eagle3", "eagle3.1"])
    assert "| chain-5 | mtbench | 1.500 [1.500, 1.500] | 2.000 [2.000, 2.000] | 1.333 [1.333, 1.333] |" in table


def test_a_drafter_that_never_drafted_on_a_set_has_tau_one():
    result = compare(_result({"a": [[0, 0], [0, 0]], "b": [[4, 2], [4, 2]]}, ["long", "long"]))
    assert result["chain-5"]["long"]["a"]["tau"] == 1.0 and result["chain-5"]["long"]["b"]["ratio"] == 1.5


def test_mtbench_categories_get_rows_of_their_own():
    """MT-Bench's prompts carry their category: each gets a row (mtbench/CATEGORY) over its prompts alone."""
    sets = ["mtbench"] * 4 + ["templates"] * 2
    result = _result({"a": [[10, 10], [10, 0], [10, 10], [10, 0]] + [[10, 5]] * 2}, sets)
    result["prompt_categories"] = ["math", "coding", "math", "coding", "", ""]
    out = compare(result)["chain-5"]
    assert list(out) == ["all", "mtbench", "templates", "mtbench/math", "mtbench/coding"]
    assert out["mtbench/math"]["a"]["tau"] == 2.0 and out["mtbench/coding"]["a"]["tau"] == 1.0
    assert out["mtbench"]["a"]["tau"] == 1.5
