# Remote code for `builtin:tiny-kimi-k2.5`: the part of Kimi-K2.5's processor that SGLang 0.5.16 reads
# when it starts a multimodal model (even with --skip-tokenizer-init): the tokenizer, and the media
# settings in preprocessor_config.json. The recipe sends text only, so images are refused here.
import json
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer


class KimiK25Processor:
    def __init__(self, tokenizer, media_proc_cfg: dict):
        self.tokenizer = tokenizer
        self.media_processor = SimpleNamespace(media_proc_cfg=media_proc_cfg)
        self.image_processor = self.media_processor

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):  # AutoProcessor calls it on remote code
        pass

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        cfg = json.loads((Path(path) / "preprocessor_config.json").read_text())["media_proc_cfg"]
        return cls(AutoTokenizer.from_pretrained(path, trust_remote_code=True), cfg)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("tiny-kimi-k2.5 has no image pipeline: the recipe sends token ids only")
