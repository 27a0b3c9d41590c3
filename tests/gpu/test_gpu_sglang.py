"""The SGLang path on a real GPU with the real (patched) SGLang 0.5.16. Skipped without CUDA + SGLang.

Run (GPU host, SGLang importable, the patch applied):
    GPU_REPORT=/tmp/gpu_report.json python -m pytest -q tests/gpu -s

Two tiny models with *real* random weights (safetensors, built by recipe.models on this machine) are
served by SGLang and compared with the HF backend on the same weights. Every figure the tests
measure goes into GPU_REPORT (JSON), written after each test.

Tolerance (bf16): per sample and slot, relative L2 error ||sglang - hf|| / ||hf|| <= 0.05. SGLang and
HF use different kernels (fused RMSNorm/residual, triton attention, MLA absorption), so they agree
to bf16 rounding, not bitwise; the bugs this guards against (a layer off by one, pre- vs post-norm,
rows of the wrong request) give errors of order 1, and the off-by-one check below makes the layer
convention explicit. The dump itself is compared bit for bit with SGLang's own return_hidden_states.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import compose

from recipe.backends.sglang import Server, server_argv, server_env
from recipe.capture import records, settings
from recipe.main import RunFailed, run
from recipe.models import materialize
from recipe.shards import ShardReader
from recipe.shards.verify import verify

pytestmark = pytest.mark.gpu
# GPU_FAKE=1: a CPU dry run of this module's plumbing against tests/fake_sglang.py (proves nothing about SGLang)
FAKE = os.environ.get("GPU_FAKE") == "1"
HAVE = FAKE or (torch.cuda.is_available() and __import__("importlib").util.find_spec("sglang") is not None)
DEVICE = "cpu" if FAKE else "cuda"
if not HAVE:
    pytest.skip("needs CUDA and SGLang 0.5.16 (the GPU proof; see tests/gpu/README.md)", allow_module_level=True)

# The fidelity bound is bf16's own, measured per model and slot (bf16_bound): HF in bf16 is within e
# of HF in float32; the dump, another bf16 computation of the same function, is held to within 2e of
# HF bf16 (the triangle inequality, if its own rounding error is no larger than HF's).
TOL_LOGPROB = 0.15  # nats, worst token: bf16 states through a float head vs SGLang's own (bf16) logits
# Every input is built in this run: a fresh folder unless GPU_WORK names one (kept for debugging);
# no test reads what an earlier run left.
WORK = Path(os.environ.get("GPU_WORK") or __import__("tempfile").mkdtemp(prefix="gpu-proof-"))
if os.environ.get("GPU_WORK"):
    shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir(parents=True, exist_ok=True)
REPORT_PATH = Path(os.environ.get("GPU_REPORT", WORK / "report.json"))
MODELS = {  # builtin name, capture layers (residual stream entering these layers), layers, hidden
    "llama": ("tiny-llama-256", [1, 3, 5], 6, 256),
    "deepseek": ("tiny-deepseek-v3", [1, 2, 3], 4, 256),
    # Kimi-K2.5's layout (recipe/models/kimi_k25.py): served by SGLang's KimiK25ForConditionalGeneration
    "kimi": ("tiny-kimi-k2.5", [1, 2, 3], 4, 256),
    # the same with INT4 routed experts as the real checkpoint ships them (recipe/int4.py)
    "kimi-int4": ("tiny-kimi-k2.5-int4", [1, 2, 3], 4, 256),
}
KIND_EXTRA = {k: ["model.trust_remote_code=true"] for k in ("kimi", "kimi-int4")}  # its tokenizer is remote code
REPORT: dict = {
    "tolerance": "per slot: 2 x rel-L2(HF bf16, HF float32) on the same samples",
    "fake": FAKE,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "gpus": torch.cuda.device_count(),
}


def save_report():
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    REPORT_PATH.write_text(json.dumps(REPORT, indent=2, default=str))


def cfg_for(kind, port, out, *extra, launch=False, dump_dir=None):
    name, layers, n, h = MODELS[kind]
    return compose(
        [
            "backend=sglang",
            f"model.name={name}",
            f"model.path={WORK / 'models' / name}",
            f"model.num_layers={n}",
            f"model.hidden_size={h}",
            f"model.default_layers={layers}",
            f"output_dir={out}",
            f"capture.dump_dir={dump_dir or WORK / 'shm' / kind}",
            f"server.port={port}",
            f"server.launch={str(launch).lower()}",
            "server.args.attention_backend=triton",
            "+server.args.sampling_backend=pytorch",
            "+server.args.grammar_backend=none",
            "server.args.mem_fraction_static=0.3",
            "+server.args.max_total_tokens=65536",
            "server.args.chunked_prefill_size=256",
            "+server.args.enable_return_hidden_states=true",
            "server.ready_timeout_s=420",
            "client.concurrency=16",
            "capture.dump_timeout_s=30",
            "log_every_s=5",
            *KIND_EXTRA.get(kind, []),
            *extra,
        ]
    )


class Running:
    def __init__(self, kind, port, *extra, tp=1, fake_mode=""):
        self.trace = WORK / f"trace-{port}"  # each writing process lists what it wrote
        self.trace.mkdir(parents=True, exist_ok=True)
        self.kind, self.port = kind, port
        self.dump = WORK / "shm" / f"{kind}-{port}"
        shutil.rmtree(self.dump, ignore_errors=True)
        self.dump.mkdir(parents=True)
        materialize(MODELS[kind][0], WORK / "models" / MODELS[kind][0])
        if FAKE:
            import sys

            extra = (*extra, f"server.command=[{sys.executable},{Path(__file__).parent.parent / 'fake_sglang.py'}]")
        self.cfg = cfg_for(
            kind, port, WORK / "unused", f"server.args.tp_size={tp}", *extra, launch=True, dump_dir=self.dump
        )
        self.url = f"http://127.0.0.1:{port}"
        self.log = WORK / f"server-{kind}-{port}.log"
        env = server_env(self.cfg.nccl, self.cfg.capture, self.dump, server=self.cfg.server)
        env[settings.ENV_TRACE] = str(self.trace)
        if FAKE:
            env["FAKE_SGLANG_MODE"] = fake_mode
        self.server = Server(
            server_argv(self.cfg.server, WORK / "models" / MODELS[kind][0]), env, self.log, self.url, 420
        )

    def __enter__(self):
        self.server.start()
        self.ready_s = self.server.wait_ready()
        return self

    def __exit__(self, *a):
        self.server.stop()

    def recipe(self, out, *extra):
        return run(cfg_for(self.kind, self.port, out, *extra, dump_dir=self.dump))


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def served(request):
    kind = request.param
    with Running(kind, {"llama": 31000, "deepseek": 31100}[kind]) as srv:
        REPORT.setdefault(kind, {})["server_ready_s"] = round(srv.ready_s, 1)
        # the server's own warm-up ran before /health said 200; health checks run real passes too
        for _ in range(3):
            httpx.get(srv.url + "/health", timeout=30)
        time.sleep(1.0)
        REPORT[kind]["dump_files_after_warmup_and_health"] = sorted(p.name for p in srv.dump.iterdir())
        yield srv


def hf_reference(kind, dtype="bfloat16"):
    from recipe.backends.hf import HFBackend

    name, layers, n, _ = MODELS[kind]
    return HFBackend(
        WORK / "models" / name, list(range(n)), True, device=DEVICE, dtype=dtype
    )  # all layers: for the off-by-one check


_BOUNDS: dict = {}


def bf16_bound(kind, reader) -> list[float]:
    """Per slot: 2 x the worst rel-L2 between HF in bf16 and HF in float32 over the reader's samples."""
    key = (kind, tuple(reader.ids))
    if key not in _BOUNDS:
        layers = MODELS[kind][1]
        be16, be32 = hf_reference(kind), hf_reference(kind, "float32")
        worst = None
        for rid in reader.ids:
            ids = reader.get(rid)["input_ids"].numpy()
            a, b = (be.hidden_states([ids])[0].float() for be in (be16, be32))
            a, b = (torch.cat([x[:, layers], x[:, -1:]], dim=1) for x in (a, b))
            e = (a - b).norm(dim=(0, 2)) / b.norm(dim=(0, 2))
            worst = e if worst is None else torch.maximum(worst, e)
        _BOUNDS[key] = (2 * worst).tolist()
        REPORT.setdefault(kind, {})["bf16_bound_per_slot"] = _BOUNDS[key]
    return _BOUNDS[key]


