"""A generated corpus that lives in git: what the target wrote, as text and token ids, in gzip JSONL chunks.

    data/smollm2-broad/
      synthetic-<key>.jsonl.gz          {"id", "source", "messages": [{"role", "content", "token_ids"}, ...]} a line
      synthetic-<key>.provenance.json   what made the chunk: target checksum, settings, statistics, seconds, sha256
      regenerated-<key>.jsonl.gz ...
      manifest.json                     every chunk (sha256, conversations, tokens) and the totals

A generated message's `token_ids` are the ids the target emitted (special tokens left out); a human-written one
has none. Chunks are written with gzip's timestamp at zero, so the same conversations give the same bytes, and a
chunk whose bytes no longer match its recorded sha256 is refused by name (`git checkout` it, or delete it and
its provenance to generate it again). With `commit` on, each chunk is committed to git as soon as it is written
(only its own files and the manifest), so a stopped run loses at most the chunk it was writing.

Degenerate answers are filtered when a corpus is loaded, not when it is written, so a better filter needs no new
generation: an assistant turn whose token 4-grams are less than half distinct (a loop such as "I'm sorry, I'm
sorry, ...") is trained on only up to where its loop repeats (`drop_degenerate`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import subprocess
from pathlib import Path

from orchestrator.data.conversations import Conversation
from orchestrator.errors import AerieError
from orchestrator.files import write_atomic

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
SUFFIX = ".jsonl.gz"
REPEAT_NGRAM = 4
MIN_DISTINCT_NGRAMS = 0.5  # of an answer's 4-grams; natural answers of 256 tokens measure 0.9 and above
MIN_TOKENS_TO_JUDGE = 48


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def provenance_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(SUFFIX) + ".provenance.json")


def encode(conversations: list[Conversation]) -> bytes:
    """The chunk's bytes: JSONL, gzip with no timestamp (the same conversations give the same bytes)."""
    text = "".join(
        json.dumps({"id": c.id, "source": c.source, "messages": c.messages}, ensure_ascii=False) + "\n"
        for c in conversations
    )
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(text.encode())
    return buf.getvalue()


def save_chunk(path: Path, conversations: list[Conversation], provenance: dict) -> None:
    """Write a chunk and its provenance (with the chunk's sha256), each atomically."""
    data = encode(conversations)
    provenance = {**provenance, "sha256": sha256_bytes(data), "bytes": len(data), "counts": counts(conversations)}
    write_atomic(path, data)
    write_atomic(provenance_path(path), json.dumps(provenance, indent=2) + "\n")


def load_chunk(path: Path) -> tuple[list[Conversation], dict] | None:
    """A saved chunk and its provenance; None when either file is missing. Bytes that do not match the recorded
    sha256 (a truncated copy, a bad merge) are refused with the way out."""
    prov_path = provenance_path(path)
    if not (path.is_file() and prov_path.is_file()):
        return None
    prov = json.loads(prov_path.read_text())
    data = path.read_bytes()
    if prov.get("sha256") not in (None, sha256_bytes(data)):
        raise AerieError(
            f"{path} does not match the sha256 in {prov_path.name}: restore it (git checkout -- {path}) or delete "
            "both files to generate the chunk again"
        )
    try:
        rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AerieError(f"{path} is not gzip JSONL ({e}): delete it and {prov_path.name} to generate it again") from e
    return [Conversation(r["id"], r["messages"], r.get("source", "")) for r in rows], prov


def repetitive(ids: list[int], n: int = REPEAT_NGRAM, threshold: float = MIN_DISTINCT_NGRAMS) -> bool:
    """True for a degenerate answer: at least MIN_TOKENS_TO_JUDGE tokens whose n-grams are < `threshold`
    distinct."""
    if len(ids) < MIN_TOKENS_TO_JUDGE:
        return False
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) < threshold


def loop_start(ids: list[int], key: int = 8, span: int = 24) -> int:
    """Where a loop's second copy begins: the first position whose next `span` tokens repeat, token for token,
    `span` tokens that began earlier at the same `key`-gram; len(ids) when nothing repeats that long."""
    first: dict[tuple[int, ...], int] = {}
    for j in range(len(ids) - span + 1):
        gram = tuple(ids[j : j + key])
        if gram not in first:
            first[gram] = j
        elif ids[j : j + span] == ids[first[gram] : first[gram] + span]:
            return j
    return len(ids)


