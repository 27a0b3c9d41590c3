"""The config schema. Hydra merges conf/ onto it, so a typo'd key or a wrong type fails at compose time."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

CONVENTION = ("residual_in: slot for layer i is the residual stream entering decoder layer i "
              "(= HF output_hidden_states[i], 0 = embeddings); the final slot is the last hidden state "
              "after the model's final norm (= HF output_hidden_states[num_layers])")


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING  # a local model directory, or builtin:<name> (recipe/tiny.py)
    num_layers: int = MISSING
    hidden_size: int = MISSING
    default_layers: List[int] = MISSING  # EAGLE-3 low/mid/high, in the residual_in convention
    dtype: str = "bfloat16"


@dataclass
class BackendConfig:
    name: str = MISSING  # hf | sglang
    device: str = "auto"  # hf: cuda when available
    batch_tokens: int = 16384  # hf: padded tokens per forward
    batch_size: int = 16  # hf: sequences per forward
    attn_implementation: Optional[str] = None  # hf: e.g. eager, sdpa


@dataclass
class ServerConfig:
    command: List[str] = field(default_factory=lambda: ["python3", "-m", "sglang.launch_server"])
    launch: bool = True  # false: use a server already running at host:port (started with the same capture env)
    host: str = "127.0.0.1"
    port: int = 30000
    args: Dict[str, Any] = field(default_factory=dict)  # snake_case keys -> --kebab-case flags
    extra_args: List[str] = field(default_factory=list)  # passed through verbatim
    ready_timeout_s: float = 1200.0  # first start compiles kernels: minutes
    max_restarts: int = 2
    health_every_s: float = 10.0  # watchdog: GET /health this often while requests are in flight
    health_timeout_s: float = 60.0  # a probe slower than this counts as a miss (SGLang probes via its scheduler)
    health_misses: int = 3  # consecutive misses = the server stopped answering: it is killed and restarted
    allow_unsafe_flags: bool = False  # only for the silent-failure test: lets CUDA graphs back on


@dataclass
class NcclConfig:
    name: str = "none"
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class CaptureConfig:
    layers: List[int] = MISSING
    final: bool = True
    convention: str = CONVENTION
    dump_dir: str = MISSING
    budget_gb: float = 8.0
    rid_prefix: str = "hsx-"
    dump_timeout_s: float = 120.0  # after the response: no complete dump by then = failed sample
    writer_queue: int = 4  # sglang hook: passes in flight between the GPU and the writer thread


@dataclass
class DataConfig:
    sources: List[str] = MISSING
    max_length: int = 4096
    overflow: str = "truncate"  # truncate | skip
    limit: Optional[int] = None
    shard_index: int = 0
    num_shards: int = 1
    max_failures: float = 0.01  # invalid records allowed: a count (>= 1), or a fraction (< 1) but at least 10; 0 = none


@dataclass
class ClientConfig:
    concurrency: int = 16
    timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 1.0


@dataclass
class ShardsConfig:
    max_shard_gb: float = 4.0
    zstd_level: int = 1
    transform: str = "byteplane"  # byteplane | none (docs/benchmarks.md says why)
    workers: int = 4  # compression threads in the packer
    commit_every: int = 64


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    data: DataConfig = field(default_factory=DataConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    output_dir: str = MISSING
    log_every_s: float = 10.0
    dry_run: bool = False  # plan + preflight only


def register() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
