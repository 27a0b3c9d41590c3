"""backend=sglang on the CPU: server argv/env from config, enforced flags, and the whole pipeline
(server lifecycle, client, hook, packer) against tests/fake_sglang.py."""

import json
import socket
import sys
import time

import pytest
import torch
from conftest import ROOT, compose

from recipe.backends.hf import HFBackend
from recipe.backends.sglang import server_argv, server_env, to_flags
from recipe.main import RunFailed, run
from recipe.selfcheck import SelfCheckFailed
from recipe.shards import ShardReader
from recipe.shards.verify import verify

FAKE = [sys.executable, str(ROOT / "tests" / "fake_sglang.py")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flags_from_yaml():
    assert to_flags(
        {
            "tp_size": 8,
            "disable_radix_cache": True,
            "enable_x": False,
            "attention_backend": None,
            "json_model_override_args": {"a": 1},
        }
    ) == ["--tp-size", "8", "--disable-radix-cache", "--json-model-override-args", '{"a": 1}']


def test_the_server_runs_a_model_folders_code_only_where_the_tokenizer_may():
    """One setting, model.trust_remote_code, for the tokenizer and the server: false by default,
    true for Kimi-K2.5 (its tokenizer is a class in the model folder), or the user's."""
    plain = compose(["backend=sglang", "output_dir=/o"])
    assert "--trust-remote-code" not in server_argv(plain.server, ROOT)
    assert "--trust-remote-code" in server_argv(compose(["experiment=kimi-k2.5", "output_dir=/o"]).server, ROOT)
    mine = compose(["backend=sglang", "output_dir=/o", "model.trust_remote_code=true"])
    assert "--trust-remote-code" in server_argv(mine.server, ROOT)


def test_server_argv_and_env(tmp_path):
    cfg = compose(["experiment=kimi-k2.5", "output_dir=/o"])
    argv = server_argv(cfg.server, tmp_path)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    joined = " ".join(argv)
    for flag in (
        "--model-path " + str(tmp_path),
        "--tp-size 8",
        "--cuda-graph-backend-prefill disabled",
        "--cuda-graph-backend-decode disabled",
        "--disable-radix-cache",
        "--skip-tokenizer-init",
        "--chunked-prefill-size 16384",
    ):
        assert flag in joined
    env = server_env(cfg.nccl, cfg.capture, tmp_path / "dump", base={})
    assert env["SGLANG_HS_DUMP_DIR"] == str(tmp_path / "dump") and env["SGLANG_HS_LAYERS"] == "3,31,59"
    assert env["SGLANG_HS_FINAL"] == "1" and env["SGLANG_HS_RID_PREFIX"] == "hsx-"
    assert env["NCCL_IB_DISABLE"] == "1"  # the nvlink-node preset
    # the hook pins its buffers for a whole pass up front: chunked prefill bounds a pass's tokens
    sized = server_env(cfg.nccl, cfg.capture, tmp_path / "dump", base={}, server=cfg.server)
    assert sized["SGLANG_HS_PASS_TOKENS"] == "16384" and sized["SGLANG_HS_WRITERS"] == "2"
    assert sized["SGLANG_HS_SHARE_RANKS"] == "0"  # one node: all 8 ranks write their shares
    # over two nodes only node 0's ranks write: the other node's /dev/shm is not the packer's
    multi = compose(["server=multinode", "output_dir=/o"])  # TP 16 over 2 nodes
    assert server_env(multi.nccl, multi.capture, tmp_path, base={}, server=multi.server)["SGLANG_HS_SHARE_RANKS"] == "8"


@pytest.mark.parametrize(
    "override",
    [
        "server.args.cuda_graph_backend_prefill=full",
        "server.args.disable_radix_cache=false",
        "server.extra_args=[--cuda-graph-backend-prefill,full]",
    ],
)
def test_enforced_flags(override):
    cfg = compose(["backend=sglang", "output_dir=/o", override])
    with pytest.raises(ValueError, match="CUDA graphs skip the Python hook"):
        server_argv(cfg.server, ROOT)
    server_argv(compose(["backend=sglang", "output_dir=/o", override, "server.allow_unsafe_flags=true"]).server, ROOT)


def test_decode_graphs_stay_off_for_a_capture_and_go_on_for_regeneration():
    """A decode pass is never dumped, so its graphs are allowed; a prefill-only capture keeps them off (no
    start-up spent capturing them), and data.regenerate, which decodes, turns them on (SGLang's default)."""
    from recipe.regenerate import decode_graphs

    plain = compose(["backend=sglang", "output_dir=/o"])
    decode_graphs(plain)
    assert "--cuda-graph-backend-decode" in server_argv(plain.server, ROOT)
    regen = compose(["backend=sglang", "output_dir=/o", "data.regenerate.turns=last"])
    decode_graphs(regen)
    argv = server_argv(regen.server, ROOT)
    assert "--cuda-graph-backend-decode" not in argv
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"


def test_dp_attention_over_several_nodes_refused():
    """Its DP groups on the other nodes would write where no packer reads: refused up front."""
    over = ["server=multinode", "output_dir=/o", "+server.args.enable_dp_attention=true", "server.args.dp_size=16"]
    with pytest.raises(ValueError, match="several nodes"):
        server_argv(compose(over).server, ROOT)
    server_argv(compose(over[:2]).server, ROOT)  # plain TP over the nodes is fine


def test_layer_zero_refused_for_sglang(tmp_path):
    with pytest.raises(ValueError, match="layer 0"):
        run(compose(["backend=sglang", f"output_dir={tmp_path}", "capture.layers=[0,2]"]))


def sg_cfg(tmp_path, *extra, chunk=64):
    return compose(
        [
            "backend=sglang",
            f"output_dir={tmp_path / 'out'}",
            f"capture.dump_dir={tmp_path / 'shm'}",
            f"server.command=[{FAKE[0]},{FAKE[1]}]",
            f"server.port={free_port()}",
            "server.ready_timeout_s=120",
            f"server.args.chunked_prefill_size={chunk}",
            "client.concurrency=4",
            "client.backoff_s=0.05",
            "client.timeout_s=60",
            "capture.dump_timeout_s=5",
            "log_every_s=1000",
            "data.limit=12",
            *extra,
        ]
    )


def reference(tiny_model_dir, ids, dtype="bfloat16"):
    """What the server computes for one prompt: each prefix's forward, unpadded (as fake_sglang does)."""
    be = HFBackend(tiny_model_dir, [1, 2, 3], True, device="cpu", dtype=dtype)
    return be.hidden_states([ids])[0]


def rel_l2(a, b):
    """Per slot: |a - b| / |b| over tokens and channels."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=(0, 2)) / b.norm(dim=(0, 2))


def test_end_to_end_with_chunked_prefill(tmp_path, tiny_model_dir):
    counts = run(sg_cfg(tmp_path))
    assert counts["ok"] == counts["input"] == 12 and not counts["failed"]
    out = tmp_path / "out"
    assert verify(out) == []
    r = ShardReader(out)
    long = max(r.records, key=lambda x: x["tokens"])
    assert long["tokens"] > 64  # really went through several chunked passes
    for rec in (long, r.records[0]):
        got = r.get(rec["id"])
        ids = got["input_ids"].numpy()
        # Rows of a chunk come from a bf16 forward over the prompt prefix: the same function as the
        # full bf16 forward, rounded in another order. The bound is bf16's own: each of the two is
        # within bf16's distance e of the float32 forward (e measured here, per slot), so they are
        # within 2e of each other (triangle inequality). A row from another token or layer is ~1 off.
        bf16, fp32 = reference(tiny_model_dir, ids), reference(tiny_model_dir, ids, "float32")
        bound = 2 * rel_l2(bf16, fp32)
        assert (rel_l2(got["hidden"], bf16) <= bound).all(), (rel_l2(got["hidden"], bf16), bound)
    log = (tmp_path / "out" / "logs" / "server.log").read_text()
    assert "--cuda-graph-backend-prefill" in log and "--disable-radix-cache" in log
    assert not list((tmp_path / "shm").glob("user-*/run-*"))


def test_unchunked_rows_are_bit_exact(tmp_path, tiny_model_dir):
    run(sg_cfg(tmp_path, "data.limit=5", chunk=-1))
    r = ShardReader(tmp_path / "out")
    for rec in r.records:
        got = r.get(rec["id"])
        assert torch.equal(got["hidden"], reference(tiny_model_dir, got["input_ids"].numpy()))


def test_missing_dumps_fail_the_run(tmp_path, monkeypatch):
    """CUDA graphs on = the hook never runs: every sample must be reported failed, non-zero exit."""
    monkeypatch.setenv("FAKE_SGLANG_MODE", "graphs")
    with pytest.raises(RunFailed, match="12 samples failed"):
        run(sg_cfg(tmp_path, "capture.dump_timeout_s=1"))
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["counts"]["failed"] == {"no_dump": 12} and m["totals"]["samples"] == 0


def test_the_self_check_judges_the_first_samples_and_passes_a_right_final_slot(tmp_path, caplog):
    caplog.set_level("INFO", logger="recipe.selfcheck")
    counts = run(sg_cfg(tmp_path, "data.limit=6", "client.self_check=3"))
    assert counts["ok"] == 6 and not counts["failed"]
    judged = [r.getMessage() for r in caplog.records if "gives the server's logprobs" in r.getMessage()]
    assert len(judged) == 3, judged


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_the_self_check_allows_an_fp8_set_its_rounding_and_a_lossless_one_bf16s(tmp_path, monkeypatch, codec):
    from recipe import selfcheck

    seen, judge_all = [], selfcheck.judge_all
    monkeypatch.setattr(
        selfcheck, "judge_all", lambda head, items, fp8=False: seen.append(fp8) or judge_all(head, items, fp8)
    )
    assert run(sg_cfg(tmp_path, "data.limit=4", "client.self_check=2", f"shards.codec={codec}"))["ok"] == 4
    assert seen and set(seen) == {codec == "fp8"}


def test_the_run_log_holds_its_progress_not_a_line_per_request(tmp_path, caplog):
    caplog.set_level("INFO")
    assert run(sg_cfg(tmp_path, "data.limit=6"))["ok"] == 6
    assert "HTTP Request" not in caplog.text and "server ready after" in caplog.text


def test_the_self_checks_requests_are_prefill_only_and_go_out_with_the_rest(tmp_path, monkeypatch):
    """No request asks for a generated token: SGLang decodes only when no prefill is pending, so one
    that did came back last (or, sent alone first, held the run back by its decode pass). The
    self-check's are the run's first requests, and the others go out beside them."""
    from recipe import selfcheck
    from recipe.backends import sglang as sg

    events, sent, payload, answered = [], [], sg.request, selfcheck.SelfCheck.answered

    def request(s, rid, ask=False):
        events.append("ask" if ask else "send")
        sent.append(payload(s, rid, ask))
        return sent[-1]

    def got(self, sample, meta):
        events.append("answered")
        return answered(self, sample, meta)

    monkeypatch.setattr(sg, "request", request)
    monkeypatch.setattr(selfcheck.SelfCheck, "answered", got)
    assert run(sg_cfg(tmp_path, "data.limit=8", "client.self_check=3"))["ok"] == 8
    assert {b["sampling_params"]["max_new_tokens"] for b in sent} == {0}
    assert events[:4] == ["ask"] * 3 + ["send"], events  # concurrency 4: all four before any answer
    assert events.count("answered") == 3 and events.count("send") == 5


@pytest.mark.parametrize("regenerate", [False, True])
def test_the_self_checks_head_is_read_while_the_server_starts(tmp_path, monkeypatch, regenerate):
    """Reading and widening lm_head (2 GB of float32 for an 8B target) happens before the server is ready,
    not beside the capture, where it competed with the packer for the host's cores (one H100 run); also
    when regeneration starts the server, long before the capture."""
    import threading

    from recipe import selfcheck
    from recipe.backends import sglang as sg

    warming, order = threading.Event(), []
    warm, ready = selfcheck.SelfCheck.warm, sg.Server.wait_ready

    def warm_first(self):
        order.append("warm")
        warming.set()
        return warm(self)

    def ready_after(self):
        warming.wait(5)
        out = ready(self)
        order.append("ready")
        return out

    monkeypatch.setattr(selfcheck.SelfCheck, "warm", warm_first)
    monkeypatch.setattr(sg.Server, "wait_ready", ready_after)
    regen = ["data.regenerate.turns=last", "data.regenerate.max_new_tokens=16", "data.max_length=4096"]
    regen = regen if regenerate else []
    assert run(sg_cfg(tmp_path, "data.limit=4", "client.self_check=2", *regen))["ok"] == 4
    assert order[:2] == ["warm", "ready"], order


@pytest.mark.parametrize(
    "mode, why",
    [("prenorm_final", "not the post-norm final state lm_head reads"),
     ("shifted_final", "each row holds the final state of the token before it")],
)  # fmt: skip
def test_a_wrong_final_slot_refuses_the_run_naming_the_slot(tmp_path, monkeypatch, mode, why):
    """What a model the seam misreads would dump: the run stops at the first judged sample, in one line."""
    monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
    with pytest.raises(SelfCheckFailed, match=f"^self-check failed: the final slot of sample .*{why}"):
        run(sg_cfg(tmp_path, "data.limit=12"))


def test_retries_after_500(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "flaky500")
    counts = run(sg_cfg(tmp_path, "data.limit=6"))
    assert counts["ok"] == 6 and not counts["failed"]
    assert verify(tmp_path / "out") == []


def test_prefix_cache_hit_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "cached")
    with pytest.raises(RunFailed):
        run(sg_cfg(tmp_path, "data.limit=3"))
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["counts"]["failed"] == {"prefix_cache_hit": 3}


def test_the_run_ends_without_waiting_on_the_servers_drain_and_after_the_server(tmp_path, monkeypatch):
    """Every sample durable and the manifest written while the server stops, and the run returns
    only once it is gone. By default that is at once: every dump is on the RAM disk by then, so the
    server is killed rather than given SGLang's drain of seconds (the fake's: 3 s). Given a grace
    (server.stop_grace_s), the drain runs beside the manifest and the run still outlives it."""
    monkeypatch.setenv("FAKE_SGLANG_MODE", "slow_exit")
    monkeypatch.setenv("FAKE_SGLANG_EXITED", str(tmp_path / "exited"))
    counts = run(sg_cfg(tmp_path / "a", "data.limit=4"))
    returned = time.time()
    assert counts["ok"] == 4
    assert returned - (tmp_path / "a" / "out" / "manifest.json").stat().st_mtime < 1.5
    assert not (tmp_path / "exited").exists()  # killed, not drained

    counts = run(sg_cfg(tmp_path / "b", "data.limit=4", "server.stop_grace_s=10"))
    returned = time.time()
    assert counts["ok"] == 4
    exited = float((tmp_path / "exited").read_text())
    manifest = (tmp_path / "b" / "out" / "manifest.json").stat().st_mtime
    assert manifest < exited - 2  # written while the server was still draining
    assert exited <= returned


def test_server_death_restarts_and_resends(tmp_path, monkeypatch):
    """The dead server leaves a claim on the whole dump budget: the restart clears it, or the new
    server's writers would wait on it forever, and its samples fail at the dump timeout (set short
    here). The watchdog is loose (90 s of missed probes), so the one death is the one restart."""
    monkeypatch.setenv("FAKE_SGLANG_MODE", "die_once")
    monkeypatch.setenv("FAKE_SGLANG_MARKER", str(tmp_path / "died"))
    watchdog = ["server.health_every_s=1", "server.health_timeout_s=30", "server.health_misses=3"]
    counts = run(sg_cfg(tmp_path, "data.limit=8", "server.max_restarts=1", "capture.dump_timeout_s=30", *watchdog))
    assert (tmp_path / "died").exists()
    assert counts["ok"] == 8 and not counts["failed"]
    log = (tmp_path / "out" / "logs" / "server.log").read_text()
    assert log.count("===== start") == 2  # the first start, and exactly one restart
    assert verify(tmp_path / "out") == []


def test_server_that_never_starts_fails_fast_with_its_log(tmp_path):
    script = tmp_path / "bad_server.py"
    script.write_text("print('boom: no GPU'); raise SystemExit(3)\n")
    cfg = sg_cfg(tmp_path, f"server.command=[{sys.executable},{script}]")
    from recipe.backends.sglang import ServerError

    with pytest.raises(ServerError, match="boom: no GPU"):
        run(cfg)


def test_a_start_of_many_minutes_still_shows_the_line_before_its_polls(tmp_path, monkeypatch, caplog):
    """On a fresh machine SGLang's last line of its own can be minutes old, under hundreds of our
    readiness polls' access lines: the note shows it, not a poll line cut in half at the window."""
    from recipe.backends.sglang import Server, ServerError

    poll = '[2026-12-02 18:13:37] INFO:     127.0.0.1:37962 - "GET /health HTTP/1.1" 503 Service Unavailable'
    script = (
        "import time; print('Capturing batches', flush=True); "
        f"print('\\n'.join([{poll!r}] * 300), flush=True); time.sleep(30)"  # ~29 KB of polls, 5 minutes' worth
    )
    srv = Server([sys.executable, "-c", script], None, tmp_path / "server.log", f"http://127.0.0.1:{free_port()}", 4)
    monkeypatch.setattr(Server, "NOTE_EVERY_S", 0.5)
    srv.start()
    with caplog.at_level("INFO", logger="recipe.backends.sglang"), pytest.raises(ServerError, match="not ready"):
        srv.wait_ready()
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the server")]
    assert len(notes) >= 2 and notes[-1].endswith("its log: Capturing batches")


