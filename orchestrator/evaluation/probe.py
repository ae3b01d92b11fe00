"""Why a drafter accepts nothing: its predictions position by position, teacher-forced on the target's own greedy
answer, with the checks a bug would fail (finite logits, a consistent draft vocabulary, the answer's tokens inside
it) and the rank it gives each right token.

    python -m orchestrator.evaluation.probe --model models/smollm2-135m-instruct \\
        --drafter drafters/smollm2-135m-broad-eagle3.1 --template llama3 --question 0

At each answer position p the drafter's first step reads the target's aux states at p and token p+1 and predicts
token p+2 (EAGLE-3's layout, as the engine drafts); the answer is the target's greedy continuation.
"""

from __future__ import annotations

import argparse
import json

import torch

from orchestrator.data.prompts import mtbench_questions
from orchestrator.data.templates import LLAMA3_TEMPLATE
from orchestrator.models.checkpoint import load_drafter
from orchestrator.models.target import TargetModel
from orchestrator.models.tokenizer import load_tokenizer

TEMPLATES = {"default": None, "llama3": LLAMA3_TEMPLATE}


def greedy(target: TargetModel, ids: list[int], n: int) -> list[int]:
    """`ids` and the target's next `n` greedy tokens (no EOS stop: the probe wants the positions)."""
    cache = target.new_cache(1, len(ids) + n + 1)
    out = target(torch.tensor(ids), cache, torch.tensor([0]), torch.tensor([len(ids)]), logits="last")
    seq = [*ids, int(out.logits[0].argmax())]
    for _ in range(n - 1):
        out = target(torch.tensor(seq[-1:]), cache, torch.tensor([0]), torch.tensor([1]), logits="last")
        seq.append(int(out.logits[0].argmax()))
    return seq


@torch.no_grad()
def probe(model_dir: str, drafter_dir: str, template: str | None, question: int, answer_tokens: int) -> dict:
    tok = load_tokenizer(model_dir)
    drafter = load_drafter(drafter_dir, dtype=torch.float32)
    target = TargetModel.from_pretrained(model_dir, tuple(drafter.config.aux_layer_ids), dtype="float32")
    if drafter.embed_tokens is None:
        drafter.share_embedding(target.embed_tokens)
    text = tok.apply_chat_template(
        [{"role": "user", "content": mtbench_questions()[question]["turns"][0]}],
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    seq = greedy(target, prompt, answer_tokens)
    states = target(torch.tensor(seq), target.new_cache(1, len(seq)), torch.tensor([0]), torch.tensor([len(seq)]))
    out = drafter(
        torch.tensor(seq[1:]),
        drafter.combine_aux(states.aux_hidden[:-1]),  # [T-1, H]: state p with token p+1
        drafter.new_cache(1, len(seq)),
        torch.tensor([0]),
        torch.tensor([len(seq) - 1]),
    )
    logits = drafter.target_logits(out.logits)  # [T-1, vocab], -inf outside the draft vocabulary
    first = len(prompt) - 2  # the row predicting the answer's first token
    truth = torch.tensor(seq[first + 2 :])
    rows = logits[first : first + truth.numel()]
    right = rows.gather(1, truth[:, None])
    target_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))
    return {
        "answer": tok.decode(seq[len(prompt) :]),
        "finite": bool(torch.isfinite(out.logits).all()),
        "vocab_consistent": bool(drafter.t2d[target_ids].all()) and target_ids.unique().numel() == target_ids.numel(),
        "answer_in_vocab": float(drafter.t2d[truth].float().mean()),
        "step0_accuracy": float((rows.argmax(-1) == truth).float().mean()),
        "rank_of_right_token": (rows > right).sum(-1).tolist(),
        "proposed": [tok.decode([int(t)]) for t in rows.argmax(-1)[:12]],
        "aux_absmax": [
            round(float(a.abs().max()), 1) for a in states.aux_hidden.chunk(len(drafter.config.aux_layer_ids), -1)
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--template", choices=sorted(TEMPLATES), default="default")
    parser.add_argument("--question", type=int, default=0, help="MT-Bench question index (its first turn)")
    parser.add_argument("--answer-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print(
        json.dumps(
            probe(args.model, args.drafter, TEMPLATES[args.template], args.question, args.answer_tokens), indent=1
        )
    )


if __name__ == "__main__":
    main()
