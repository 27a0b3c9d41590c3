"""The target's answers (data.regenerate) through the SGLang server the capture then uses.

One /generate request per turn, sampled with data.regenerate's settings and the turn's seed. Its rid
lies outside capture.rid_prefix, so the hook dumps none of its passes: only the capture's prefills
are stored. The answer is the token ids the server returned (the server runs with
--skip-tokenizer-init: it sends ids, not text), ending with the end-of-turn token it stopped at.
"""

from __future__ import annotations

import logging
import time
import uuid

import httpx

log = logging.getLogger(__name__)


def body(prompt: list[int], seed: int, regen, stop: int) -> dict:
    sampling = {"max_new_tokens": int(regen.max_new_tokens), "temperature": float(regen.temperature),
                "top_p": float(regen.top_p), "stop_token_ids": [int(stop)], "no_stop_trim": True,
                "skip_special_tokens": False, "sampling_seed": int(seed)}  # fmt: skip
    return {"input_ids": [int(i) for i in prompt], "rid": f"regen-{uuid.uuid4().hex}", "sampling_params": sampling}


def answer(reply: dict, stop: int) -> list[int]:
    """The generated ids of a /generate reply; the stop token it matched kept at the end, where a
    server trims it despite no_stop_trim."""
    ids = [int(i) for i in reply["output_ids"]]
    finish = (reply.get("meta_info") or {}).get("finish_reason") or {}
    if finish.get("type") == "stop" and finish.get("matched") == stop and (not ids or ids[-1] != stop):
        ids.append(stop)
    return ids


def generate(url: str, prompt: list[int], seed: int, regen, stop: int, client) -> list[int]:
    """One turn, retried as the capture's requests are (client.retries, backoff from client.backoff_s)."""
    for attempt in range(client.retries + 1):
        try:
            r = httpx.post(url + "/generate", json=body(prompt, seed, regen, stop), timeout=client.timeout_s)
            r.raise_for_status()
            return answer(r.json(), stop)
        except httpx.HTTPError as e:
            if attempt == client.retries:
                raise
            log.warning("a regeneration request failed (%s); retrying", e)
            time.sleep(client.backoff_s * 2**attempt)
    raise AssertionError("unreachable")
