"""SGLang servers and the client that decodes through them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from .common import REPLY_BYTES, SERVE, SPEC


def server(work: Path, name: str, model: Path, port: int, extra: list[str] = (), flags: list[str] = SERVE):
    from recipe.backends.sglang import Server

    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *flags, *extra]
    return Server(argv, dict(os.environ), work / "logs" / f"{name}.log", f"http://127.0.0.1:{port}", 900)


def eagle3_server(work: Path, name: str, draft_dir: Path, port: int):
    """The target with a trained draft, served as the measure serves every draft (SPEC)."""
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir), *SPEC]
    return server(work, name, work / "target", port, spec)


async def _generate(url: str, prompts: list[list[int]], concurrency: int, params: dict) -> tuple[list[dict], float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(ids):
            async with sem:
                r = await client.post(url + "/generate", json={"input_ids": ids, "sampling_params": params})
                r.raise_for_status()
                return r.json()

        t0 = time.monotonic()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return outs, time.monotonic() - t0


def generate(srv, prompts, concurrency, **params):
    return asyncio.run(_generate(srv.url, prompts, concurrency, params))


def generate_batched(srv, prompts: list[list[int]], chunk: int = 256, parallel: int = 4, **params):
    """Thousands of prompts as a few batch requests (SGLang's /generate takes a list of input_ids):
    one HTTP request per prompt leaves a Python client, not the server, setting the pace."""
    import concurrent.futures as cf

    import httpx

    def post(ids):
        r = httpx.post(srv.url + "/generate", json={"input_ids": ids, "sampling_params": params}, timeout=900)
        r.raise_for_status()
        return r.json()

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(parallel) as pool:
        parts = list(pool.map(post, [prompts[i : i + chunk] for i in range(0, len(prompts), chunk)]))
    return [o for part in parts for o in part], time.monotonic() - t0


def decode_figures(srv, prompts: list[list[int]], stop: list[int], batch: int) -> dict:
    """Greedy decode of held-out prompts with `batch` requests in flight: output tokens/s and, under
    speculative decoding, acceptance length (accepted tokens per verify pass, the bonus included)."""
    outs, wall = generate(srv, prompts, batch, max_new_tokens=REPLY_BYTES, temperature=0.0, stop_token_ids=stop)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    fig = {"batch": batch, "requests": len(outs), "output_tokens": tokens, "seconds": round(wall, 3)}
    fig["tokens_per_s"] = round(tokens / wall, 1)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    if verify:
        fig["accept_length"] = round(tokens / verify, 3)
        fig["accept_length_mean_per_request"] = round(
            sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs), 3
        )
    fig["outputs_sha1"] = hashlib.sha1(json.dumps([o["output_ids"] for o in outs]).encode()).hexdigest()[:12]
    return fig
