"""Side by side with SpecForge's own offline extraction, on the same GPU, target and prompts: speed, disk,
memory, and whether both write the same data.

    python bench/peers.py --out peers.json          # GPU host: bash tests/gpu/device.sh peers

Arms, each timed from its command's start:
  recipe     `python -m recipe backend=sglang model=llama-3.1-8b ...` at its defaults (bench/product.py's arm):
             from "server ready" to the manifest written (every sample fsynced), then to the exit
  specforge  SpecForge 0.2.0's `scripts/prepare_hidden_states.py` as its docs run it (torchrun, one
             process, its defaults: batch 32, in-process SGLang 0.5.14, one torch.save file per sample),
             on its pinned SGLang staged by tests/gpu/stage-peer.sh; "ready" is its line after the model
             is built; durable is after an os.sync() of what it wrote (it does not fsync)
Both use the triton attention backend (SGLang's Hopper default, fa3, is not in the slim kernel wheels) and
the same EAGLE-3 layers: ours [2, 16, 29] = residual streams entering those layers = SpecForge's default
[1, 15, 28] for 32 layers (outputs of those layers).

The target: Llama-3.1-8B's shape with init-scale random weights and the built-in byte-level tokenizer with
the Llama-3 template (bench/product.py). Data: chat records cut from the standard library's sources, each
with a system turn (SpecForge's llama3 template adds its own system prompt to records that lack one).

Same data, for every sample: token ids; loss mask (each difference listed with its token); each aux slot
and the final state, ours against SpecForge's first T rows (it pads each batch of 32 to its longest sample
and stores the padding): relative L2 distance and the share of bit-equal values. Two yardsticks: 2^-8,
bf16's own relative precision; and bf16's band for this model (bf16_band: 2 x the worst distance between
HF in bf16 and HF in float32 per slot, on --band-samples samples, as tests/gpu bounds fidelity).
Per arm: peak GPU memory (nvidia-smi, over the idle baseline) and peak host RSS (the bench's child
process tree, summed), sampled every 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import draft  # noqa: E402  (its system turn: both benches' conversations open with it)
import prefill  # noqa: E402
import product  # noqa: E402

from recipe.provenance import model_fingerprint  # noqa: E402

PEER_LAYERS = [1, 15, 28]  # SpecForge's EAGLE-3 default for 32 layers (outputs of layers 1, N/2-1, N-4)
OUR_LAYERS = [k + 1 for k in PEER_LAYERS]  # the same residual streams, entering layers 2, 16, 29
SYSTEM = draft.SYSTEM.decode()
BF16_REL = 2.0**-8


class Watch:
    """Peak host RSS of this process's children (recursive, summed) and peak GPU memory over the baseline."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.rss, self.gpu = every_s, 0, 0
        self._stop = threading.Event()

    @staticmethod
    def gpu_used() -> int:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
        ).stdout
        return int(out.split()[0]) << 20 if out.strip() else 0

    def _run(self):
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.every_s):
            rss = 0
            for p in me.children(recursive=True):
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.rss, self.gpu = max(self.rss, rss), max(self.gpu, self.gpu_used() - self.base)

    def __enter__(self):
        self.base = self.gpu_used()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()

    def figures(self) -> dict:
        return {"peak_host_rss_gb": round(self.rss / 1e9, 2), "peak_gpu_gb": round(self.gpu / 1e9, 2)}


def write_data(work: Path, n: int, lo: int, hi: int) -> tuple[Path, Path]:
    """bench/product.py's records with a system turn: ours as `messages`, SpecForge's as `conversations`."""
    plain = work / "plain.jsonl"
    product.make_data(plain, n, lo, hi)
    ours, theirs = work / "data.jsonl", work / "data-specforge.jsonl"
    with open(plain) as f, open(ours, "w") as fo, open(theirs, "w") as ft:
        for line in f:
            msgs = [{"role": "system", "content": SYSTEM}, *json.loads(line)["messages"]]
            fo.write(json.dumps({"messages": msgs}) + "\n")
            ft.write(json.dumps({"conversations": msgs}) + "\n")
    return ours, theirs


