"""A CPU stand-in for `python -m sglang.launch_server`, for the SGLang backend's tests.

It speaks the parts of the HTTP API the recipe uses (/health, /generate with input_ids, rid and
max_new_tokens 0) and drives the *real* recipe seam the way the patched SGLang does: `seam.install`
once the model is loaded, then its logits processor calls `hs_dump(forward_batch, final, aux_list)`
first thing on every pass, with the field names of SGLang 0.5.16's ForwardBatch. A scheduler thread
batches waiting requests into EXTEND passes, cuts prompts into chunks of --chunked-prefill-size (one
pass can hold the end of one request and the start of another), and also runs the server's own
warm-up and health-check requests through the hook.

FAKE_SGLANG_MODE (comma-separated): graphs (the hook never runs, as under CUDA-graph replay),
flaky500 (the first attempt of every request answers 500), die_once (the process exits on the 3rd
request, once per marker file FAKE_SGLANG_MARKER, leaving a claim on the whole dump budget behind),
hang_once (on the 3rd request the scheduler and /health stop answering while the process stays up;
once per marker), cached (answers cached_tokens > 0), slow (sleep per pass), slow_exit (SIGTERM
takes 3 s, as SGLang's graceful drain does, then the exit time goes to FAKE_SGLANG_EXITED),
prenorm_final (the processor is handed the state before the final norm), shifted_final (each row
holds the previous token's final state), nan_final (every final state NaN): what a model the seam misreads
would dump.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipe.capture import records, seam, settings  # noqa: E402

# The SGLang API the hook and the seam call (sglang.srt.distributed): a single-rank server, one PP stage.
_dist = SimpleNamespace(
    get_attn_tensor_model_parallel_rank=lambda: 0,
    get_attn_tensor_model_parallel_world_size=lambda: 1,
    get_pp_group=lambda: SimpleNamespace(world_size=1, is_last_rank=True),
)
sys.modules.update({"sglang": SimpleNamespace(), "sglang.srt": SimpleNamespace(), "sglang.srt.distributed": _dist})


class ForwardMode(enum.IntEnum):  # the names SGLang 0.5.16 uses
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4


class LogitsProcessor(torch.nn.Module):
    """What the patch makes of SGLang's: `hs_dump` None unless the seam set it, called first thing."""

    def __init__(self):
        super().__init__()
        self.hs_dump = None

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        if self.hs_dump is not None and "graphs" not in MODES:  # a replayed CUDA graph runs no Python
            self.hs_dump(logits_metadata, hidden_states, aux_hidden_states)


class Decoder(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(n))
        self.layers_to_capture = []


class FakeModel(torch.nn.Module):
    """An SGLang ...ForCausalLM in shape: `model.layers_to_capture`, `capture_aux_hidden_states`,
    Llama's `set_eagle3_layers_to_capture` (+1), a logits processor its forward calls."""

    def __init__(self, model_dir):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        self.capture_aux_hidden_states = False
        self.model = Decoder(self.hf.config.num_hidden_layers)
        self.logits_processor = LogitsProcessor()
        self.prenorm = None
        self.hf.model.norm.register_forward_pre_hook(lambda mod, args: setattr(self, "prenorm", args[0]))

    def set_eagle3_layers_to_capture(self, layer_ids):
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [i + 1 for i in layer_ids]

    def states(self, ids):
        with torch.inference_mode():
            hs = self.hf(torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True).hidden_states
        aux = [hs[i][0] for i in self.model.layers_to_capture]  # entering layer i
        final = self.prenorm[0] if "prenorm_final" in MODES else hs[-1][0]
        if "nan_final" in MODES:  # what SGLang 0.5.16 hands over for a tiny Qwen3-MoE: NaN states
            final = torch.full_like(final, float("nan"))
        return final, aux

    def forward(self, mode, pieces):
        """pieces: [(rid, full_ids, prefix, n)] -> one pass, handed to the logits processor as SGLang does."""
        rows_final, rows_aux, ids = [], [[] for _ in self.model.layers_to_capture], []
        for rid, full, pre, n in pieces:
            final, aux = self.states(full[: pre + n])  # causal: the first pre+n tokens decide these rows
            rows = torch.arange(pre, pre + n)
            if "shifted_final" in MODES:  # each row holds the final state of the token before it
                rows = (rows - 1).clamp(min=0)
            rows_final.append(final[rows])
            for k, a in enumerate(aux):
                rows_aux[k].append(a[pre : pre + n])
            ids += list(full[pre : pre + n])
        final = torch.cat(rows_final)
        aux = [torch.cat(r) for r in rows_aux] if self.capture_aux_hidden_states else None
        fb = SimpleNamespace(
            forward_mode=mode,
            rids=[p[0] for p in pieces],
            extend_seq_lens_cpu=[p[3] for p in pieces],
            extend_prefix_lens_cpu=[p[2] for p in pieces],
            input_ids=torch.tensor(ids, dtype=torch.int64),
            orig_seq_lens=torch.tensor([len(p[1]) for p in pieces], dtype=torch.int32),
        )
        self.logits_processor(fb.input_ids, final, None, fb, aux)


