"""SGLang backend: start the patched server, send every prompt, let its hook dump during prefill.

The server writes raw records into the dump dir through recipe.capture.sglang_hook; this process
runs the client and the packer. Nothing here imports sglang: it only launches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from ..capture import records
from ..capture.settings import HookSettings
from ..errors import UserError
from ..procs import die_with_parent
from ..schema import ConfigError
from ..selfcheck import SelfCheck, SelfCheckFailed, judge_as_stored, judge_the_rest
from . import sglang_generate

log = logging.getLogger(__name__)
# httpx logs one INFO line per request: thousands per run, drowning the run's progress lines in its log
logging.getLogger("httpx").setLevel(logging.WARNING)

# Flags the dump depends on. Python in the forward pass does not run when a CUDA graph replays, so a
# prefill graph would leave silent holes, and a radix-cache hit leaves the cached prefix uncomputed.
# Decode graphs may stay on: the dump acts on EXTEND passes only, and with them on every sample was still
# stored right (the seam's GPU proof, cuda_graphs_on); off by default, on for data.regenerate.
FORCED = {
    "cuda_graph_backend_prefill": "disabled",
    "disable_radix_cache": True,
}


class ServerError(UserError, RuntimeError):
    pass


def to_flags(args: dict) -> list[str]:
    """{snake_case: value} -> ['--kebab-case', 'value']; True -> bare flag; None/False -> omitted."""
    out = []
    for k, v in args.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        elif isinstance(v, dict):
            import json

            out += [flag, json.dumps(v)]
        else:
            out += [flag, str(v)]
    return out


def check_flags(args: dict, extra: list[str], allow_unsafe: bool) -> None:
    bad = [f"{k}={args.get(k)!r} (needs {v!r})" for k, v in FORCED.items() if args.get(k) != v]
    forced_flags = {"--" + k.replace("_", "-") for k in FORCED} | {"--cuda-graph-config", "--enable-cuda-graph"}
    bad += [f"extra_args sets {a}" for a in extra if a.split("=")[0] in forced_flags]
    if bad and not allow_unsafe:
        raise ConfigError(
            "server flags the hidden-state dump depends on were changed: "
            + "; ".join(bad)
            + ". CUDA graphs skip the Python hook (silent holes) and the radix cache skips cached "
            "tokens. Only the silent-failure test sets server.allow_unsafe_flags=true."
        )
    if int(args.get("pp_size") or 1) > 1:
        raise ConfigError("server.args.pp_size > 1 is not supported by the dump hook")
    if args.get("enable_dp_attention") and int(args.get("nnodes") or 1) > 1:
        raise ConfigError(
            "server.args.enable_dp_attention over several nodes is not supported by the dump hook: the DP "
            "groups on the other nodes would write into their own /dev/shm, which the packer never reads"
        )


def server_argv(server, model_dir: Path) -> list[str]:
    """The launch command from the `server` config node."""
    args = dict(server.args)  # a schema object's dict, or a config node's (resolved on access)
    extra = list(server.extra_args)
    check_flags(args, extra, server.allow_unsafe_flags)
    return [
        *server.command,
        "--model-path",
        str(model_dir),
        "--host",
        server.host,
        "--port",
        str(server.port),
        *to_flags(args),
        *extra,
    ]


def _pass_tokens(args) -> int:
    """The most tokens one forward pass holds (chunked prefill bounds a batch's new tokens): sizes
    the hook's pinned buffers up front. 0 when unbounded here (the hook then grows them)."""
    chunk = int(args.get("chunked_prefill_size") or 0)
    return chunk if chunk > 0 else int(args.get("max_prefill_tokens") or 0)


def _ranks_here(args) -> int:
    """The TP ranks on the recipe's node when the server spans several (the first tp/nnodes: SGLang
    numbers ranks node by node); 0 on one node: every rank of an attention-TP group writes its share."""
    nnodes = int(args.get("nnodes") or 1)
    return int(args.get("tp_size") or 1) // nnodes if nnodes > 1 else 0


def server_env(nccl, capture, dump_dir: Path, base=None, server=None) -> dict:
    """The server's environment: the `nccl` node's variables and the hook's switches from `capture`
    (and from `server.args`, the most tokens a pass holds)."""
    env = dict(os.environ if base is None else base)
    env.update({k: str(v) for k, v in dict(nccl.env).items()})
    hook = HookSettings(
        dump_dir=str(dump_dir),
        layers=tuple(capture.layers),
        final=capture.final,
        rid_prefix=capture.rid_prefix,
        budget_bytes=int(capture.budget_gb * (1 << 30)),
        queue_size=capture.writer_queue,
        pass_tokens=_pass_tokens(server.args) if server is not None else 0,
        writers=capture.writer_threads,
        share_ranks=_ranks_here(server.args) if server is not None else 0,
    )
    env.update(hook.to_env())
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def proc_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid, a process's identity."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


class Server:
    """One server process tree: started in its own session so stop() ends all its workers, tied to
    the recipe's life (parent-death signal), and recorded in `pid_file` so that a resume after a
    kill -9 stops any worker that outlived it before starting its own."""

    NOTE_EVERY_S = 30.0  # while waiting for /health, a line this often with the server's latest

    def __init__(self, argv, env, log_path: Path, url: str, ready_timeout_s: float, pid_file: Path | None = None):
        self.argv, self.env, self.log_path, self.url, self.ready_timeout_s = (
            argv,
            env,
            Path(log_path),
            url,
            ready_timeout_s,
        )
        self.pid_file = pid_file
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.reap_leftover()
        host, port = urlsplit(self.url).hostname, urlsplit(self.url).port
        if port_in_use(host, port):
            raise ServerError(
                f"{host}:{port} is already in use by a server this run did not start: stop it, pick "
                "another server.port=..., or set server.launch=false to use it on purpose"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        logf = open(self.log_path, "ab")
        logf.write(f"\n===== start {self.starts}: {' '.join(self.argv)}\n".encode())
        logf.flush()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )
        logf.close()
        if self.pid_file is not None:
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            self.pid_file.write_text(json.dumps({"pid": self.proc.pid, "start": proc_start_time(self.proc.pid)}))
        log.info("server started (pid %d), log: %s", self.proc.pid, self.log_path)

    def reap_leftover(self) -> None:
        """A server an earlier, killed run launched for this output directory: its session is
        killed (the process itself, if still the same one, and every worker it left)."""
        if self.pid_file is None or not self.pid_file.exists():
            return
        try:
            rec = json.loads(self.pid_file.read_text())
        except (OSError, ValueError):
            rec = {}
        pid = rec.get("pid")
        if pid and proc_start_time(pid) == rec.get("start"):  # the same process, not a reused pid
            log.warning("stopping server pid %d left running by an earlier run of this output directory", pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            subprocess.run(["pkill", "-KILL", "-s", str(pid)], check=False, capture_output=True)
        self.pid_file.unlink(missing_ok=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self) -> float:
        """Until GET /health answers 200 (503 while SGLang warms up). Fails fast if the process exits."""
        t0 = time.monotonic()
        last = time.monotonic()
        while True:
            if self.proc is not None and not self.alive():  # proc None: a server started elsewhere
                raise ServerError(
                    f"server exited with code {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    took = time.monotonic() - t0
                    log.info("server ready after %.0f s", took)
                    return took
            except httpx.HTTPError:
                pass
            waited = time.monotonic() - t0
            if waited > self.ready_timeout_s:
                self.stop()
                raise ServerError(f"server not ready after {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")
            if time.monotonic() - last > self.NOTE_EVERY_S:
                log.info(
                    "waiting for the server (%.0f s; a fresh machine's first start compiles kernels); its log: %s",
                    waited,
                    self.last_log_line() or "(nothing yet)",
                )
                last = time.monotonic()
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # children that left the group (rare) are still in the session: make sure none survives
        subprocess.run(["pkill", "-KILL", "-s", str(self.proc.pid)], check=False, capture_output=True)
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)
        log.info("server stopped")

    def stop_in_background(self, grace_s: float = 30.0) -> threading.Thread:
        """stop() in a thread of its own, beside the last commit and the manifest. Joining it is
        bounded (grace_s, then SIGKILL)."""
        t = threading.Thread(target=self.stop, kwargs={"grace_s": grace_s}, name="server-stop")
        t.start()
        return t

    def log_lines(self, nbytes: int = 1 << 18) -> list[str] | None:
        """The log's last whole lines, from its last `nbytes` (a log of hours is not read whole); a
        progress bar's \\r-separated updates count as lines. None: no log."""
        try:
            with open(self.log_path, "rb") as f:
                start = max(0, f.seek(0, os.SEEK_END) - nbytes)
                f.seek(start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        return lines[1:] if start else lines  # the first began before the window: a cut line says nothing

    def last_log_line(self, limit: int = 160) -> str:
        """The server's latest line: where a start of many minutes is (imports, weights, KV pool, warm-up).
        The access lines of our own readiness polls (`"GET /health ... 503`, one a second) say nothing
        about that; the window (256 KiB) holds 45 minutes of them, past any ready_timeout_s."""
        lines = [x.strip() for x in self.log_lines() or () if x.strip() and '"GET /health' not in x]
        return lines[-1][:limit] if lines else ""

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_lines()
        return "(no server log)" if lines is None else "\n".join(lines[-n:])


def hydra_run_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


class Retry(Exception):
    pass


class SGLangBackend:
    """Reads the `server`, `client`, `capture` and `nccl` config nodes, nothing else. `output_dir`
    holds the record of the server it launched (a resume stops a leftover one); `run_dir` its log."""

    def __init__(
        self, model_dir: Path, dump_dir: Path, output_dir: Path, *, server, client, capture, nccl, run_dir=None
    ):
        self.opts, self.client = server, client
        self.batches_generation = True  # data.regenerate: data.regenerate.concurrency turns written at once
        self.starting, self.started = threading.Lock(), False
        self.dump_dir, self.rid_prefix = dump_dir, capture.rid_prefix  # the hook dumps requests with this prefix
        self.url = f"http://{server.host}:{server.port}"
        run_dir = Path(run_dir or hydra_run_dir() or Path(output_dir) / "logs")
        self.server = Server(
            server_argv(server, model_dir),
            server_env(nccl, capture, dump_dir, server=server),
            run_dir / "server.log",
            self.url,
            server.ready_timeout_s,
            pid_file=Path(output_dir) / ".server.json",
        )
        self.budget = int(capture.budget_gb * (1 << 30))
        self.stopping: threading.Thread | None = None
        self.keeper = Supervisor(self.server, server, self.url, dump_dir)
        self.stats = {"requests": 0, "retries": 0, "budget_wait_s": 0.0}
        # the final slot against the server's own logprobs, on the run's first samples (recipe/selfcheck.py)
        n = client.self_check if capture.final else 0
        self.check = (
            SelfCheck(Path(model_dir), n, len(capture.layers), threads=client.self_check_threads) if n else None
        )
        self.check_failed: SelfCheckFailed | None = None

    @classmethod
    def from_config(cls, model_dir, dump_dir, output_dir, *, server, client, capture, nccl) -> "SGLangBackend":
        return cls(model_dir, dump_dir, output_dir, server=server, client=client, capture=capture, nccl=nccl)

    def run(self, samples, sink, should_stop=lambda: False) -> None:
        if getattr(sink, "store", None) is None:  # a sink that stores nothing has nothing to check
            self.check = None
        self.up()
        sink.progress.start()  # rates count the capture, not the server's start
        asyncio.run(self._send_all(samples, sink, should_stop))

    def up(self) -> None:
        """The server launched and answering, once: regeneration's threads may each ask first. The
        self-check's head is read and widened meanwhile, off the capture's cores (also when regeneration
        starts the server, long before the capture)."""
        with self.starting:
            if not self.started:
                if self.check:
                    threading.Thread(target=self.check.warm, name="self-check-warm", daemon=True).start()
                if self.opts.launch:
                    self.server.start()
                self.server.wait_ready()
                self.started = True

    def generate(self, prompt: list[int], seed: int, regen, stop: int) -> list[int]:
        """One turn the target writes for data.regenerate (sglang_generate.py): dumped by no hook."""
        self.up()
        return sglang_generate.generate(self.url, prompt, seed, regen, stop, self.client)

    def close(self) -> None:
        """Called once every sample is in the packer's hands: the server's own shutdown runs beside
        the last commit and the manifest (`stopping`, joined by the run before it reports its exit)."""
        if self.opts.launch:
            self.stopping = self.server.stop_in_background(grace_s=self.opts.stop_grace_s)

    def __enter__(self) -> "SGLangBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- client --------------------------------------------------------------------------------
    async def _send_all(self, samples, packer, should_stop) -> None:
        c = self.client
        self.keeper.lock = asyncio.Lock()
        sem = asyncio.Semaphore(c.concurrency)
        limits = httpx.Limits(max_connections=c.concurrency, max_keepalive_connections=c.concurrency)
        stop = lambda: should_stop() or self.check_failed is not None  # noqa: E731
        async with httpx.AsyncClient(timeout=c.timeout_s, limits=limits) as http:
            queue = deque(samples)

            async def worker():
                while queue and not stop():
                    await self._send(http, queue.popleft(), packer, sem)

            helpers = [asyncio.create_task(self.keeper.watchdog(http))] if self.opts.launch else []
            helpers += [asyncio.create_task(self._watch(packer))] if self.check else []
            try:
                await asyncio.gather(*(worker() for _ in range(c.concurrency)))
                if self.check and self.check_failed is None:
                    self.check_failed = await judge_the_rest(self.check, packer)
            finally:
                for t in helpers:
                    t.cancel()
        if self.check_failed is not None:
            raise self.check_failed

    async def _send(self, http, s, packer, sem) -> None:
        """One sample's request, within the client's concurrency and the dump budget."""
        async with sem:
            self.stats["budget_wait_s"] += await wait_budget(self.dump_dir, self.budget)
            await self._one(http, s, packer)

    async def _watch(self, packer) -> None:
        self.check_failed = await judge_as_stored(self.check, packer.store)

    async def _one(self, http, s, packer) -> None:
        c = self.client
        base = f"{self.rid_prefix}{s.id}"
        for attempt in range(c.retries + 1):
            rid = base if attempt == 0 else f"{base}-r{attempt}"
            packer.expect(rid, s)
            payload = request(s, rid, ask=attempt == 0 and self.check is not None and self.check.ask(s))
            try:
                self.stats["requests"] += 1
                r = await http.post(self.url + "/generate", json=payload)
                if r.status_code >= 500 or r.status_code == 429:
                    raise Retry(f"http_{r.status_code}: {r.text[:200]}")
                if r.status_code != 200:
                    packer.fail(rid, f"http_{r.status_code}: {r.text[:200]}")
                    return
                meta = r.json().get("meta_info", {})
                if fault := response_fault(meta, s):
                    packer.fail(rid, fault)
                    return
                if payload.get("return_logprob"):
                    self.check.answered(s, meta)
                packer.responded(rid)
                return
            except (httpx.HTTPError, Retry) as e:
                reason = f"{type(e).__name__}: {e}"
                if attempt == c.retries:
                    packer.fail(rid, f"request_failed after {attempt + 1} attempts: {reason}")
                    return
                packer.forget(rid)  # this attempt's partial dump (if any) is dropped, not counted
                self.stats["retries"] += 1
                log.warning("request %s failed (%s); retrying", rid, reason)
                await self.keeper.ensure_up()
                await asyncio.sleep(c.backoff_s * 2**attempt)


async def wait_budget(dump_dir: Path, budget: int) -> float:
    """Back-pressure: no new request while the dump directory holds more than the budget. Returns the wait."""
    t0 = time.monotonic()
    while records.dir_bytes(dump_dir) > budget:
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def response_fault(meta: dict, s) -> str | None:
    """Why an answered request still cannot be stored: tokens the server did not compute, or other ids."""
    if meta.get("cached_tokens", 0):
        return f"prefix_cache_hit ({meta['cached_tokens']} cached tokens were not computed)"
    if meta.get("prompt_tokens") not in (None, len(s.input_ids)):
        return f"prompt_tokens_mismatch ({meta['prompt_tokens']} != {len(s.input_ids)})"
    return None


def request(s, rid: str, ask: bool = False) -> dict:
    """A prefill-only request (max_new_tokens 0: no decode pass). A self-check one also asks for the
    prompt's logprobs, which SGLang computes on the same extend pass: it goes out and comes back with
    the rest (asking for a generated token instead, it waited for a decode pass, which SGLang runs only
    when no prefill is pending)."""
    body = {"input_ids": [int(x) for x in s.input_ids], "rid": rid,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}  # fmt: skip
    if ask:
        body.update(return_logprob=True, logprob_start_len=0)
    return body


class Supervisor:
    """Keeps a launched server up while requests are in flight: one that stops answering /health
    (alive but hung) is killed, a dead one restarted (up to server.max_restarts) with the dead ranks'
    claims on the dump budget cleared. In-flight requests then fail and are re-sent, as after a crash."""

    def __init__(self, server: Server, opts, url: str, dump_dir: Path):
        self.server, self.opts, self.url, self.dump_dir = server, opts, url, dump_dir
        self.restarts = 0
        self.lock: asyncio.Lock | None = None  # made in the client's event loop

    async def watchdog(self, http) -> None:
        """A server that stops answering (alive but hung) is killed; in-flight requests then fail and
        are re-sent after the restart, like after a crash."""
        s, misses = self.opts, 0
        while True:
            await asyncio.sleep(s.health_every_s)
            if not self.server.alive() or self.lock.locked():
                misses = 0  # dead: the requests' retry path restarts it; restarting: still warming up
                continue
            try:
                ok = (await http.get(self.url + "/health", timeout=s.health_timeout_s)).status_code == 200
            except httpx.HTTPError:
                ok = False
            misses = 0 if ok else misses + 1
            if misses >= s.health_misses:
                log.error(
                    "server did not answer /health %d times in a row: killing it for a restart\n%s",
                    misses,
                    self.server.log_tail(20),
                )
                self.server.stop(grace_s=5)
                misses = 0

    async def ensure_up(self) -> None:
        """A dead server is restarted (up to server.max_restarts); past that the run stops."""
        async with self.lock:
            if not self.opts.launch or self.server.alive():
                return
            if self.restarts >= self.opts.max_restarts:
                raise ServerError(
                    f"server died {self.restarts + 1} times (server.max_restarts="
                    f"{self.opts.max_restarts}):\n{self.server.log_tail()}"
                )
            self.restarts += 1
            log.error(
                "server died (exit %s); restart %d/%d\n%s",
                self.server.proc.returncode,
                self.restarts,
                self.opts.max_restarts,
                self.server.log_tail(20),
            )
            self.server.stop()
            records.clear_reservations(self.dump_dir)  # the dead ranks' claims on the dump budget
            self.server.start()
            await asyncio.to_thread(self.server.wait_ready)