def within(errors, bound) -> bool:
    return all(e <= b for e, b in zip(errors, bound, strict=True))


def compare(reader, be, layers, ids=None):
    """Per slot: worst rel-L2, max-abs, mean-abs over samples; and which HF index each slot matches best."""
    stats = {"rel_l2": [], "max_abs": [], "mean_abs": [], "best_index": []}
    for rid in ids or reader.ids:
        x = reader.get(rid)
        ref_all = be.hidden_states([x["input_ids"].numpy()])[0].float()  # [T, n+1, H]: hs[0..n-1] + final
        got = x["hidden"].float()
        ref = torch.cat([ref_all[:, layers], ref_all[:, -1:]], dim=1)
        d = got - ref
        stats["rel_l2"].append((d.norm(dim=(0, 2)) / ref.norm(dim=(0, 2))).tolist())
        stats["max_abs"].append(d.abs().amax(dim=(0, 2)).tolist())
        stats["mean_abs"].append(d.abs().mean(dim=(0, 2)).tolist())
        # which HF hidden_states index is each captured slot closest to? (layer convention, directly)
        best = [int(((got[:, s : s + 1] - ref_all[:, :-1]).norm(dim=(0, 2))).argmin()) for s in range(len(layers))]
        stats["best_index"].append(best)
    worst = {k: np.max(np.asarray(v), axis=0).round(6).tolist() for k, v in stats.items() if k != "best_index"}
    worst["mean_of_mean_abs"] = np.mean(np.asarray(stats["mean_abs"]), axis=0).round(6).tolist()
    worst["best_index_per_slot"] = sorted({tuple(b) for b in stats["best_index"]})
    return worst