def draft_config(work: Path) -> Path:
    """SpecForge's Llama EAGLE-3 draft for the 8B shape (its configs/llama3-8B-eagle3.json's fields)."""
    t = prefill.LLAMA_8B
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "hidden_act",
        "bos_token_id",
        "eos_token_id",
    )
    cfg = {k: t[k] for k in keep}
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=32000,
        target_hidden_size=t["hidden_size"],
        torch_dtype="bfloat16",
        eagle_config={"eagle_aux_hidden_state_layer_ids": PEER_LAYERS, "use_aux_hidden_state": True},
    )
    p = work / "draft-eagle3.json"
    p.write_text(json.dumps(cfg, indent=1))
    return p


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def stamped_lines(p: subprocess.Popen, log_path: Path) -> list[tuple[float, str]]:
    """Every line the process prints, with the time it arrived (tqdm's \\r updates end in one line)."""
    lines = []
    with open(log_path, "w") as log:
        for raw in iter(p.stdout.readline, b""):
            line = raw.decode(errors="replace")
            lines.append((time.time(), line))
            log.write(line)
    return lines


def specforge_command(args, model_dir: Path, data: Path, out: Path) -> list[str]:
    """Its docs' command (torchrun, one process), its defaults but for the attention backend."""
    work = Path(args.work)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", args.specforge_script]
    cmd += ["--target-model-path", str(model_dir), "--data-path", str(data), "--output-path", str(out)]
    cmd += ["--chat-template", "llama3", "--max-length", str(args.max_length), "--tp-size", "1", "--batch-size", "32"]
    cmd += ["--draft-model-config", str(draft_config(work)), "--sglang-attention-backend", args.attention_backend]
    return cmd + ["--cache-dir", str(work / "specforge-cache")]


def specforge_arm(args, model_dir: Path, data: Path) -> dict:
    out, work = Path(args.work) / "out-specforge", Path(args.work)
    env = dict(os.environ, PYTHONPATH=f"{args.peer_site}:{os.environ.get('PYTHONPATH', '')}")
    cmd = specforge_command(args, model_dir, data, out)
    for d in (out, work / "specforge-cache"):  # it skips samples whose files exist, and caches its dataset
        shutil.rmtree(d, ignore_errors=True)
    t_start = time.time()
    with Watch() as watch:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=work)
        lines = stamped_lines(p, work / "specforge.log")
        rc = p.wait()
    t_exit = time.time()
    os.sync()
    t_durable = time.time()
    # its own progress lines go to a logger at INFO, not shown: the model is built when the line that
    # follows SGLang's weight loading arrives (the dataset build, then capture, come after it)
    loaded = [i for i, (_, ln) in enumerate(lines) if "loading shards" in ln]
    ready = [lines[loaded[-1] + 1][0]] if loaded and loaded[-1] + 1 < len(lines) else []
    layers = [ln.split("layers:")[-1].strip() for _, ln in lines if "capture method" in ln and "layers:" in ln]
    res = {"arm": "specforge", "command": " ".join(cmd), "rc": rc, **watch.figures()}
    if rc != 0 or not ready:
        res["log_tail"] = [ln.rstrip() for _, ln in lines[-40:]]
        return res
    files = sorted(out.rglob("data_*.ckpt"))
    return res | {
        "capture_layers_printed": layers[0] if layers else None,
        "start_to_ready_s": round(ready[0] - t_start, 1),
        "ready_to_exit_s": round(t_exit - ready[0], 2),
        "ready_to_durable_s": round(t_durable - ready[0], 2),
        "sync_s": round(t_durable - t_exit, 2),
        "files": len(files),
        "disk_bytes": disk_bytes(out),
        "out": str(out),
    }