def load_model(model_dir) -> FakeModel:
    """What the patched model_runner.load_model does: the model, then the seam when the dump is on."""
    model = FakeModel(model_dir)
    if os.environ.get(settings.ENV_DIR):
        seam.install(model, os.environ)
    return model


MODES = set(filter(None, os.environ.get("FAKE_SGLANG_MODE", "").split(",")))


class Scheduler:
    def __init__(self, model: FakeModel, chunk: int):
        self.model, self.chunk = model, chunk if chunk > 0 else 1 << 30
        self.waiting, self.cv = [], threading.Condition()
        threading.Thread(target=self.loop, daemon=True).start()

    def submit(self, rid, ids) -> None:
        done = threading.Event()
        with self.cv:
            self.waiting.append({"rid": rid, "ids": list(ids), "pre": 0, "done": done})
            self.cv.notify()
        done.wait()

    def loop(self):
        try:
            self._loop()
        except BaseException:  # a crashed scheduler takes the server down, as in SGLang
            import traceback

            traceback.print_exc()
            os._exit(1)

    def _loop(self):
        while True:
            with self.cv:
                while not self.waiting:
                    self.cv.wait()
                time.sleep(0.005)  # let a few requests gather into one pass
                budget, pieces, finished = self.chunk, [], []
                for r in list(self.waiting):
                    if budget <= 0:
                        break
                    n = min(len(r["ids"]) - r["pre"], budget)
                    pieces.append((r, n))
                    budget -= n
            if "slow" in MODES:
                time.sleep(0.05)
            self.model.forward(ForwardMode.EXTEND, [(r["rid"], r["ids"], r["pre"], n) for r, n in pieces])
            with self.cv:
                for r, n in pieces:
                    r["pre"] += n
                    if r["pre"] == len(r["ids"]):
                        self.waiting.remove(r)
                        finished.append(r)
            for r in finished:
                r["done"].set()


def inject_faults(sched, n: int) -> None:
    """The failure modes (MODES) that strike on the 3rd request, once per marker file."""
    marker = os.environ.get("FAKE_SGLANG_MARKER", "")
    if n != 3 or not marker or os.path.exists(marker):
        return
    if "die_once" in MODES:
        Path(marker).write_text("died")
        # killed between reserving dump budget and releasing it: its claim (the whole budget)
        # stays behind, and only the restart can clear it
        claim = Path(os.environ[settings.ENV_DIR]) / f"{records.RESERVATION}{os.getpid()}-dead"
        claim.write_bytes(b"")
        os.truncate(claim, int(os.environ[settings.ENV_BUDGET]))
        os._exit(17)
    if "hang_once" in MODES:
        Path(marker).write_text("hung")
        with sched.cv:  # the scheduler (and so /health) stops answering, the process stays up
            time.sleep(3600)


