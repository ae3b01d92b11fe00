"""Per-token cost of output text (incremental detokenization + stop-string matching) at a short and a long output.

    python -m orchestrator.benchmarks.detok --model models/smollm2-135m-instruct

Streams the token ids of real text one token at a time through `TextStream` with four stop strings of the
longest allowed length that never match (the worst case: every token is searched). Short and long outputs are
interleaved and repeated, with as many tokens timed for each (40 short outputs per long one). Reports the
per-token cost of each and the ratio long/short per repetition (median and range); a cost that grows with the
output gives a ratio near long/short (40 here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from orchestrator.runtime.detok import TextStream

TEXT = (
    "Speculative decoding drafts several tokens with a small model and verifies them with the target in one "
    "forward pass. Ünïcödé, 中文字符 and emoji 🙂🚀 are decoded as they arrive.\n\n"
)


def per_token_us(tokenizer, ids: list[int], stops: list[str], streams: int = 1) -> float:
    """Mean cost per token of `streams` requests, each streaming `ids` one token at a time."""
    began = time.perf_counter()
    for _ in range(streams):
        stream = TextStream(tokenizer, stops)
        for t in ids:
            stream.add([t])
        stream.finish()
    return (time.perf_counter() - began) / (streams * len(ids)) * 1e6


def run(tokenizer, short: int = 100, long: int = 4000, repeats: int = 11, stop_chars: int = 256) -> dict:
    ids = tokenizer(TEXT * (long // 20))["input_ids"]
    if len(ids) < long:
        raise ValueError(f"the text has only {len(ids)} tokens")
    stops = [f"{i}" + "\x00" * (stop_chars - 1) for i in range(4)]  # never in the text
    per_token_us(tokenizer, ids[:short], stops)  # warm up
    costs: dict[int, list[float]] = {short: [], long: []}
    for _ in range(repeats):
        for n in (short, long):
            costs[n].append(per_token_us(tokenizer, ids[:n], stops, streams=long // n))  # as many tokens
    ratios = sorted(b / a for a, b in zip(costs[short], costs[long], strict=True))
    return {
        "per_token_us": {n: statistics.median(c) for n, c in costs.items()},
        "ratio_long_short": statistics.median(ratios),
        "ratio_range": [ratios[0], ratios[-1]],
        "repeats": repeats,
        "stop_strings": f"4 x {stop_chars} chars",
    }


def main(argv: list[str] | None = None) -> None:
    from orchestrator.models.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="a model directory (its tokenizer)")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)
    print(json.dumps(run(load_tokenizer(args.model), repeats=args.repeats), indent=2))


if __name__ == "__main__":
    main()