@pytest.fixture(scope="module")
def batched(served):
    """The bundled 40 conversations through the recipe at concurrency 16: this run's own samples."""
    out = WORK / f"out-{served.kind}-batched"
    t0 = time.time()
    counts = served.recipe(out)
    REPORT[served.kind]["batched_run"] = {"counts": counts, "seconds": round(time.time() - t0, 2)}
    return out, counts


def test_fidelity_against_hf(served, batched):
    kind = served.kind
    _, layers, _, _ = MODELS[kind]
    out, counts = batched
    assert counts["ok"] == counts["input"] == 40 and not counts["failed"]
    assert verify(out) == []
    reader = ShardReader(out)
    REPORT[kind]["chunked_samples"] = sum(r["tokens"] > 256 for r in reader.records)
    worst = compare(reader, hf_reference(kind), layers)
    REPORT[kind]["fidelity_vs_hf"] = worst
    REPORT[kind]["slots"] = reader.manifest["capture"]["slots"]
    REPORT[kind]["patch"] = reader.manifest["backend"]["patch"]
    bound = bf16_bound(kind, reader)  # recorded in the report before it is saved
    save_report()
    assert within(worst["rel_l2"], bound), (worst, bound)
    assert worst["best_index_per_slot"] == [tuple(layers)], (
        "a captured slot matches another HF index: convention broken"
    )
    assert served.dump.exists() and not list(served.dump.iterdir())  # nothing left behind on the RAM disk
    assert REPORT[kind]["dump_files_after_warmup_and_health"] == []


def lm_head(kind) -> torch.Tensor:
    from safetensors import safe_open

    d = WORK / "models" / MODELS[kind][0]
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            if "lm_head.weight" in st.keys():
                return st.get_tensor("lm_head.weight").float()
    raise KeyError("lm_head.weight")


def generate_returning_states(served, ids: list[int], rid: str) -> dict:
    """One prefill with SGLang's own hidden states and input-token logprobs returned."""
    body = {"input_ids": ids, "rid": rid, "return_hidden_states": True, "return_logprob": True,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}  # fmt: skip
    return httpx.post(served.url + "/generate", json=body, timeout=120).json()


