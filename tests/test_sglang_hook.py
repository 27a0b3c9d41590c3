"""The in-server hook, fed SGLang 0.5.16 ForwardBatch-shaped inputs (same field names), on the CPU."""

import enum
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from recipe.capture import hostcopy, records, sglang_hook
from recipe.capture.settings import HookSettings
from recipe.capture.sglang_hook import DumpHook


class ForwardMode(enum.IntEnum):  # names as in sglang.srt.model_executor.forward_batch_info
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5


H, LAYERS = 16, [1, 3, 5]


def batch(mode, rids, ext, pre, orig=None, seed=0):
    T = sum(ext)
    g = torch.Generator().manual_seed(seed)
    fb = SimpleNamespace(
        forward_mode=mode,
        rids=rids,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=pre,
        input_ids=torch.randint(0, 1000, (T,), generator=g),
        orig_seq_lens=torch.tensor(orig if orig else [p + e for p, e in zip(pre, ext)], dtype=torch.int32),
    )
    final = torch.randn(T, H, generator=g).to(torch.bfloat16)
    aux = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in LAYERS]
    return fb, final, aux


def dump_hook(dump_dir, layers, final, prefix, budget, group, **kw):
    return DumpHook(HookSettings(str(dump_dir), tuple(layers), final, prefix, budget, **kw), group=group)


def hook(tmp_path, final=True, layers=LAYERS, group=(0, 1)):
    return dump_hook(tmp_path, layers, final, "hsx-", 1 << 30, queue_size=2, group=lambda: group)


def dumped(tmp_path):
    out = {}
    for f in sorted(tmp_path.glob("*.hsr")):
        h, ids, hid = records.read_record(f)
        out[(h["rid"], h["offset"])] = (h, ids, hid)
    return out


def expect_rows(fb, final, aux, row0, n):
    want = torch.stack([a[row0 : row0 + n] for a in aux] + [final[row0 : row0 + n]], dim=1)
    return want.view(torch.int16).numpy().view(np.uint16), fb.input_ids[row0 : row0 + n].numpy().astype(np.int32)


def test_three_requests_in_one_pass(tmp_path):
    hk = hook(tmp_path)
    fb, final, aux = batch(ForwardMode.EXTEND, ["hsx-a", "hsx-b", "hsx-c"], [50, 300, 7], [0, 0, 0])
    hk(fb, final, aux)
    hk.flush()
    got = dumped(tmp_path)
    assert sorted(got) == [("hsx-a", 0), ("hsx-b", 0), ("hsx-c", 0)]
    row = 0
    for rid, n in (("hsx-a", 50), ("hsx-b", 300), ("hsx-c", 7)):
        h, ids, hid = got[(rid, 0)]
        want_h, want_ids = expect_rows(fb, final, aux, row, n)
        assert np.array_equal(hid, want_h) and np.array_equal(ids, want_ids) and h["last"] is True
        row += n


def test_one_request_chunked_over_three_passes(tmp_path):
    hk = hook(tmp_path)
    passes = [
        batch(ForwardMode.EXTEND, ["hsx-a"], [128], [0], [300], seed=1),
        batch(ForwardMode.EXTEND, ["hsx-a"], [128], [128], [300], seed=2),
        batch(ForwardMode.EXTEND, ["hsx-a", "hsx-b"], [44, 20], [256, 0], [300, 20], seed=3),
    ]
    for p in passes:
        hk(*p)
    hk.flush()
    got = dumped(tmp_path)
    assert sorted(got) == [("hsx-a", 0), ("hsx-a", 128), ("hsx-a", 256), ("hsx-b", 0)]
    assert [got[("hsx-a", o)][0]["last"] for o in (0, 128, 256)] == [False, False, True]
    whole = np.concatenate([got[("hsx-a", o)][2] for o in (0, 128, 256)])
    want = np.concatenate(
        [expect_rows(*passes[0], 0, 128)[0], expect_rows(*passes[1], 0, 128)[0], expect_rows(*passes[2], 0, 44)[0]]
    )
    assert np.array_equal(whole, want)
    assert np.array_equal(got[("hsx-b", 0)][2], expect_rows(*passes[2], 44, 20)[0])


def test_warmup_and_health_check_rids_never_dump(tmp_path):
    hk = hook(tmp_path)
    hk(*batch(ForwardMode.EXTEND, ["0123456789abcdef0123456789abcdef"], [3], [0]))  # SGLang's warm-up
    hk(*batch(ForwardMode.EXTEND, ["HEALTH_CHECK_1f2e"], [1], [0]))
    hk(*batch(ForwardMode.EXTEND, ["HEALTH_CHECK_99", "hsx-z"], [1, 9], [0, 0]))  # sharing a pass with ours
    hk.flush()
    assert sorted(dumped(tmp_path)) == [("hsx-z", 0)]


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY])
def test_only_exact_extend_passes(tmp_path, mode):
    hk = hook(tmp_path)
    hk(*batch(mode, ["hsx-a"], [4], [0]))
    hk.flush()
    assert dumped(tmp_path) == {}


