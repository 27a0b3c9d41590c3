"""Step 2: training data the way EAGLE-3 practice makes it: the target answers held-in prompts."""

from __future__ import annotations

import functools
import json
import random
import time
from pathlib import Path

from .chat import SYSTEM, Chat, corpus, window
from .common import DATA_SERVE, REPLY_BYTES, STOP_GRACE_S, log
from .servers import generate, generate_batched, server


def data_server(work: Path, warm, probe: list[int]):
    """The warm server (started on the untrained weights while the target trained) with the trained
    weights loaded through SGLang's /update_weights_from_disk, checked by a greedy reply that changes;
    else a fresh server on the trained target."""
    import httpx

    if warm is not None and warm.proc is not None:
        try:
            warm.wait_ready()
            params = dict(max_new_tokens=32, temperature=0.0)
            before = generate(warm, [probe], 1, **params)[0][0]["output_ids"]
            load = {"model_path": str(work / "target")}
            r = httpx.post(warm.url + "/update_weights_from_disk", json=load, timeout=600)
            after = generate(warm, [probe], 1, **params)[0][0]["output_ids"]
            if r.status_code == 200 and r.json().get("success") and after != before:
                return warm, "warm server, trained weights reloaded"
            log(f"data: reload refused or without effect ({r.status_code} {r.text[:200]}); a fresh server")
        except Exception as e:  # noqa: BLE001 - any failure of the shortcut falls back to the plain way
            log(f"data: warm server unusable ({type(e).__name__}: {str(e)[:300]}); a fresh server")
        warm.stop(grace_s=STOP_GRACE_S)
    srv = server(work, "data-target-fresh", work / "target", 31001, flags=DATA_SERVE)
    srv.start()
    srv.wait_ready()
    return srv, "fresh server"


def original_data(work: Path, n_train: int, n_eval: int, seed: int = 0) -> dict:
    """--regen: the held-in prompts with their original answers (what follows in the file), as a user's
    set written by another model; the recipe's data.regenerate has the target rewrite them (extract)."""
    out = work / "data"
    if (out / "data.json").exists():
        return json.loads((out / "data.json").read_text())
    held_in, held_out = corpus()
    rng = random.Random(seed + 2)
    pairs = [window(held_in, rng) for _ in range(n_train)]
    evals = [window(held_out, rng)[0] for _ in range(n_eval)]
    kept = write_data(out, [u for u, _ in pairs], evals, [a.decode() for _, a in pairs])
    info = {"train_conversations": kept, "eval_prompts": n_eval, "answers": "original (the files')"}
    (out / "data.json").write_text(json.dumps(info, indent=1))
    return info


def make_data(work: Path, n_train: int, n_eval: int, temperature: float, warm=None, seed: int = 0) -> dict:
    from transformers import AutoTokenizer

    out = work / "data"
    if (out / "data.json").exists():
        return json.loads((out / "data.json").read_text())
    tok = AutoTokenizer.from_pretrained(work / "target")
    chat = Chat(tok)
    held_in, held_out = corpus()
    rng = random.Random(seed + 2)
    users = [window(held_in, rng)[0] for _ in range(n_train)]
    evals = [window(held_out, rng)[0] for _ in range(n_eval)]
    t0 = time.monotonic()
    srv, how = data_server(work, warm, chat.prompt(users[0]))
    ready_s = time.monotonic() - t0
    try:
        outs, wall = generate_batched(
            srv, [chat.prompt(u) for u in users], max_new_tokens=REPLY_BYTES + 64, temperature=temperature,
            stop_token_ids=[chat.eot],
        )  # fmt: skip
    finally:
        srv.stop(grace_s=STOP_GRACE_S)
    kept = write_data(out, users, evals, [chat.reply_text(o["output_ids"]) for o in outs])
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    info = {"train_conversations": kept, "eval_prompts": n_eval, "generated_tokens": tokens, "server": how,
            "temperature": temperature}  # fmt: skip
    info.update(server_ready_seconds=round(ready_s, 1), generation_seconds=round(wall, 1))
    (out / "data.json").write_text(json.dumps(info, indent=1))
    log(f"data: {kept} conversations ({tokens} generated tokens in {wall:.0f} s, {how}), {n_eval} held-out prompts")
    return info


def write_data(out: Path, users: list[bytes], evals: list[bytes], replies: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    kept = 0
    with open(out / "train.jsonl", "w") as f:
        for u, reply in zip(users, replies):
            if reply:
                msgs = [system_message(), {"role": "user", "content": u.decode()}]
                msgs.append({"role": "assistant", "content": reply})
                f.write(json.dumps({"messages": msgs}) + "\n")
                kept += 1
    with open(out / "eval.jsonl", "w") as f:
        for u in evals:
            f.write(json.dumps({"messages": [system_message(), {"role": "user", "content": u.decode()}]}) + "\n")
    return kept


def system_message() -> dict:
    return {"role": "system", "content": SYSTEM.decode()}


@functools.cache  # the serving threads and serve() share one list (read, never changed)
def eval_prompts(work: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    chat = Chat(AutoTokenizer.from_pretrained(work / "target"))
    lines = (work / "data" / "eval.jsonl").read_text().splitlines()
    return [chat.prompt(json.loads(x)["messages"][-1]["content"].encode()) for x in lines]  # [system, user]