def dump_pieces(served, rid: str, n: int, wait_s: float = 20) -> list:
    """The dump's pieces of request `rid`, once they hold its n rows (or wait_s passed)."""
    deadline = time.time() + wait_s
    while True:
        pieces = sorted(served.dump.glob(f"{rid}.*.hsr"))
        if sum(records.read_record(p)[0]["n"] for p in pieces) >= n or time.time() >= deadline:
            return pieces
        time.sleep(0.2)


def test_dump_equals_return_hidden_states(served):
    """SGLang's own returns, against the dump. The aux slots: return_hidden_states gives their
    concatenation [T, K*H], bit for bit. The final slot: SGLang's input-token logprobs are
    log_softmax(lm_head(final state)), so lm_head(final slot) must give the same logprobs; a pre-norm
    final state (or any other slot) would not."""
    kind = served.kind
    K = len(MODELS[kind][1])
    head = lm_head(kind)
    rng = np.random.default_rng(0)
    results = []
    for k, n in enumerate((17, 200, 700)):  # 700 > chunked_prefill_size: several passes
        ids = rng.integers(0, 256, n).tolist()
        rid = f"hsx-xcheck-{kind}-{k}"
        r = generate_returning_states(served, ids, rid)
        native = np.asarray(r["meta_info"]["hidden_states"][0], dtype=np.float32)
        pieces = dump_pieces(served, rid, n)
        parts = [records.read_record(p) for p in pieces]
        hid = np.concatenate([x[2] for x in parts])  # [T, K+1, H] bf16 bits
        ids_dumped = np.concatenate([x[1] for x in parts])
        aux = torch.from_numpy(hid[:, :K].astype(np.int16)).view(torch.bfloat16).float().reshape(n, -1).numpy()
        res = {"tokens": n, "pieces": len(parts), "native_shape": list(native.shape), "dump_shape": list(aux.shape)}
        # SGLang 0.5.16 returns hidden states of the *last* prefill chunk only (seen: 188 of 700 rows with
        # chunked_prefill_size 256); the dump holds every row, so compare the rows SGLang returns.
        tail = aux[-native.shape[0] :]
        res["compared_rows"] = int(native.shape[0])
        res["max_abs_diff"] = float(np.abs(native - tail).max())
        res["bit_equal"] = bool(native.shape[1:] == tail.shape[1:] and np.array_equal(native, tail))
        # the final slot through lm_head vs SGLang's logprob of each next prompt token
        native_lp = np.asarray([x[0] for x in r["meta_info"]["input_token_logprobs"][1:]], dtype=np.float64)
        slots = torch.from_numpy(hid.astype(np.int16)).view(torch.bfloat16).float()  # [T, K+1, H]
        nxt = torch.as_tensor(ids[1:])

        def logprobs(states):
            return torch.log_softmax(states[:-1] @ head.T, -1).gather(1, nxt[:, None])[:, 0].double().numpy()

        res["logprob_rows"] = int(native_lp.shape[0])
        res["final_slot_logprob_max_abs_diff"] = float(np.abs(logprobs(slots[:, K]) - native_lp).max())
        res["last_aux_slot_logprob_max_abs_diff"] = float(np.abs(logprobs(slots[:, K - 1]) - native_lp).max())
        results.append(res)
        assert np.array_equal(ids_dumped, np.asarray(ids, np.int32))
        for p in pieces:
            p.unlink()
    REPORT[kind]["dump_vs_return_hidden_states"] = results
    save_report()
    assert all(r.get("bit_equal") for r in results), results
    assert all(r["logprob_rows"] == r["tokens"] - 1 for r in results), results
    assert all(r["final_slot_logprob_max_abs_diff"] <= TOL_LOGPROB for r in results), results
    # the check can tell slots apart: another slot through the same head is far off
    assert all(r["last_aux_slot_logprob_max_abs_diff"] > 5 * r["final_slot_logprob_max_abs_diff"] for r in results), (
        results
    )