@pytest.mark.parametrize("size", [2, 3])
def test_the_ranks_of_a_tp_group_each_write_their_share_and_every_row_once(tmp_path, size):
    """TP ranks hold the same states, so each writes only its share of a pass's rows: together every
    row of every request exactly once, a request cut by a share's edge in two pieces that join up, and
    `last` only on the piece that ends its prompt."""
    passes = [  # three requests, one chunked across passes, with a non-recipe request between
        batch(ForwardMode.EXTEND, ["hsx-a", "HEALTH_CHECK_1", "hsx-b"], [50, 1, 77], [0, 0, 0], [80, 1, 77], seed=1),
        batch(ForwardMode.EXTEND, ["hsx-a", "hsx-c"], [30, 5], [50, 0], [80, 5], seed=2),
    ]
    hooks = [hook(tmp_path, group=(r, size)) for r in range(size)]
    for hk in hooks:
        for p in passes:
            hk(*p)
        hk.flush()
    got = dumped(tmp_path)
    rows = {}
    for (rid, off), (h, ids, hid) in sorted(got.items()):
        rows.setdefault(rid, []).append((off, h["n"], h["last"], hid, ids))
    assert sorted(rows) == ["hsx-a", "hsx-b", "hsx-c"]
    assert len(got) > 3  # some request was cut between ranks
    whole = {
        "hsx-a": (expect_rows(*passes[0], 0, 50), expect_rows(*passes[1], 0, 30)),
        "hsx-b": (expect_rows(*passes[0], 51, 77),),
        "hsx-c": (expect_rows(*passes[1], 30, 5),),
    }
    for rid, pieces in rows.items():
        covered = 0
        for off, n, last, _, _ in pieces:
            assert off == covered  # each row once: no gap, no overlap
            covered += n
        assert [last for *_, last, _, _ in pieces] == [False] * (len(pieces) - 1) + [True]
        assert np.array_equal(np.concatenate([x[3] for x in pieces]), np.concatenate([w[0] for w in whole[rid]]))
        assert np.array_equal(np.concatenate([x[4] for x in pieces]), np.concatenate([w[1] for w in whole[rid]]))


def test_over_several_nodes_only_the_packers_nodes_ranks_write(tmp_path):
    """A TP group over two nodes (SGLANG_HS_SHARE_RANKS: the first 2 of 4 ranks are the packer's
    node): those two write every row once between them; the other node's ranks write nothing."""
    fb, final, aux = batch(ForwardMode.EXTEND, ["hsx-a", "hsx-b"], [40, 21], [0, 0], seed=4)
    for rank in range(4):
        d = tmp_path / f"rank{rank}"
        d.mkdir()
        hk = dump_hook(d, LAYERS, True, "hsx-", 1 << 30, group=lambda r=rank: (r, 4), share_ranks=2)
        hk(fb, final, aux)
        hk.flush()
    assert not list((tmp_path / "rank2").iterdir()) and not list((tmp_path / "rank3").iterdir())
    got = {**dumped(tmp_path / "rank0"), **dumped(tmp_path / "rank1")}
    a = np.concatenate([got[k][2] for k in sorted(got) if k[0] == "hsx-a"])
    assert sorted(got) == [("hsx-a", 0), ("hsx-a", 30), ("hsx-b", 0)]  # rows 0-29 on rank 0, 30-60 on rank 1
    assert np.array_equal(a, expect_rows(fb, final, aux, 0, 40)[0])
    b = np.concatenate([got[k][2] for k in sorted(got) if k[0] == "hsx-b"])
    assert np.array_equal(b, expect_rows(fb, final, aux, 40, 21)[0])


def test_share_splits_a_pass_evenly_and_keeps_offsets():
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 6))
        ext = [int(x) for x in rng.integers(1, 40, k)]
        pre = [int(x) for x in rng.integers(0, 100, k)]
        size = int(rng.integers(1, 9))
        seen = []
        for r in range(size):
            lo, hi, idx, pre2, ext2 = sglang_hook.share(pre, ext, r, size)
            assert abs((hi - lo) - sum(ext) / size) < 1 and sum(ext2) == hi - lo
            for i, p, n in zip(idx, pre2, ext2):
                seen += [(i, p + j) for j in range(n)]
        assert sorted(seen) == [(i, pre[i] + j) for i in range(k) for j in range(ext[i])]