def recipe_arm(args, model_dir: Path, data: Path) -> dict:
    with Watch() as watch:
        res = product.product_arm(args, "recipe", model_dir, data)
    return res | {"disk_bytes": disk_bytes(Path(res["out"])), **watch.figures()}


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_sample(ours: dict, theirs: dict, n_aux: int) -> dict:
    """One sample: ours (specforge_raw of our shard) against SpecForge's file, its padding cut off."""
    T = len(ours["input_ids"])
    tid, tmask = theirs["input_ids"].view(-1), theirs["loss_mask"].view(-1)
    H = ours["hidden_state"].shape[-1]
    out = {
        "tokens": T,
        "padded_to": len(tid),
        "ids_equal": bool(len(tid) >= T and (tid[:T] == ours["input_ids"]).all()),
    }
    out["padding_unmasked"] = int(tmask[T:].sum())
    diff = (tmask[:T] != ours["loss_mask"]).nonzero().view(-1)
    out["loss_mask_diffs"] = [(int(i), int(tid[i]), int(ours["loss_mask"][i]), int(tmask[i])) for i in diff[:8]]
    out["loss_mask_diff_count"] = len(diff)
    slots = [
        (ours["aux_hidden_state"][..., k * H : (k + 1) * H], theirs["aux_hidden_state"][:, :T, k * H : (k + 1) * H])
        for k in range(n_aux)
    ]
    slots.append((ours["hidden_state"], theirs["hidden_state"][:, :T]))
    out["rel_l2"] = [round(rel_l2(a, b), 6) for a, b in slots]
    out["bit_equal"] = [round(float((a == b).float().mean()), 4) for a, b in slots]
    return out


def bf16_band(model_dir: Path, recipe_out: Path, data: Path, n: int, device: str = "cuda") -> list[float]:
    """bf16's own band, as the GPU proof bounds fidelity (tests/gpu): per slot, 2 x the worst rel-L2
    between HF in bf16 and HF in float32 over the data's first n samples, at our capture layers and the
    final state. Two bf16 computations of one function, each within e of it, are within 2e of each other."""
    from recipe.data import sample_id, to_messages
    from recipe.shards import ShardReader

    reader = ShardReader(recipe_out)
    lines = open(data).read().splitlines()[:n]
    ids = [reader.get(sample_id(to_messages(json.loads(x))))["input_ids"].numpy() for x in lines]
    return hf_band(model_dir, reader.manifest["capture"]["layers"], ids, device)


def hf_band(model_dir: Path, layers: list[int], ids: list, device: str = "cuda") -> list[float]:
    import torch

    from recipe.backends.hf import HFBackend

    states = {}
    for dtype in ("bfloat16", "float32"):  # one model on the GPU at a time
        with HFBackend(model_dir, layers, True, device=device, dtype=dtype, batch_size=1) as hf:
            states[dtype] = [hf.hidden_states([x])[0].float() for x in ids]
        if device == "cuda":
            torch.cuda.empty_cache()
    worst = torch.zeros(len(layers) + 1)
    for a, b in zip(states["bfloat16"], states["float32"]):
        worst = torch.maximum(worst, (a - b).norm(dim=(0, 2)) / b.norm(dim=(0, 2)).clamp_min(1e-30))
    return [round(2 * float(e), 6) for e in worst]


def band_against(model_dir: Path, data: Path, n: int, layers: list[int], earlier: dict, device: str = "cuda") -> dict:
    """bf16's band for an earlier run whose files are gone, rebuilt from the same weights and data (both
    made from fixed seeds): the data is the same when its token count is that run's, the weights when
    their fingerprint is (None: that run kept none); every sample lay within the band when that run's
    worst distance in each slot does."""
    from transformers import AutoTokenizer

    from recipe.data import to_messages, tokenize

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenize(tok, to_messages(json.loads(x)))[0] for x in open(data).read().splitlines()]
    band = hf_band(model_dir, layers, ids[:n], device)
    worst = earlier["same_data"]["rel_l2_worst_per_slot"]
    tokens = sum(len(x) for x in ids)
    return {"layers": layers, "band_samples": n, "bf16_band_per_slot": band, "rel_l2_worst_per_slot": worst,
            "tokens": tokens, "tokens_in_that_run": earlier["arms"]["recipe"]["tokens"],
            "same_data": tokens == earlier["arms"]["recipe"]["tokens"], "samples": earlier["same_data"]["samples"],
            "same_weights": None if "model_fingerprint" not in earlier
            else earlier["model_fingerprint"] == model_fingerprint(model_dir),
            "every_sample_within_band": all(w <= b for w, b in zip(worst, band))}  # fmt: skip