def response_meta(model, req: dict) -> dict:
    """SGLang's meta_info for a prefill-only request, with hidden states and prompt logprobs if asked."""
    meta = {
        "id": req["rid"],
        "prompt_tokens": len(req["input_ids"]),
        "cached_tokens": 7 if "cached" in MODES else 0,
        "completion_tokens": 0,
    }
    if req.get("return_hidden_states"):  # as SGLang with aux capture on: the aux concatenation [T, K*H]
        final, aux = model.states(req["input_ids"])
        meta["hidden_states"] = [torch.cat(aux, dim=-1).float().tolist() if aux else final.float().tolist()]
    if req.get("return_logprob"):  # as SGLang: [logprob, token id, None] per prompt token, the first None
        ids = req["input_ids"]
        with torch.inference_mode():
            lp = torch.log_softmax(model.hf(torch.as_tensor(ids)[None]).logits[0].float(), -1)
        meta["input_token_logprobs"] = [[None, ids[0], None]] + [
            [lp[t - 1, ids[t]].item(), ids[t], None] for t in range(1, len(ids))
        ]
    return meta


DECODING = threading.Lock()


def decode(model, req: dict) -> list[int]:
    """A generation request's answer (data.regenerate's): what HF samples from the prompt with the
    request's seed and settings, up to its stop token, kept (no_stop_trim). Decode passes are not the
    hook's: SGLang replays them as CUDA graphs, and the seam acts on extend passes only."""
    sp = req.get("sampling_params") or {}
    n, stop = int(sp.get("max_new_tokens") or 0), (sp.get("stop_token_ids") or [None])[0]
    if n == 0 or req.get("return_logprob"):
        return []
    sample = float(sp.get("temperature", 1.0)) > 0
    with DECODING, torch.inference_mode():  # the seed is per request, as SGLang's sampling_seed is
        torch.manual_seed(int(sp.get("sampling_seed", 0)))
        out = model.hf.generate(input_ids=torch.as_tensor([req["input_ids"]]), max_new_tokens=n, do_sample=sample,
                                temperature=sp.get("temperature") if sample else None, top_p=sp.get("top_p") if sample
                                else None, top_k=None, eos_token_id=stop, pad_token_id=0)  # fmt: skip
    return out[0, len(req["input_ids"]) :].tolist()


def finish(req: dict, out: list[int]) -> dict:
    stop = ((req.get("sampling_params") or {}).get("stop_token_ids") or [None])[0]
    return {"type": "stop", "matched": stop} if out and out[-1] == stop else {"type": "length", "length": len(out)}


def make_handler(model, sched, ready: threading.Event):
    count = {"n": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path != "/health":
                return self.reply(404, {})
            if not ready.is_set():
                return self.reply(503, {"status": "warming up"})
            sched.submit(f"HEALTH_CHECK_{uuid.uuid4().hex[:8]}", [5])  # SGLang's health check is a real pass
            self.reply(200, {})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            count["n"] += 1
            inject_faults(sched, count["n"])
            if "flaky500" in MODES and "-r" not in req["rid"]:
                return self.reply(500, {"error": "injected"})
            sched.submit(req["rid"], req["input_ids"])  # the prefill, through the seam
            out, meta = decode(model, req), response_meta(model, req)
            if out:
                meta.update(completion_tokens=len(out), finish_reason=finish(req, out))
            self.reply(200, {"text": "", "output_ids": out, "meta_info": meta})

    return H


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--chunked-prefill-size", type=int, default=-1)
    args, _unknown = ap.parse_known_args()  # every other SGLang flag is accepted and ignored
    print("fake sglang argv:", json.dumps(sys.argv[1:]), flush=True)
    model = load_model(args.model_path)
    sched = Scheduler(model, args.chunked_prefill_size)
    ready = threading.Event()

    def warmup():  # what SGLang does at start-up: a bare 32-hex rid, an EXTEND of 3 tokens, then decodes
        sched.submit(uuid.uuid4().hex, [1, 2, 3])
        model.forward(ForwardMode.DECODE, [(uuid.uuid4().hex, [1, 2, 3, 4], 3, 1)])
        ready.set()

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # socketserver's 5 drops connections when a client opens many at once

    srv = Server((args.host, args.port), make_handler(model, sched, ready))
    if "slow_exit" in MODES:
        import signal

        def drain(*_):
            time.sleep(3)
            Path(os.environ["FAKE_SGLANG_EXITED"]).write_text(str(time.time()))
            os._exit(0)

        signal.signal(signal.SIGTERM, drain)
    threading.Thread(target=warmup, daemon=True).start()
    srv.serve_forever()


if __name__ == "__main__":
    main()