def test_the_trace_lists_what_each_writing_process_wrote(tmp_path):
    """The GPU TP/DP proofs count writers from this trace (tests/gpu): one line per record written,
    in the writing process's own file: (rid, offset, tokens) of the rank's share."""
    (tmp_path / "dump").mkdir()
    trace = tmp_path / "trace"
    trace.mkdir()
    for rank in (0, 1):
        hk = dump_hook(tmp_path / "dump", LAYERS, True, "hsx-", 1 << 30, group=lambda r=rank: (r, 2), trace_dir=trace)
        hk(*batch(ForwardMode.EXTEND, ["hsx-a", "warmup", "hsx-b"], [3, 2, 4], [0, 0, 5], orig=[3, 2, 9]))
        hk.flush()
    files = list(trace.iterdir())  # both ranks are this one process here
    assert len(files) == 1 and files[0].read_text().split("\n") == ["hsx-a 0 3", "hsx-b 5 4", ""]


def test_final_only_capture(tmp_path):
    hk = hook(tmp_path, layers=[])
    fb, final, _ = batch(ForwardMode.EXTEND, ["hsx-a"], [5], [0])
    hk(fb, final, None)
    hk.flush()
    ((h, _, hid),) = dumped(tmp_path).values()
    assert hid.shape == (5, 1, H) and np.array_equal(hid[:, 0], final.view(torch.int16).numpy().view(np.uint16))


def test_aux_packed_side_by_side_dumps_as_the_list_does(tmp_path):
    """SGLang 0.5.23 hands some models' captures over as one [T, K*H] tensor: the same records."""
    fb, final, aux = batch(ForwardMode.EXTEND, ["hsx-a", "hsx-b"], [5, 7], [0, 0])
    for name, given in (("list", aux), ("packed", torch.cat(aux, dim=-1))):
        (tmp_path / name).mkdir()
        hk = hook(tmp_path / name)
        hk(fb, final, given)
        hk.flush()
    listed, packed = dumped(tmp_path / "list"), dumped(tmp_path / "packed")
    assert listed.keys() == packed.keys() and len(listed) == 2
    for k in listed:
        assert np.array_equal(listed[k][2], packed[k][2])


def test_errors_leave_a_marker_not_a_dead_server(tmp_path):
    hk = hook(tmp_path)
    fb, final, aux = batch(ForwardMode.EXTEND, ["hsx-a", "hsx-b"], [5, 5], [0, 0])
    hk(fb, final, aux[:2])  # one capture missing: the model and config disagree
    hk.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hsx-a.err", "hsx-b.err"]
    assert "captured 2 layers" in (tmp_path / "hsx-a.err").read_text()


def test_padding_rows_are_ignored(tmp_path):
    """DP/graph padding can append rows past sum(extend_seq_lens)."""
    hk = hook(tmp_path)
    fb, final, aux = batch(ForwardMode.EXTEND, ["hsx-a"], [6], [0])

    def pad(t):
        return torch.cat([t, torch.zeros((2,) + tuple(t.shape[1:]), dtype=t.dtype)])

    fb.input_ids = pad(fb.input_ids)
    hk(fb, pad(final), [pad(a) for a in aux])
    hk.flush()
    ((h, ids, hid),) = dumped(tmp_path).values()
    assert hid.shape[0] == 6 and np.array_equal(hid, expect_rows(fb, final, aux, 0, 6)[0])


def test_pinned_buffers_are_taken_from_the_pool_not_allocated_per_pass(tmp_path):
    """Pinning host memory holds the CUDA driver: the pool is filled once, on the server's own warm-up
    pass, and no pass after it allocates (passes shorter than the pool's size included)."""
    hk = dump_hook(tmp_path, LAYERS, True, "hsx-", 1 << 30, queue_size=2, group=lambda: (0, 1), pass_tokens=64)
    hk(*batch(ForwardMode.EXTEND, ["0123456789abcdef0123456789abcdef"], [3], [0]))  # SGLang's warm-up
    assert hk.stats.pin_allocs == hk.copy.pool.count == 5  # queue 2 + 2 writers' + the one being filled
    for i in range(12):
        hk(*batch(ForwardMode.EXTEND, [f"hsx-{i}"], [5 + 5 * i], [0], seed=i))
    hk.flush()
    assert hk.stats.pin_allocs == 5 and len(dumped(tmp_path)) == 12