def drop_degenerate(conversations: list[Conversation], tokenizer) -> tuple[list[Conversation], dict]:
    """Repetitive assistant turns filtered. One with at least MIN_TOKENS_TO_JUDGE tokens before its loop repeats
    stays in the conversation (later turns were written after it) but is trained on only up to there:
    `loss_tokens` (templates.render_conversation reads it). One that loops sooner ends its conversation, its
    question cut with it; a conversation left without an assistant turn is dropped. Returns the kept
    conversations and what was done, with the assistant tokens left to train on."""
    kept, stats = [], {"masked_turns": 0, "tokens_masked": 0, "cut_turns": 0, "conversations_dropped": 0}
    trained = 0
    for conv in conversations:
        messages = []
        for m in conv.messages:
            ids = message_ids(m, tokenizer)
            if m["role"] == "assistant" and repetitive(ids):
                start = loop_start(ids)
                if start < MIN_TOKENS_TO_JUDGE:
                    if messages and messages[-1]["role"] == "user":
                        messages.pop()
                    stats["cut_turns"] += 1
                    break
                m = {**m, "loss_tokens": start}
                stats["masked_turns"] += 1
                stats["tokens_masked"] += len(ids) - start
            messages.append(m)
        if any(m["role"] == "assistant" for m in messages):
            kept.append(Conversation(conv.id, messages, conv.source))
            trained += sum(
                m.get("loss_tokens", len(message_ids(m, tokenizer))) for m in messages if m["role"] == "assistant"
            )
        else:
            stats["conversations_dropped"] += 1
    return kept, {**stats, "assistant_tokens_trained": trained}


def message_ids(message: dict, tokenizer=None) -> list[int]:
    """A message's token ids: those the target generated, else the tokenizer's (needs `tokenizer`)."""
    if "token_ids" in message:
        return message["token_ids"]
    if tokenizer is None:
        return []
    return tokenizer(message["content"], add_special_tokens=False)["input_ids"]


def counts(conversations: list[Conversation]) -> dict:
    """Conversations, turns and generated tokens (assistant answers: all, and over distinct answer texts)."""
    answers = [m for c in conversations for m in c.messages if m["role"] == "assistant"]
    distinct = {m["content"].strip(): len(m.get("token_ids", [])) for m in answers}
    return {
        "conversations": len(conversations),
        "assistant_turns": len(answers),
        "assistant_tokens": sum(len(m.get("token_ids", [])) for m in answers),
        "unique_assistant_tokens": sum(distinct.values()),
        "user_tokens_generated": sum(
            len(m.get("token_ids", [])) for c in conversations for m in c.messages if m["role"] == "user"
        ),
    }


def write_manifest(folder: Path, made: dict) -> dict:
    """manifest.json over every chunk in `folder` (read from the provenance files): sha256, sizes, counts per
    chunk and the totals; `made` says what made them (target, checksum, generation settings)."""
    chunks = []
    for prov_path in sorted(folder.glob("*.provenance.json")):
        data_path = prov_path.with_name(prov_path.name.removesuffix(".provenance.json") + SUFFIX)
        if not data_path.is_file():
            continue
        prov = json.loads(prov_path.read_text())
        chunks.append(
            {
                "file": data_path.name,
                "sha256": prov.get("sha256"),
                "bytes": prov.get("bytes"),
                "kind": data_path.name.split("-")[0],
                "chunk": prov.get("chunk"),
                "seconds": prov.get("seconds", prov.get("stats", {}).get("seconds")),
                **prov.get("counts", {}),
            }
        )
    totals: dict = {"chunks": len(chunks)}
    keys = ("bytes", "seconds", *counts([]))
    for c in chunks:
        for key in keys:
            totals[key] = round(totals.get(key, 0) + (c.get(key) or 0), 1)
    manifest = {"format": "aerie-corpus/1", **made, "totals": totals, "chunks": chunks}
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def git_commit(paths: list[Path], message: str) -> bool:
    """Commit exactly `paths` (other staged changes are left staged); False, with a warning, outside a git
    work tree or when git refuses (the files stay written either way)."""
    where = paths[0].parent
    files = [str(p.resolve()) for p in paths]
    try:
        subprocess.run(["git", "add", "--", *files], cwd=where, check=True, capture_output=True)
        subprocess.run(
            ["git", "commit", "-q", "--only", "-m", message, "--", *files], cwd=where, check=True, capture_output=True
        )
        return True
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning(
            "could not commit %s to git (%s): the chunk is written, commit it by hand", where, err.decode()[:200]
        )
        return False
