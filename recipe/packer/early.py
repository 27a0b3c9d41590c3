"""A systematic failure stops the run early: when the first EARLY samples to settle all failed for one
reason, nothing the rest of the run does will differ (a server that returns NaN states for this
architecture, CUDA graphs replaying past the hook, a server that rejects every request). The run
stops at once with one line that says what was seen, instead of spending the whole GPU time first."""

from __future__ import annotations

import threading

from ..errors import UserError

EARLY = 16  # samples settled (stored or failed) before the verdict

# what each failure reason means when every sample has it, and what to do
MEANING = {
    "non_finite": (
        "the states the server computed are NaN or infinite. Plain SGLang returns the same non-finite final "
        "states for some checkpoint shapes while its logits stay finite (a tiny Qwen3-MoE seen so): that is "
        "SGLang's implementation of this architecture at this shape, not the dump"
    ),
    "no_dump": (
        "the server answered but wrote no hidden states: its forward pass does not run the patch (CUDA graphs "
        "replaying it, server.allow_unsafe_flags, or an unpatched SGLang: python -m recipe.patch check)"
    ),
    "incomplete_dump": "the server wrote part of each sample's states only: chunked prefill pieces went missing",
    "request_failed": "the server answered no request: see the server's log beside the output",
    "prompt_tokens_mismatch": "the server tokenized the prompts again: it must take the ids as sent",
    "prefix_cache_hit": "the server reused cached prefixes, whose states it never computes: --disable-radix-cache",
}


class SystematicFailure(UserError, RuntimeError):
    pass


class EarlyStop:
    """Watches the first EARLY settled samples; `verdict` is set once they all failed for one reason."""

    def __init__(self, n: int = EARLY):
        self.n, self.first, self.verdict = n, [], None
        self.lock = threading.Lock()

    def settled(self, reason: str | None, example: str = "") -> None:
        """One more sample settled: stored (None) or failed for `reason` (its key, e.g. non_finite)."""
        if len(self.first) >= self.n:  # past the first EARLY: the packer's loop takes no lock for it
            return
        with self.lock:
            if len(self.first) >= self.n:
                return
            self.first.append(reason)
            if len(self.first) == self.n and reason is not None and set(self.first) == {reason}:
                self.verdict = SystematicFailure(message(reason, self.n, example))


def message(reason: str, n: int, example: str) -> str:
    key = reason.split("_")[0] if reason.startswith("http_") else reason
    meaning = MEANING.get(key, "the same failure every time: it is not in the data")
    seen = f" (e.g. {example})" if example else ""
    return f"stopped early: the first {n} samples all failed {reason}{seen}: {meaning}"
