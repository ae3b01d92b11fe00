"""The draft vocabulary's size against what it costs: coverage of held-out answers (a ceiling on acceptance: a
token outside the vocabulary is never drafted), matmul FLOPs per trained token and the bf16 checkpoint's size.

    python -m orchestrator.benchmarks.draft_vocab --corpus data/smollm2-broad --model models/smollm2-135m-instruct

The vocabulary is the most frequent answer tokens of all committed chunks but the last `--held-out`; coverage is
measured on those (answers the vocabulary never saw, as MT-Bench's are), counting the tokens a looping answer is
trained on (corpus.drop_degenerate).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from orchestrator.benchmarks.flop_bound import flops_per_token, random_batch, training_model
from orchestrator.data import corpus

SIZES = (2048, 4096, 8192, 12288, 16384)


def answer_counts(chunks: list[Path], vocab_size: int) -> torch.Tensor:
    """Token counts [vocab_size] over the trained part of every assistant answer in `chunks`."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for path in chunks:
        conversations, _ = corpus.load_chunk(path)
        kept, _ = corpus.drop_degenerate(conversations, tokenizer=None)
        ids = [
            t
            for c in kept
            for m in c.messages
            if m["role"] == "assistant"
            for t in m["token_ids"][: m.get("loss_tokens")]
        ]
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size).double()
    return counts


def study(folder: Path, hf: dict, held_out: int, sizes=SIZES, ttt_steps: int = 5) -> list[dict]:
    chunks = sorted(folder.glob(f"*{corpus.SUFFIX}"))
    if len(chunks) <= held_out:
        raise SystemExit(f"{folder} has {len(chunks)} chunks: need more than --held-out {held_out}")
    train, test = (
        answer_counts(chunks[:-held_out], hf["vocab_size"]),
        answer_counts(chunks[-held_out:], hf["vocab_size"]),
    )
    order = torch.argsort(train, descending=True, stable=True)
    batch = random_batch(hf, 2, 256)
    rows = []
    for size in sizes:
        vocab = order[:size]
        model = training_model(hf, size)
        flops, _ = flops_per_token(model, batch, ttt_steps)
        params = sum(p.numel() for p in model.drafter.parameters())
        rows.append(
            {
                "draft_vocab": size,
                "coverage_train": float(train[vocab].sum() / train.sum()),
                "coverage_held_out": float(test[vocab].sum() / test.sum()),
                "mflop_per_token": flops / 1e6,
                "bf16_mib": params * 2 / 2**20,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    from orchestrator.models.target import read_hf_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="a committed corpus folder (data/...)")
    parser.add_argument("--model", required=True, help="the prepared target (its config.json)")
    parser.add_argument("--held-out", type=int, default=1, help="the last N chunks: where coverage is measured")
    parser.add_argument("--ttt-steps", type=int, default=5)
    args = parser.parse_args(argv)
    rows = study(Path(args.corpus), read_hf_config(args.model), args.held_out, ttt_steps=args.ttt_steps)
    print("| draft vocab | coverage (train chunks) | coverage (held-out chunks) | MFLOP / trained token | bf16 MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['draft_vocab']} | {r['coverage_train']:.4f} | {r['coverage_held_out']:.4f} | "
            f"{r['mflop_per_token']:.0f} | {r['bf16_mib']:.1f} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