def test_a_prefill_only_request_returns_the_prompts_logprobs(served):
    """The self-check's requests could need no decode pass: with max_new_tokens 0, SGLang's prompt
    logprobs (computed on the extend pass) come back as with one generated token, chunked prompts too."""
    rng = np.random.default_rng(1)
    res = []
    for k, n in enumerate((17, 700)):  # 700 > chunked_prefill_size: several passes
        ids = rng.integers(0, 256, n).tolist()
        got = {}
        for new in (0, 1):
            body = {"input_ids": ids, "rid": f"other-lp-{served.kind}-{k}-{new}", "return_logprob": True,
                    "logprob_start_len": 0, "sampling_params": {"max_new_tokens": new, "temperature": 0}}  # fmt: skip
            meta = httpx.post(served.url + "/generate", json=body, timeout=120).json()["meta_info"]
            got[new] = [x[0] for x in meta.get("input_token_logprobs") or []]
        both = min(len(got[0]), len(got[1]))
        diff = max((abs(a - b) for a, b in zip(got[0][1:both], got[1][1:both])), default=None)
        res.append({"tokens": n, "rows_new_0": len(got[0]), "rows_new_1": len(got[1]), "max_abs_diff": diff})
    REPORT[served.kind]["prefill_only_logprobs"] = res
    save_report()
    assert all(r["rows_new_0"] == r["rows_new_1"] == r["tokens"] for r in res), res
    assert all(r["max_abs_diff"] is not None and r["max_abs_diff"] <= TOL_LOGPROB for r in res), res


def test_batched_equals_one_at_a_time(served, batched):
    kind = served.kind
    out1 = WORK / f"out-{kind}-single"
    served.recipe(out1, "client.concurrency=1", "data.limit=12")
    single, batched = ShardReader(out1), ShardReader(batched[0])
    diffs, identical = [], 0
    for sid in single.ids:
        a, b = single.get(sid)["hidden"].float(), batched.get(sid)["hidden"].float()
        identical += bool(torch.equal(a, b))
        diffs.append(((a - b).norm() / b.norm()).item())
    REPORT[kind]["batched_vs_single"] = {
        "samples": len(diffs),
        "bit_identical": identical,
        "worst_rel_l2": max(diffs),
        "chunked": sum(r["tokens"] > 256 for r in single.records),
    }
    bound = bf16_bound(kind, single)  # recorded in the report before it is saved
    save_report()
    assert len(diffs) == 12 and max(diffs) <= max(bound), (max(diffs), bound)


def test_cuda_graphs_on_are_caught(tmp_path):
    """The silent-failure guard: prefill+decode CUDA graphs forced on (the hook cannot run on replay).
    Every sample must end up stored-and-correct or reported failed, and the run must exit non-zero."""
    kind = "llama"
    # prefill "breakable" is SGLang 0.5.16's own default when the flag is left out (the realistic mistake);
    # "full" for prefill is rejected by SGLang itself for these models (Invalid forward mode EXTEND).
    with Running(
        kind,
        31900,
        "server.allow_unsafe_flags=true",
        "server.args.cuda_graph_backend_prefill=breakable",
        "server.args.cuda_graph_backend_decode=full",
        fake_mode="graphs",
    ) as srv:
        out = WORK / "out-graphs"
        shutil.rmtree(out, ignore_errors=True)
        failed = None
        try:
            srv.recipe(out, "capture.dump_timeout_s=10")
        except RunFailed as e:
            failed = str(e)
        m = json.loads((out / "manifest.json").read_text())
        c = m["counts"]
        REPORT["cuda_graphs_on"] = {"run_failed": failed, "counts": c}
        stored = ShardReader(out)
        if len(stored):
            REPORT["cuda_graphs_on"]["stored_fidelity"] = compare(stored, hf_reference(kind), MODELS[kind][1])
        bound = bf16_bound(kind, stored) if len(stored) else None  # recorded in the report before it is saved
        save_report()
        assert c["ok"] + sum(c["failed"].values()) == c["input"]
        assert set(c["failed"]) <= {"no_dump", "incomplete_dump"}
        assert (failed is not None) == bool(c["failed"])  # non-zero exit exactly when something is missing
        if len(stored):  # whatever was stored must be right: no hole filled with garbage
            assert within(REPORT["cuda_graphs_on"]["stored_fidelity"]["rel_l2"], bound)
        if not c["failed"]:  # every sample stored and right: no graph replay skipped the hook
            pytest.skip("no prefill CUDA graph replayed here, so nothing was there to catch (docs/benchmarks.md)")


