"""A BPE tokenizer for the target (--tokenizer bpe), trained here with the `tokenizers` package on the
text the target learns, with the llama3 markers and template. Its token frequencies are as uneven as a
real vocabulary's, so a reduced draft vocabulary (--draft-vocab) has a real choice to make; the byte
tokenizer's 256 ids leave none."""

from __future__ import annotations

TRAIN_BYTES = 24 << 20  # of the held-in files: enough for stable merges, seconds to train


def bpe_tokenizer(files: list[bytes], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from recipe.models import llama
    from recipe.models.common import fast_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=llama.SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts(files), trainer=trainer)
    return fast_tokenizer(tok, llama.SPECIALS, llama.LLAMA3)


def texts(files: list[bytes]):
    total = 0
    for b in files:
        if total > TRAIN_BYTES:
            return
        total += len(b)
        yield b.decode("utf-8", "ignore")