def test_the_pool_holds_the_largest_share_when_the_ranks_do_not_divide_the_pass(tmp_path):
    """Rank 2 of 3 gets rows 42-63 of a 64-token pass: 22 rows, more than a third of the pass's bytes."""
    hk = dump_hook(tmp_path, LAYERS, True, "hsx-", 1 << 30, group=lambda: (2, 3), pass_tokens=64)
    hk(*batch(ForwardMode.EXTEND, ["0123456789abcdef0123456789abcdef"], [3], [0]))  # SGLang's warm-up
    fb, final, aux = batch(ForwardMode.EXTEND, ["hsx-a"], [64], [0], seed=5)
    hk(fb, final, aux)
    hk.flush()
    assert hk.stats.pin_allocs == hk.copy.pool.count  # filled once, no buffer grown in the pass
    assert np.array_equal(dumped(tmp_path)[("hsx-a", 42)][2], expect_rows(fb, final, aux, 42, 22)[0])


def test_a_pass_longer_than_the_pool_buffers_gets_a_larger_one_and_the_pool_stays_bounded(tmp_path):
    hk = dump_hook(tmp_path, LAYERS, True, "hsx-", 1 << 30, queue_size=1, group=lambda: (0, 1), pass_tokens=8)
    for i, n in enumerate([4, 40, 8, 400, 6]):
        fb, final, aux = batch(ForwardMode.EXTEND, [f"hsx-{i}"], [n], [0], seed=i)
        hk(fb, final, aux)
        hk.flush()
        assert np.array_equal(dumped(tmp_path)[(f"hsx-{i}", 0)][2], expect_rows(fb, final, aux, 0, n)[0])
    assert len(hk.copy.pool._free) <= hk.copy.pool.count == 4


def test_a_pool_buffer_is_reused_only_after_its_pass_is_written(tmp_path, monkeypatch):
    """The writer gives a buffer back only once its records are on disk: with a slow writer and a
    small pool, every later pass waits for a buffer rather than overwriting one still being written."""
    hk = dump_hook(tmp_path, LAYERS, True, "hsx-", 1 << 30, queue_size=1, group=lambda: (0, 1))
    slow = hk.writer.write_pass

    def write_pass(*a, **k):
        time.sleep(0.02)
        return slow(*a, **k)

    monkeypatch.setattr(hk.writer, "write_pass", write_pass)
    want = {}
    for i in range(10):
        fb, final, aux = batch(ForwardMode.EXTEND, [f"hsx-{i}"], [7], [0], seed=i)
        want[f"hsx-{i}"] = expect_rows(fb, final, aux, 0, 7)[0]
        hk(fb, final, aux)
    hk.flush()
    got = dumped(tmp_path)
    assert sorted(r for r, _ in got) == sorted(want)
    for rid, w in want.items():
        assert np.array_equal(got[(rid, 0)][2], w), rid


def test_the_pool_waits_for_a_buffer_when_all_are_out():
    pool = hostcopy.PinnedPool(2)
    a, _ = pool.take(10), pool.take(10)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.take(10)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # a third buffer would exceed what can be in flight
    pool.give(a)
    t.join(5)
    assert got and got[0] is a and pool.stats.pin_allocs == 2


def test_the_stats_file_counts_what_was_written(tmp_path):
    (tmp_path / "dump").mkdir()
    stats = tmp_path / "stats.json"
    hk = dump_hook(tmp_path / "dump", LAYERS, True, "hsx-", 1 << 30, group=lambda: (0, 1), stats_path=stats)
    hk.thread.probe = lambda: {"device_allocs": 3}  # on CUDA: hookstats.allocator_counts, less its start
    hk(*batch(ForwardMode.EXTEND, ["hsx-a", "warmup", "hsx-b"], [3, 2, 4], [0, 0, 0]))
    hk(*batch(ForwardMode.EXTEND, ["hsx-c"], [6], [0]))
    hk.close()
    s = json.loads(stats.read_text())
    written = sum(f.stat().st_size for f in (tmp_path / "dump").glob("*.hsr"))
    assert (s["passes"], s["tokens"], s["bytes"]) == (2, 15, written) and s["forward_s"] > 0
    assert s["device_allocs"] == 3


def test_only_rank_0_writes_the_stats_file(tmp_path):
    """All ranks of a TP group get the same SGLANG_HS_STATS path: one rank's figures, not a mix."""
    (tmp_path / "dump").mkdir()
    stats = tmp_path / "stats.json"
    hk = dump_hook(tmp_path / "dump", LAYERS, True, "hsx-", 1 << 30, group=lambda: (1, 2), stats_path=stats)
    hk(*batch(ForwardMode.EXTEND, ["hsx-a"], [9], [0]))
    hk.close()
    assert list((tmp_path / "dump").glob("*.hsr")) and not stats.exists()