def test_the_servers_log_tail_never_starts_with_a_cut_line(tmp_path):
    """The tail is read from a byte window; the window's first line began before it and is dropped
    (a cut access line reads `T /health ... 503` and passes for the server's own)."""
    from recipe.backends.sglang import Server

    srv = Server([sys.executable, "-c", "pass"], None, tmp_path / "server.log", "http://127.0.0.1:1", 4)
    (tmp_path / "server.log").write_text("first whole line\n" + "x" * 10 + ' - "GET /health" 503\nlast line\n')
    assert srv.log_lines(len(' /health" 503\nlast line\n')) == ["last line"]
    assert srv.log_lines()[0] == "first whole line"  # a window over the whole file keeps its first line


def test_a_slow_start_is_reported_with_the_servers_latest_line(tmp_path, monkeypatch, caplog):
    """A start of many minutes (a large checkpoint's weights) says where it is, not only that it waits:
    the server's latest line, a progress bar's last update included, past the access lines of our own
    readiness polls."""
    from recipe.backends.sglang import Server, ServerError

    poll = '[2026-12-02 15:31:52] INFO:     127.0.0.1:54542 - "GET /health HTTP/1.1" 503 Service Unavailable'
    script = (
        "import sys, time; print('importing'); print('Load weight begin', flush=True); "
        f"sys.stdout.write('shards 1/3\\rshards 2/3\\n'); print({poll!r}, flush=True); time.sleep(30)"
    )
    srv = Server([sys.executable, "-c", script], None, tmp_path / "server.log", f"http://127.0.0.1:{free_port()}", 4)
    monkeypatch.setattr(Server, "NOTE_EVERY_S", 0.5)
    srv.start()
    with caplog.at_level("INFO", logger="recipe.backends.sglang"), pytest.raises(ServerError, match="not ready"):
        srv.wait_ready()
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the server")]
    assert len(notes) >= 2 and notes[-1].endswith("its log: shards 2/3")


@pytest.mark.parametrize("mode,reason", [("nan_final", "non_finite"), ("graphs", "no_dump")])
def test_a_systematic_failure_stops_the_run_early_naming_what_was_seen(tmp_path, monkeypatch, mode, reason):
    """The first 16 samples all failing alike stop the run in one line, long before its 40 are sent."""
    from recipe.packer.early import EARLY, SystematicFailure

    monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
    from recipe.backends import sglang as sg

    sent, payload = [], sg.request

    def counted(s, rid, ask=False):
        sent.append(rid)
        return payload(s, rid, ask)

    monkeypatch.setattr(sg, "request", counted)
    cfg = sg_cfg(tmp_path, "data.limit=40", "client.concurrency=2", "capture.dump_timeout_s=1", "client.self_check=0")
    with pytest.raises(SystematicFailure, match=f"the first {EARLY} samples all failed {reason}") as e:
        run(cfg)
    assert "\n" not in str(e.value) and len(sent) < 30
