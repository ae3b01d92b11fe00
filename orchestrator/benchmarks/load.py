"""Steady streaming load on a served model: `users` clients, each sending its next request as soon as its last
one ends, for a while; every response checked. For the traffic tap's demo (load from a domain the drafter did not
train on) and soak runs; `aerie load` is its command."""

from __future__ import annotations

import asyncio
import statistics
import time

from orchestrator.benchmarks.serving import stream_request
from orchestrator.errors import AerieError


async def steady_load(
    url: str,
    prompts: list[dict],
    users: int,
    seconds: float,
    max_tokens: int,
    headers: dict[str, str],
    once: bool = False,
    ignore_eos: bool = True,
) -> dict:
    """Requests from `users` closed-loop clients for `seconds` (each cycling through `prompts` from its own
    offset; `once`: each prompt sent at most once, the load ends when they run out); a summary: requests, failures
    and their first errors, tokens, per-user tokens/s. `ignore_eos=False` lets answers end as the model ends them,
    as real traffic does (the tap's demo); with True every answer is `max_tokens` long (soak runs)."""
    import httpx

    prompts = [{k: p[k] for k in ("messages", "prompt") if k in p} for p in prompts]  # no ids of the prompt sets
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        answer = await client.get(f"{url}/v1/models")
        if answer.status_code != 200:
            raise AerieError(f"{url}/v1/models answered {answer.status_code}: {answer.text[:200]}")
        model = answer.json()["data"][0]["id"]
        deadline = time.monotonic() + seconds
        results: list[dict] = []

        async def user(u: int) -> None:
            i = u
            while time.monotonic() < deadline and not (once and i >= len(prompts)):
                prompt = prompts[i % len(prompts)]
                results.append(await stream_request(client, url, model, prompt, max_tokens, ignore_eos))
                if "error" in results[-1]:
                    await asyncio.sleep(0.2)  # a refused request is counted, not retried at once
                i += users

        began = time.monotonic()
        await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.monotonic() - began
    ok = [r for r in results if "error" not in r]
    return {
        "users": users,
        "seconds": round(wall, 1),
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "tokens": sum(r["tokens"] for r in ok),
        "per_user_tok_s": round(statistics.mean(r["tokens"] / r["e2e_s"] for r in ok), 2) if ok else 0.0,
    }
