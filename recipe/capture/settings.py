"""The contract between the recipe and the hook inside the server: one frozen settings object,
carried as the server's environment (the only channel into SGLang's worker processes)."""

from __future__ import annotations

from dataclasses import dataclass

ENV_DIR = "SGLANG_HS_DUMP_DIR"
ENV_LAYERS = "SGLANG_HS_LAYERS"  # "3,31,59": residual stream entering those layers
ENV_FINAL = "SGLANG_HS_FINAL"  # "1": also the final post-norm state
ENV_PREFIX = "SGLANG_HS_RID_PREFIX"
ENV_BUDGET = "SGLANG_HS_BUDGET_BYTES"
ENV_QUEUE = "SGLANG_HS_QUEUE"
ENV_WRITERS = "SGLANG_HS_WRITERS"  # writer threads: one copies ~2 GB/s into /dev/shm, TP=2 emits more
ENV_NO_WRITE = "SGLANG_HS_NO_WRITE"  # benchmark arm: capture and copy, but write nothing
ENV_TRACE = "SGLANG_HS_TRACE"  # a folder: each writing process lists what it wrote (the TP/DP proofs)
ENV_PASS_TOKENS = "SGLANG_HS_PASS_TOKENS"  # most tokens one pass holds (chunked_prefill_size): sizes the pool
ENV_STATS = "SGLANG_HS_STATS"  # a file: the hook's own timings, kept current (benchmarks)
# how many of an attention-TP group's first ranks share the writing (0: all). A server over several
# nodes writes from the packer's node only: the others' /dev/shm is not the one the packer reads
ENV_SHARE = "SGLANG_HS_SHARE_RANKS"


@dataclass(frozen=True)
class HookSettings:
    dump_dir: str
    layers: tuple[int, ...]
    final: bool = True
    rid_prefix: str = "hsx-"
    budget_bytes: int = 8 << 30
    queue_size: int = 4  # passes copied but not yet written
    pass_tokens: int = 0  # most tokens a pass holds: the pinned pool is sized for it at start-up
    writers: int = 2
    share_ranks: int = 0
    write: bool = True  # false: capture and copy, write nothing (a benchmark arm)
    trace_dir: str | None = None
    stats_path: str | None = None

    def to_env(self) -> dict[str, str]:
        """The server's environment that switches the dump on (the recipe's side of the contract)."""
        env = {
            ENV_DIR: str(self.dump_dir),
            ENV_LAYERS: ",".join(str(int(i)) for i in self.layers),
            ENV_FINAL: "1" if self.final else "0",
            ENV_PREFIX: self.rid_prefix,
            ENV_BUDGET: str(int(self.budget_bytes)),
            ENV_QUEUE: str(int(self.queue_size)),
            ENV_PASS_TOKENS: str(max(0, int(self.pass_tokens or 0))),
            ENV_WRITERS: str(max(1, int(self.writers))),
            ENV_SHARE: str(max(0, int(self.share_ranks))),
        }
        if not self.write:
            env[ENV_NO_WRITE] = "1"
        if self.trace_dir:
            env[ENV_TRACE] = str(self.trace_dir)
        if self.stats_path:
            env[ENV_STATS] = str(self.stats_path)
        return env

    @classmethod
    def from_env(cls, env) -> HookSettings | None:
        """The hook's side: None when the dump is off (no ENV_DIR)."""
        if not env.get(ENV_DIR):
            return None
        return cls(
            dump_dir=env[ENV_DIR],
            layers=tuple(int(x) for x in env.get(ENV_LAYERS, "").split(",") if x.strip()),
            final=env.get(ENV_FINAL, "1") == "1",
            rid_prefix=env.get(ENV_PREFIX, "hsx-"),
            budget_bytes=int(env.get(ENV_BUDGET, str(8 << 30))),
            queue_size=int(env.get(ENV_QUEUE, "4")),
            pass_tokens=int(env.get(ENV_PASS_TOKENS, "0") or 0),
            writers=int(env.get(ENV_WRITERS, "2")),
            share_ranks=int(env.get(ENV_SHARE, "0") or 0),
            write=env.get(ENV_NO_WRITE, "0") != "1",
            trace_dir=env.get(ENV_TRACE) or None,
            stats_path=env.get(ENV_STATS) or None,
        )