def compare(recipe_out: Path, specforge_out: Path, data: Path, key_len: int = 256, band=None, limit=None) -> dict:
    """Every sample of the data file (its first `limit` lines, if given): ours by its id, SpecForge's file
    found by its first key_len token ids (its files are numbered by batch position; that order is
    checked, not assumed). `band`: bf16_band's, per slot; a sample is within it when every slot is."""
    import torch

    from recipe.data import sample_id, to_messages
    from recipe.shards import ShardReader
    from recipe.shards.export import specforge_file, specforge_raw

    def load(f):
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)

    by_prefix = {tuple(load(f)["input_ids"].view(-1)[:key_len].tolist()): f for f in specforge_out.rglob("data_*.ckpt")}
    reader = ShardReader(recipe_out)
    n_aux = len(reader.manifest["capture"]["layers"])
    per, missing, moved = [], [], 0
    for i, line in enumerate(open(data).read().splitlines()[:limit]):
        ours = specforge_raw(reader.get(sample_id(to_messages(json.loads(line)))), n_aux)
        f = by_prefix.get(tuple(ours["input_ids"][:key_len].tolist()))
        if f is None:
            missing.append(i)  # its dataloader drops the last partial batch (drop_last=True)
            continue
        moved += f != specforge_out / specforge_file(i)
        per.append(compare_sample(ours, load(f), n_aux))
    worst = [max(p["rel_l2"][k] for p in per) for k in range(n_aux + 1)]
    mask_tokens = sorted({d[1] for p in per for d in p["loss_mask_diffs"]})
    return {
        "samples": len(per),
        "missing_in_specforge": missing,
        "files_not_at_their_line": moved,
        "ids_equal": sum(p["ids_equal"] for p in per),
        "loss_mask_equal": sum(p["loss_mask_diff_count"] == 0 for p in per),
        "loss_mask_diff_positions": sum(p["loss_mask_diff_count"] for p in per),
        "loss_mask_diff_token_ids": mask_tokens,
        "loss_mask_diff_examples": [d for p in per for d in p["loss_mask_diffs"]][:8],
        "padding_unmasked": sum(p["padding_unmasked"] for p in per),
        "rel_l2_worst_per_slot": worst,
        "rel_l2_mean_per_slot": [round(sum(p["rel_l2"][k] for p in per) / len(per), 6) for k in range(n_aux + 1)],
        "bit_equal_mean_per_slot": [round(sum(p["bit_equal"][k] for p in per) / len(per), 4) for k in range(n_aux + 1)],
        "within_bf16": sum(max(p["rel_l2"]) < BF16_REL for p in per),
        "bf16_band_per_slot": band,
        "within_bf16_band": None if band is None else sum(all(e <= b for e, b in zip(p["rel_l2"], band)) for p in per),
        "tokens_real": sum(p["tokens"] for p in per),
        "tokens_padded": sum(p["padded_to"] for p in per),
    }


