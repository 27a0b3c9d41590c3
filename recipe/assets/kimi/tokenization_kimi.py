# Remote code for `builtin:tiny-kimi-k2.5`, shaped like Kimi-K2.5's own `tokenization_kimi.py`:
# a slow (Python) tokenizer class named `TikTokenTokenizer`, reached only through `auto_map` in
# tokenizer_config.json, so `AutoTokenizer.from_pretrained` needs `trust_remote_code=True`.
# Byte-level instead of tiktoken (no BPE file to ship): every UTF-8 byte is one token, and the chat
# markers are special tokens with fixed ids after the bytes, as in the real vocabulary.
from transformers import PreTrainedTokenizer

SPECIALS = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|media_pad|>",
]


def _byte_chars():
    # GPT-2's printable stand-ins for bytes, so every token is a visible string
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names: dict = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        self._byte_to_char = _byte_chars()
        self._char_to_byte = {c: b for b, c in self._byte_to_char.items()}
        self._vocab = {self._byte_to_char[b]: b for b in range(256)}
        self._vocab.update({s: 256 + i for i, s in enumerate(SPECIALS)})
        self._ids = {i: t for t, i in self._vocab.items()}
        for key in ("bos_token", "eos_token", "pad_token", "additional_special_tokens", "extra_special_tokens"):
            kwargs.pop(key, None)
        super().__init__(
            bos_token="[BOS]",
            eos_token="[EOS]",
            pad_token="[PAD]",
            extra_special_tokens=SPECIALS[3:],
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def _tokenize(self, text, **kwargs):
        return [self._byte_to_char[b] for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token):
        return self._vocab[token]

    def _convert_id_to_token(self, index):
        return self._ids[index]

    def convert_tokens_to_string(self, tokens):
        out, buf = [], bytearray()
        for t in tokens:
            if t in self._char_to_byte:
                buf.append(self._char_to_byte[t])
            else:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                out.append(t)
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
