"""The text the target learns (the host's Python sources) and its chat form on the byte tokenizer."""

from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path

from .common import REPLY_BYTES, USER_BYTES


def corpus(limit_bytes: int = 96 << 20) -> tuple[list[bytes], list[bytes]]:
    """The host's Python sources, split by file: 1 in 20 files held out (by a hash of its path)."""
    paths = sysconfig.get_paths()
    roots = sorted({Path(paths["stdlib"]), Path(paths["purelib"])})
    held_in, held_out, total = [], [], 0
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            try:
                b = p.read_bytes()
            except OSError:
                continue
            if len(b) < 2 * (USER_BYTES[1] + REPLY_BYTES) or total > limit_bytes:
                continue
            total += len(b)
            rel = str(p.relative_to(root)).encode()
            (held_out if hashlib.sha1(rel).digest()[0] % 20 == 0 else held_in).append(b)
    return held_in, held_out


def clean(b: bytes) -> bytes:
    return b.decode("utf-8", "ignore").strip().encode()  # whole characters; the template trims


def window(files: list[bytes], rng: random.Random) -> tuple[bytes, bytes]:
    f = files[rng.randrange(len(files))]
    u = rng.randint(*USER_BYTES)
    at = rng.randrange(len(f) - u - REPLY_BYTES)
    return clean(f[at : at + u]), clean(f[at + u : at + u + REPLY_BYTES])


# Every conversation opens with this system turn. SpecForge's llama3 template adds a 400-byte system
# prompt of its own to a conversation without one (bench/draft_peer.py gives it these conversations),
# and its offline extraction reads only `conversations`, so preformatted text is no way around it.
SYSTEM = b"You are a careful Python programmer."


class Chat:
    """Token ids of the llama3 template (recipe.models.llama.LLAMA3) on the byte tokenizer: byte b is id b;
    with the SYSTEM turn first."""

    def __init__(self, tok):
        ids = tok.convert_tokens_to_ids
        self.bos, self.sh, self.eh, self.eot = (
            ids(s) for s in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        )
        self.pad = tok.pad_token_id

    def turn(self, role: str, content: bytes) -> list[int]:
        return [self.sh, *role.encode(), self.eh, *b"\n\n", *content, self.eot]

    def prompt(self, user: bytes) -> list[int]:
        head = [self.bos, *self.turn("system", SYSTEM), *self.turn("user", user)]
        return [*head, self.sh, *b"assistant", self.eh, *b"\n\n"]

    def conversation(self, user: bytes, reply: bytes) -> list[int]:
        return [*self.prompt(user), *reply, self.eot]

    def longest(self) -> int:
        """Tokens in the longest conversation window() makes."""
        return len(self.conversation(b" " * USER_BYTES[1], b" " * REPLY_BYTES))


def reply_text(output_ids: list[int]) -> str:
    return bytes(i for i in output_ids if i < 256).decode("utf-8", "ignore").strip()