REGEN = (  # greedy, so the stored final states must pick the generated ids as the server did
    "data.regenerate.turns=last", "data.regenerate.temperature=0", "data.regenerate.max_new_tokens=64",
    "server.args.cuda_graph_backend_decode=null",  # SGLang's default: decode graphs on, as regeneration runs
)  # fmt: skip


def test_regeneration_decodes_on_graphs_and_dumps_each_capture_once():
    """data.regenerate on the real server: the target writes the last answers with decode CUDA graphs
    on, then the capture prefills each whole conversation. The writers' trace holds the capture's
    requests alone, each row once (no generation prefill, no decode pass); each stored sample's ids are
    its prompt's ids plus the ids the server generated (regenerated.jsonl), the mask on those alone;
    and the stored final states pick those ids greedily, as the server did."""
    kind = "llama"
    with Running(kind, 32120, *REGEN) as srv:
        out = WORK / "out-regenerate"
        shutil.rmtree(out, ignore_errors=True)
        counts = srv.recipe(out, *REGEN)
        writers = [tuple(x.split()) for f in srv.trace.iterdir() for x in f.read_text().splitlines()]
    decode_lines = [x for x in srv.log.read_text(errors="replace").splitlines() if "Decode batch" in x]
    reader, rows = ShardReader(out), regenerated_rows(out)
    spans: dict = {}
    for rid, off, n in writers:
        spans.setdefault(rid, []).append((int(off), int(n)))
    exact, agree, generated = 0, 0, 0
    head = lm_head(kind)
    for rec in reader.records:
        x, turn = reader.get(rec["id"]), rows["turns"][rec["id"]]
        ids, mask, gen = x["input_ids"].numpy(), x["loss_mask"].numpy(), np.asarray(turn["generated"])
        exact += bool(np.array_equal(ids, rows["ids"][rec["id"]]) and np.array_equal(ids[-len(gen) :], gen)
                      and np.array_equal(np.flatnonzero(mask), np.arange(len(ids) - len(gen), len(ids))))  # fmt: skip
        pred = (x["hidden"][:-1, -1].float() @ head.T).argmax(-1).numpy()  # the final slot: what lm_head reads
        agree += int((pred[len(ids) - len(gen) - 1 :] == gen).sum())
        generated += len(gen)
    REPORT["regenerate"] = {
        "counts": counts, "samples": len(reader.records), "exact_ids": exact, "generated_tokens": generated,
        "greedy_agreement": round(agree / max(generated, 1), 4), "traced_requests": len(spans),
        "decode_log_lines": len(decode_lines),
        "decode_lines_on_graphs": sum("cuda graph: True" in x for x in decode_lines),
    }  # fmt: skip
    save_report()
    assert not counts["failed"] and counts["ok"] == len(reader.records) > 30 and generated > 0, REPORT["regenerate"]
    assert set(spans) == {"hsx-" + r["id"] for r in reader.records}, "a request other than the capture's was dumped"
    assert all(rows_once(spans["hsx-" + r["id"]], r["tokens"]) for r in reader.records), "a row dumped twice or never"
    assert exact == len(reader.records), REPORT["regenerate"]
    assert REPORT["regenerate"]["greedy_agreement"] >= 0.95, REPORT["regenerate"]
    assert FAKE or REPORT["regenerate"]["decode_lines_on_graphs"] > 0, decode_lines[:3]  # the fake logs none


def regenerated_rows(out: Path) -> dict:
    """regenerated.jsonl: each sample's generated turn and its conversation's ids."""
    rows = [json.loads(x) for x in (out / "regenerated.jsonl").read_text().splitlines()]
    conversations = [r["conversation"] for r in rows if "conversation" in r]
    return {
        "turns": {r["turn"]["id"]: r["turn"] for r in rows if "turn" in r},
        "ids": {c["id"]: np.asarray(c["input_ids"]) for c in conversations},
    }


