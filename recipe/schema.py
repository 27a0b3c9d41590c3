"""The config schema. Hydra merges conf/ onto it, so a typo'd key or a wrong type fails at compose time."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from .errors import UserError

CONVENTION = (
    "residual_in: slot for layer i is the residual stream entering decoder layer i "
    "(= HF output_hidden_states[i], 0 = embeddings); the final slot is the last hidden state "
    "after the model's final norm (= HF output_hidden_states[num_layers])"
)


class Overflow(str, Enum):
    truncate = "truncate"  # keep the first max_length tokens
    skip = "skip"  # count the record as skipped (too_long)


class Turns(str, Enum):
    off = "off"  # capture the conversations as given
    last = "last"  # the target rewrites each record's last assistant turn
    all = "all"  # the target rewrites every assistant turn, turn by turn


class Cut(str, Enum):
    keep = "keep"  # a turn that reaches max_new_tokens is kept as cut, and the conversation ends there
    skip = "skip"  # the record is skipped (regenerate_cut)


@dataclass
class RegenerateConfig:  # recipe/regenerate.py; reasoning on or off: data.chat_template_kwargs
    turns: Turns = Turns.off
    temperature: float = 0.7  # 0: greedy
    top_p: float = 0.95
    max_new_tokens: int = 2048
    seed: int = 0  # each turn's seed comes from it, the record and the turn: the same on a resume
    cut: Cut = Cut.keep
    # turns written at once through a server, which batches their decode passes (a decode pass costs about
    # the same at 16 sequences as at 256); the HF backend writes one at a time. Not in the identity
    concurrency: int = 256


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING  # a local model directory, or builtin:<name> (recipe/models/)
    num_layers: Optional[int] = None  # null: read from the checkpoint's config.json (text_config if nested)
    hidden_size: Optional[int] = None  # null: likewise; a value given here is checked against config.json
    trust_remote_code: bool = False  # the tokenizer's own code from the model folder (Kimi's tiktoken class)
    default_layers: List[int] = MISSING  # EAGLE-3 low/mid/high, in the residual_in convention
    dtype: str = "bfloat16"  # the only one the shard format holds (schema.validate refuses others)


class BackendName(str, Enum):
    hf = "hf"  # transformers in-process (recipe/backends/hf.py)
    sglang = "sglang"  # the patched SGLang server (recipe/backends/sglang.py)


# One schema per backend (conf/backend/<name>.yaml extends it): a key one backend does not read is a
# compose-time error under the other, not a silently ignored setting.
@dataclass
class BackendConfig:
    """What every backend's schema has: its name (the backend/ group's choice)."""

    name: BackendName = MISSING


@dataclass
class HFBackendConfig(BackendConfig):
    name: BackendName = BackendName.hf
    device: str = "auto"  # cuda when available
    batch_tokens: int = 16384  # padded tokens per forward
    batch_size: int = 16  # sequences per forward
    attn_implementation: Optional[str] = None  # e.g. eager, sdpa


@dataclass
class SGLangBackendConfig(BackendConfig):
    name: BackendName = BackendName.sglang  # its settings are the server/ and client/ groups


@dataclass
class ServerConfig:
    command: List[str] = field(default_factory=lambda: ["python3", "-m", "sglang.launch_server"])
    # false: talk to a server already running at host:port (multi-node, tests), started with the same capture env
    launch: bool = True
    host: str = "127.0.0.1"
    port: int = 30000
    args: Dict[str, Any] = field(default_factory=dict)  # snake_case keys -> --kebab-case flags
    extra_args: List[str] = field(default_factory=list)  # passed through verbatim
    ready_timeout_s: float = 1200.0  # a fresh machine compiles kernels before /health answers 200: minutes
    # At the end every dump is on the RAM disk: the server holds nothing. SGLang's own drain after
    # SIGTERM takes 5-8 s (its watchdog polls every 5 s) for nothing, so SIGKILL follows this soon.
    stop_grace_s: float = 0.0
    max_restarts: int = 2  # server deaths tolerated; unfinished requests are re-sent
    health_every_s: float = 10.0  # watchdog: GET /health this often while requests are in flight
    health_timeout_s: float = 60.0  # a probe slower than this counts as a miss (SGLang probes via its scheduler)
    health_misses: int = 3  # consecutive misses = the server stopped answering: it is killed and restarted
    allow_unsafe_flags: bool = False  # true lets the enforced flags change (only the silent-failure test does)


@dataclass
class NcclConfig:
    name: str = "none"
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class CaptureConfig:
    layers: List[int] = MISSING  # residual stream ENTERING layer i (= HF hidden_states[i]); ascending
    final: bool = True  # also the last hidden state after the final norm
    spread: int = 0  # > 0: that many layers spread over the depth as DFlash picks them (recipe/capture/presets.py)
    convention: str = CONVENTION
    dump_dir: str = MISSING  # a RAM disk; each run works in its own subfolder and removes it
    budget_gb: float = 8.0  # raw dumps held at most; producers wait beyond it
    rid_prefix: str = "hsx-"  # only requests with this rid prefix are dumped (no warm-up/health)
    dump_timeout_s: float = 120.0  # answered but no complete dump after this = failed sample
    # sglang hook: passes between the GPU and the writer threads before the GPU waits (queue + threads
    # + 1 pinned buffers of a rank's share of a pass each)
    writer_queue: int = 4
    writer_threads: int = 2  # sglang hook, per TP rank: one copies ~2 GB/s into /dev/shm


@dataclass
class DataConfig:
    sources: List[str] = MISSING
    split: str = "train"  # the split read from a saved HF DatasetDict (the others are named in the log)
    max_length: int = 4096
    overflow: Overflow = Overflow.truncate
    limit: Optional[int] = None
    shard_index: int = 0
    num_shards: int = 1
    max_failures: float = 0.01  # invalid records allowed: a count (>= 1), or a fraction (< 1) but at least 10; 0 = none
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)  # e.g. {thinking: false} (Kimi instant)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)  # off unless turns: last or all


@dataclass
class ClientConfig:
    concurrency: int = 16  # requests in flight
    timeout_s: float = 600.0  # one request
    retries: int = 3  # per request, with exponential backoff from backoff_s
    backoff_s: float = 1.0
    # sglang: the run's first N samples ask for their prompt logprobs, and the stored final slot through
    # the checkpoint's own lm_head must give them, or the run is refused (recipe/selfcheck.py); 0: off
    self_check: int = 4
    # the host cores its matmul over lm_head may take (0: every one): it judges while the server
    # prefills, and the server's scheduler launches each kernel from a core of the same host
    self_check_threads: int = 2


@dataclass
class ShardsConfig:
    # lossless: bf16 as computed (1.45x smaller with byte planes + zstd); fp8: e4m3 with a float32 scale
    # per token and slot, half the bytes before zstd, dequantized to bf16 by every reader (docs/FORMAT.md)
    codec: str = "lossless"
    max_shard_gb: float = 4.0  # each packer process rolls over to a new shard file past this
    entropy_only: bool = True  # zstd tuned for bf16 byte planes (recipe/shards/codec.py); false: zstd_level
    zstd_level: int = 1  # used when entropy_only=false; on real activations L1 beats L3 in ratio and speed
    # packer processes (assemble, validate, encode, append). One packs 0.69-0.80 GB/s of raw bf16 lossless,
    # 0.41-0.47 fp8, on an H100 host's Xeon: eight keep an 8-GPU node's ~2 GB/s with either codec (four
    # pack 1.59 GB/s fp8), and a run's last samples, which the server answers together, pack side by
    # side. Idle processes cost nothing (docs/benchmarks.md, Packer)
    workers: int = 8
    commit_every: int = 64  # samples between fsyncs of the shards + the index
    deep_check: bool = False  # a resume also checks every stored record's crc32 (reads the whole set)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendConfig = MISSING  # HFBackendConfig or SGLangBackendConfig: the backend/ group's choice
    server: ServerConfig = field(default_factory=ServerConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    data: DataConfig = field(default_factory=DataConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    output_dir: str = MISSING
    log_every_s: float = 10.0
    dry_run: bool = False  # plan + preflight only


class ConfigError(UserError, ValueError):
    pass


def unknown_keys(node, schema_cls, prefix: str = "") -> list[str]:
    """Keys the schema does not declare. A `+key=value` override adds any key, typos included (it is
    Hydra's own hint after a typo), and would otherwise be silently ignored."""
    declared = {f.name: f.type for f in fields(schema_cls)}
    out = []
    for key in node:
        if key not in declared:
            out.append(prefix + str(key))
            continue
        # a section's own schema, as composition typed it (the backend node: the chosen backend's)
        sub = OmegaConf.get_type(node[key]) if OmegaConf.is_config(node[key]) else None
        if sub is not None and is_dataclass(sub):
            out += unknown_keys(node[key], sub, f"{prefix}{key}.")
    return out


def validate(cfg) -> None:
    """What types cannot say: unknown keys, ranges, relations. Runs first, before any work."""
    unknown = unknown_keys(cfg, Config)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(unknown)}: a typo? `python -m recipe --cfg job` prints every key"
        )
    d, s, c, cl, srv = cfg.data, cfg.shards, cfg.capture, cfg.client, cfg.server
    rg = d.regenerate
    checks = [
        (d.max_length >= 1, f"data.max_length={d.max_length} must be >= 1"),
        (d.limit is None or d.limit >= 1, f"data.limit={d.limit} must be >= 1 (or null for all)"),
        (d.max_failures >= 0, f"data.max_failures={d.max_failures} must be >= 0"),
        (d.num_shards >= 1, f"data.num_shards={d.num_shards} must be >= 1"),
        (
            0 <= d.shard_index < max(d.num_shards, 1),
            f"data.shard_index={d.shard_index} not in [0, data.num_shards={d.num_shards})",
        ),
        (
            -7 <= s.zstd_level <= 22 and s.zstd_level != 0,
            f"shards.zstd_level={s.zstd_level}: zstd levels are -7..-1, 1..22",
        ),
        (s.codec in ("lossless", "fp8"), f"shards.codec={s.codec}: lossless or fp8"),
        (s.workers >= 1, f"shards.workers={s.workers} must be >= 1"),
        (s.commit_every >= 1, f"shards.commit_every={s.commit_every} must be >= 1"),
        (s.max_shard_gb > 0, f"shards.max_shard_gb={s.max_shard_gb} must be > 0"),
        (rg.temperature >= 0, f"data.regenerate.temperature={rg.temperature} must be >= 0 (0: greedy)"),
        (0 < rg.top_p <= 1, f"data.regenerate.top_p={rg.top_p} must be in (0, 1]"),
        (rg.max_new_tokens >= 1, f"data.regenerate.max_new_tokens={rg.max_new_tokens} must be >= 1"),
        (rg.concurrency >= 1, f"data.regenerate.concurrency={rg.concurrency} must be >= 1"),
        (c.budget_gb > 0, f"capture.budget_gb={c.budget_gb} must be > 0"),
        (c.spread >= 0, f"capture.spread={c.spread} must be >= 0 (0: capture.layers as given)"),
        (c.dump_timeout_s > 0, f"capture.dump_timeout_s={c.dump_timeout_s} must be > 0"),
        (c.writer_queue >= 1, f"capture.writer_queue={c.writer_queue} must be >= 1"),
        (c.writer_threads >= 1, f"capture.writer_threads={c.writer_threads} must be >= 1"),
        (cl.concurrency >= 1, f"client.concurrency={cl.concurrency} must be >= 1"),
        (cl.retries >= 0, f"client.retries={cl.retries} must be >= 0"),
        (cl.timeout_s > 0, f"client.timeout_s={cl.timeout_s} must be > 0"),
        (cl.self_check >= 0, f"client.self_check={cl.self_check} must be >= 0 (0: off)"),
        (cl.self_check_threads >= 0, f"client.self_check_threads={cl.self_check_threads} must be >= 0 (0: every core)"),
        (1 <= srv.port <= 65535, f"server.port={srv.port} must be in 1..65535"),
        (cfg.log_every_s > 0, f"log_every_s={cfg.log_every_s} must be > 0"),
        (
            cfg.model.dtype == "bfloat16",
            f"model.dtype={cfg.model.dtype}: shards hold bfloat16 activations only (the format and every "
            "reader assume it); leave model.dtype out",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    check_layers(cfg)


def check_layers(cfg, num_layers: int | None = None) -> None:
    """The capture against the model's depth (once it is known: it may come from config.json)."""
    c, layers = cfg.capture, list(cfg.capture.layers)
    n = num_layers if num_layers is not None else cfg.model.num_layers
    if not layers and not c.final and not c.spread:
        raise ConfigError("capture.layers is empty and capture.final is false: nothing to capture")
    if layers != sorted(set(layers)):
        raise ConfigError(f"capture.layers must be ascending and unique, got {layers}")
    if layers and n is not None and (layers[0] < 0 or layers[-1] >= n):
        raise ConfigError(
            f"capture.layers {layers} out of range for {n} layers: index i is the residual stream "
            f"entering layer i, so 0 <= i < {n}; use capture.final for the last state"
        )
    if cfg.backend.name == "sglang" and layers and layers[0] == 0:
        raise ConfigError(
            "backend=sglang cannot capture layer 0 (the embeddings): SGLang adds the residual, "
            "which does not exist yet before layer 0"
        )


BACKENDS = {BackendName.hf: HFBackendConfig, BackendName.sglang: SGLangBackendConfig}


def data_tag(sources) -> str:
    """The data's part of a folder name: its files' names without suffixes (`train.jsonl.gz` -> train)."""
    names = []
    for s in sources or []:
        s = str(s).split(":", 1)[1] if str(s).startswith("builtin:") else str(s)
        name = Path(s.rstrip("/")).name
        names.append(name.split(".")[0] or name)
    return shell_safe("+".join(names))[:80] or "data"


def run_name(*, _root_) -> str:
    """A run's default folder name, from what decides its content: the model, the data, the captured
    slots and the job's share of the data. The same command gives the same folder, so running it again
    resumes; other data or another capture lands in a folder of its own (and the store's identity check
    refuses a set it does not match)."""
    c, d = _root_.capture, _root_.data
    turns = str(getattr(d.regenerate.turns, "value", d.regenerate.turns))
    regen = "" if turns == "off" else f"+regen-{turns}"  # the target's own answers: a folder apart
    name = (
        f"{_root_.model.name}/{data_tag(d.sources)}{regen}/"
        f"layers-{'-'.join(str(i) for i in c.layers) or (f'spread{c.spread}' if c.spread else 'none')}"
        f"{'+final' if c.final else ''}"
        f"{'' if _root_.shards.codec == 'lossless' else '+' + str(_root_.shards.codec)}"  # another codec: its own
    )
    return name + (f"/part-{d.shard_index}-of-{d.num_shards}" if d.num_shards > 1 else "")


def run_dir(*, _root_) -> str:
    """Hydra's folder for this job (a sweep gives each job its own) or, before Hydra has made one
    (`--cfg job --resolve`, the compose API), the folder a plain run would use."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        out = OmegaConf.select(hc, "runtime.output_dir", default=None, throw_on_missing=False)
        return out or hc.run.dir  # before the run starts: the folder it will use
    return f"outputs/{run_name(_root_=_root_)}"


def path_name(path: str) -> str:
    """A model's name from its path: `builtin:tiny-gpt-oss` -> tiny-gpt-oss, `/models/Qwen3-8B` -> Qwen3-8B."""
    path = str(path)
    return shell_safe(path.split(":", 1)[1] if path.startswith("builtin:") else Path(path.rstrip("/")).name)


def shell_safe(text: str) -> str:
    """A sweep folder name any shell takes unquoted: `capture.layers=[1,2]` -> `capture.layers=1-2`."""
    import re

    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text.replace("[", "").replace("]", "").replace(",", "-"))


def register() -> None:
    resolvers = (("hs.run_name", run_name), ("hs.run_dir", run_dir), ("hs.shell_safe", shell_safe),
                 ("hs.path_name", path_name))  # fmt: skip
    for name, fn in resolvers:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for name, node in BACKENDS.items():  # outside any group: --help lists groups' options only
        cs.store(name=f"backend_{name.value}_schema", node=node)
