"""The text the target learns (the host's Python sources) and its chat form on the byte tokenizer."""

from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path

from recipe.models.common import padded

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


def styled(reply: bytes) -> bytes:
    """The target's own style (--regen), unlike the data's original answers, as a chat model's house style
    differs from the answers another model wrote: indentation in tabs, strings in single quotes."""
    out = []
    for line in reply.split(b"\n"):
        body = line.lstrip(b" ")
        n = len(line) - len(body)
        out.append(b"\t" * (n // 4) + b" " * (n % 4) + body)
    return b"\n".join(out).replace(b'"', b"'")


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
    """Token ids of the llama3 template (recipe.models.llama.LLAMA3) on the target's tokenizer (the byte
    one, or a BPE one trained here: tokenizer.py), with the SYSTEM turn first: the text as the template
    renders it, encoded whole, as the recipe tokenizes a conversation."""

    def __init__(self, tok):
        ids = tok.convert_tokens_to_ids
        self.tok = tok
        self.bos, self.sh, self.eh, self.eot = (
            ids(s) for s in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        )
        self.pad = tok.pad_token_id
        self.vocab = padded(len(tok))
        msgs = [{"role": "system", "content": SYSTEM.decode()}, {"role": "user", "content": "u"}]
        rendered = tok.apply_chat_template([*msgs, {"role": "assistant", "content": "r"}], tokenize=False)
        assert rendered == self.text("u", "r"), "the tokenizer's chat template is not llama3's"

    @staticmethod
    def text(user: str, reply: str | None = None) -> str:
        """The template's text: the generation prompt, or (given a reply) the whole conversation."""
        turn = "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>"
        head = "<|begin_of_text|>" + turn.format("system", SYSTEM.decode()) + turn.format("user", user.strip())
        head += "<|start_header_id|>assistant<|end_header_id|>\n\n"
        return head if reply is None else f"{head}{reply.strip()}<|eot_id|>"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def prompt(self, user: bytes) -> list[int]:
        return self.encode([self.text(user.decode())])[0]

    def conversations(self, pairs: list[tuple[bytes, bytes]]) -> list[list[int]]:
        return self.encode([self.text(u.decode(), r.decode()) for u, r in pairs])

    def reply_text(self, output_ids: list[int]) -> str:
        """A generated reply as text: its markers dropped, bytes that form no character left out."""
        return self.tok.decode(output_ids, skip_special_tokens=True).replace("\ufffd", "").strip()