def rows_once(spans, n: int) -> bool:
    """The pieces (offset, tokens) of one request cover its rows [0, n) exactly once."""
    at = 0
    for off, k in sorted(spans):
        if off != at:
            return False
        at += k
    return at == n


TP2_CASES = {  # name: (port, extra server flags)
    "tp2": (31950, []),
    "tp2_dp_attention": (31960, ["+server.args.enable_dp_attention=true", "server.args.dp_size=2"]),
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
@pytest.mark.parametrize("case", list(TP2_CASES))
def test_tp2_every_row_written_once_by_the_right_writers(case):
    """Under TP every rank holds the same states: each rank of the attention-TP group writes its own
    share of every pass's rows. With DP attention each DP group holds its own requests (its attention-TP
    group is one rank here): each group writes only those. Counted from the writers' own trace (the dump
    folder cannot show it: two writers of one record leave one file): every row of every request
    written exactly once; the stored states checked against HF, built in this test."""
    kind = "deepseek"
    port, flags = TP2_CASES[case]
    with Running(kind, port, "+server.args.enforce_disable_flashinfer_allreduce_fusion=true", *flags, tp=2) as srv:
        out = WORK / f"out-{case}"
        counts = srv.recipe(out, "data.limit=12")
        writers = {f.name: [tuple(x.split()) for x in f.read_text().splitlines()] for f in srv.trace.iterdir()}
    reader = ShardReader(out)
    pieces = [p for lines in writers.values() for p in lines]
    rid_sets = [{p[0] for p in lines} for lines in writers.values()]
    spans = {}  # rid -> [(offset, tokens)] over all writers
    for rid, off, n in pieces:
        spans.setdefault(rid, []).append((int(off), int(n)))
    worst = compare(reader, hf_reference(kind), MODELS[kind][1])
    REPORT[case] = {
        "counts": counts,
        "writers": {k: len(v) for k, v in writers.items()},
        "records": len(pieces),
        "unique_records": len(set(pieces)),
        "requests_per_writer": [len(r) for r in rid_sets],
        "requests_cut_between_writers": sum(len(r) for r in rid_sets) - len(set().union(*rid_sets)),
        "fidelity_vs_hf": worst,
    }
    bound = bf16_bound(kind, reader)  # recorded in the report before it is saved
    save_report()
    assert counts["ok"] == 12 and len(reader.records) == len(set(reader.ids)) == 12
    assert len(pieces) == len(set(pieces)), "a record was written twice"
    assert len(writers) == 2 and all(writers.values()), writers.keys()  # two ranks' shares, or two DP groups
    if "dp" in case:
        assert not rid_sets[0] & rid_sets[1], "two DP groups wrote the same request"
    stored = {r["id"]: r["tokens"] for r in reader.records}
    assert all(rows_once(spans.get("hsx-" + sid, []), n) for sid, n in stored.items()), (
        "a stored sample's rows were written twice or never"
    )
    assert within(worst["rel_l2"], bound), (worst, bound)
    assert worst["best_index_per_slot"] == [tuple(MODELS[kind][1])]


KIMI_CASES = {  # name: (kind, port, tp, extra server flags)
    "kimi_tp1": ("kimi", 32040, 1, []),
    "kimi_tp2": ("kimi", 32050, 2, []),
    "kimi_tp2_dp_attention": ("kimi", 32060, 2, ["+server.args.enable_dp_attention=true", "server.args.dp_size=2"]),
    # INT4 experts through SGLang's compressed-tensors W4A16 MoE: its default runner (Marlin) and triton
    "kimi_int4_tp1": ("kimi-int4", 32070, 1, []),
    "kimi_int4_tp1_triton_moe": ("kimi-int4", 32080, 1, ["+server.args.moe_runner_backend=triton"]),
}
MOE_METHOD = ("Using CompressedTensors", "compressed_tensors", "WNA16", "Marlin", "marlin")


def ids_and_masks_as_the_template(reader, model_dir, chat) -> tuple[int, int]:
    """(samples whose stored ids and mask equal the model's own template's, multi-turn samples)."""
    from transformers import AutoTokenizer

    from recipe import data

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    exact, multi_turn = 0, 0
    with open(chat) as f:
        for line in f:
            msgs = data.to_messages(json.loads(line))
            ids, mask = data.tokenize(tok, msgs)
            keep = reader.manifest["data"]["max_length"]  # the run truncates past it
            ids, mask = ids[:keep], mask[:keep]
            x = reader.get(data.sample_id(msgs))
            multi_turn += sum(m["role"] == "assistant" for m in msgs) > 1
            exact += bool(np.array_equal(x["input_ids"].numpy(), ids) and np.array_equal(x["loss_mask"].numpy(), mask))
    return exact, multi_turn


@pytest.mark.parametrize("case", list(KIMI_CASES))
def test_kimi_k25_layout_through_sglangs_kimi_wrapper(case):
    """A checkpoint laid out like Kimi-K2.5 (kimi_k25 config, language_model./vision_tower. weights,
    remote-code tokenizer, thinking template; INT4 routed experts in the *_int4 cases) served by
    SGLang's KimiK25ForConditionalGeneration, which calls the patched DeepSeek-V3 with input_embeds:
    every sample dumped, each slot within tolerance of HF DeepseekV3ForCausalLM on the same language
    weights (the INT4 ones dequantized) and nearest its configured index, ids and masks exactly the
    template's, each TP rank writing its share."""
    from test_kimi import kimi_chat  # the bundled conversations with reasoning on every assistant turn

    kind, port, tp, flags = KIMI_CASES[case]
    if FAKE or torch.cuda.device_count() < tp:
        pytest.skip("the fake server has no Kimi wrapper" if FAKE else f"needs {tp} GPUs")
    chat = kimi_chat(WORK / "kimi-chat.jsonl")
    t0 = time.time()
    with Running(kind, port, "+server.args.enforce_disable_flashinfer_allreduce_fusion=true", *flags, tp=tp) as srv:
        info = httpx.get(srv.url + "/model_info", timeout=30).json()
        out = WORK / f"out-{case}"
        counts = srv.recipe(out, f"data.sources=[{chat}]")
        writers = {f.name: [tuple(x.split()) for x in f.read_text().splitlines()] for f in srv.trace.iterdir()}
    log_lines = srv.log.read_text(errors="replace").splitlines()
    moe_lines = sorted({ln.split("] ", 1)[-1] for ln in log_lines if any(m in ln for m in MOE_METHOD)})[:12]
    reader = ShardReader(out)
    model_dir = WORK / "models" / MODELS[kind][0]
    worst = compare(reader, hf_reference(kind), MODELS[kind][1])
    exact, multi_turn = ids_and_masks_as_the_template(reader, model_dir, chat)
    pieces = [p for lines in writers.values() for p in lines]
    REPORT[case] = {
        "model": MODELS[kind][0],
        "seconds": round(time.time() - t0, 1),
        "server_ready_s": round(srv.ready_s, 1),
        "model_info": {k: info.get(k) for k in ("model_type", "architectures", "has_image_understanding")},
        "quantization_log_lines": moe_lines,
        "counts": counts,
        "multi_turn_samples": multi_turn,
        "ids_and_masks_equal_the_template": exact,
        "writers": {k: len(v) for k, v in writers.items()},
        "records": len(pieces),
        "unique_records": len(set(pieces)),
        "fidelity_vs_hf_deepseek_v3": worst,
        "slots": reader.manifest["capture"]["slots"],
        "remote_code": reader.manifest["tokenizer"]["remote_code"],
    }
    bound = bf16_bound(kind, reader)  # recorded in the report before it is saved
    save_report()
    assert info["architectures"] == ["KimiK25ForConditionalGeneration"] and info["model_type"] == "kimi_k25"
    if kind == "kimi-int4":
        assert any("CompressedTensorsWNA16" in ln for ln in moe_lines), moe_lines
    assert counts["ok"] == counts["input"] == 40 and not counts["failed"]
    assert verify(out) == []
    assert exact == 40 and multi_turn > 0
    assert len(pieces) == len(set(pieces)) and len(writers) == tp
    assert within(worst["rel_l2"], bound), (worst, bound)
    assert worst["best_index_per_slot"] == [tuple(MODELS[kind][1])]