def ratios(res: dict) -> dict:
    r, s, c = res["arms"]["recipe"], res["arms"]["specforge"], res.get("same_data", {})
    out = {  # each arm's own tokens: SpecForge writes only whole batches of 32
        "recipe tok/s ready-to-durable": round(r["tokens"] / r["ready_to_durable_s"], 1),
        "specforge tok/s ready-to-durable": round(c["tokens_real"] / s["ready_to_durable_s"], 1),
    }
    out["speed ratio (goal >= 1.5)"] = round(
        out["recipe tok/s ready-to-durable"] / out["specforge tok/s ready-to-durable"], 3
    )
    per_token = (r["disk_bytes"] / r["tokens"]) / (s["disk_bytes"] / c["tokens_real"])
    out["bytes per token ratio (goal <= 0.7)"] = round(per_token, 3)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/llama8b")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=3584, help="bytes of text = tokens; the disk holds both sets")
    ap.add_argument("--max-length", type=int, default=4096, help="both arms' token limit (no sample reaches it)")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--peer-site", default="/tmp/peer", help="SGLang 0.5.14 and its pins (tests/gpu/stage-peer.sh)")
    ap.add_argument("--specforge-script", default=".gpu-wheels/p2/prepare_hidden_states.py")
    ap.add_argument("--port", type=int, default=33100)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--work", default="/tmp/bench-peers")
    ap.add_argument("--out")
    ap.add_argument("--reuse-specforge", help="an earlier peers JSON whose SpecForge arm's files are still here")
    ap.add_argument("--reuse-recipe", help="an earlier peers JSON whose recipe arm's shards are still on this machine")
    # HF in bf16 and in float32 on the first N samples: the band the states are held to (bf16_band)
    ap.add_argument("--band-samples", type=int, default=32)
    ap.add_argument("--band-against", help="an earlier peers JSON: only bf16's band, rebuilt for its figures")
    args = ap.parse_args(argv)
    args.fake, args.specforge_script = False, str(Path(args.specforge_script).resolve())
    return args


def main():
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model_dir = product.prepare_model(args)  # sets args.flags (the attention backend)
    args.flags += [f"data.max_length={args.max_length}"]
    ours, theirs = write_data(work, args.samples, args.min_len, args.max_len)
    res = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "weights_s": round(time.monotonic() - t0), "arms": {}}
    res["model_fingerprint"] = model_fingerprint(model_dir)  # what a later --band-against checks its weights by

    def save():
        print(json.dumps(res, indent=1)[-3000:], flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))

    if args.band_against:  # the earlier run's files are gone: its band only, from the same weights and data
        res["band_against"] = band_against(model_dir, ours, args.band_samples, OUR_LAYERS,
                                           json.loads(Path(args.band_against).read_text()))  # fmt: skip
        res["total_s"] = round(time.monotonic() - t0)
        return save()
    # ours first, on the fresh machine: whatever a warm kernel cache gives goes to SpecForge's arm
    earlier = json.loads(Path(args.reuse_recipe).read_text())["arms"]["recipe"] if args.reuse_recipe else None
    if earlier and (Path(earlier["out"]) / "manifest.json").exists():
        res["arms"]["recipe"] = earlier | {"reused_from": args.reuse_recipe}
    else:
        res["arms"]["recipe"] = recipe_arm(args, model_dir, ours)
    save()
    earlier = json.loads(Path(args.reuse_specforge).read_text())["arms"]["specforge"] if args.reuse_specforge else None
    if earlier and earlier.get("files"):
        res["arms"]["specforge"] = earlier | {"reused_from": args.reuse_specforge}
    else:
        res["arms"]["specforge"] = specforge_arm(args, model_dir, theirs)
    save()
    if res["arms"]["specforge"]["rc"] == 0:
        recipe_out, t_band = Path(res["arms"]["recipe"]["out"]), time.monotonic()
        band = bf16_band(model_dir, recipe_out, ours, args.band_samples) if args.band_samples else None
        res["bf16_band_s"] = round(time.monotonic() - t_band, 1)
        res["same_data"] = compare(recipe_out, Path(res["arms"]["specforge"]["out"]), ours, band=band)
        res["ratios"] = ratios(res)
    res["total_s"] = round(time.monotonic() - t0)
    save()


if __name__ == "__main__":
    main()
