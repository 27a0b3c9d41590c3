"""The self-check's bound at a real model's logit scale: the right final slot passes at every position, a
final slot taken one layer early (about one nat off) is flagged at nearly every position and refused.

A real head: 8K ids, logits up to ~22 (trained LLMs' peak logits are 15-30). The server's logprobs are
computed as SGLang does: bf16 logits, log_softmax. Tokens are sampled from the model's own
distribution, so their logprobs are the ones a real prompt has."""

import numpy as np
import pytest
import torch

from recipe.selfcheck import Head, judge

V, H, N = 8192, 256, 96


def rms(x):
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


@pytest.fixture(scope="module")
def model():
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, H, generator=g) * 0.35).to(torch.bfloat16)
    residual = torch.randn(N, H, generator=g)  # the stream entering the final norm
    final = rms(residual).to(torch.bfloat16)
    logits = (final.float() @ weight.float().T).to(torch.bfloat16).float()
    nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0].numpy()
    ids = np.concatenate([[1], nxt[:-1]]).astype(np.int64)  # token t+1 drawn from row t
    lp = torch.log_softmax(logits, -1)
    server = [[None, 1]] + [[float(lp[t, ids[t + 1]]), int(ids[t + 1])] for t in range(N - 1)]
    last_update = 0.3 * torch.randn(N, H, generator=torch.Generator().manual_seed(1))
    early = rms(residual - last_update).to(torch.bfloat16)  # the state before the last layer's update
    return Head(weight, None), ids, final, early, server


def test_the_logits_are_at_a_real_models_scale(model):
    head, ids, final, _, _ = model
    _, peak = head.logprobs(final, torch.as_tensor(ids))
    assert 15 < peak.mean() < 30


def test_the_right_final_slot_passes_at_every_position(model):
    head, ids, final, _, server = model
    v = judge(head, "s", ids, final, server)
    assert v.ok and v.off == 0, v


def test_a_final_slot_one_layer_early_is_flagged_at_nearly_every_position_and_refused(model):
    head, ids, _, early, server = model
    lp, _ = head.logprobs(early, torch.as_tensor(ids[1:]))
    off_by = np.abs(lp - np.array([s[0] for s in server[1:]])).mean()
    assert 0.9 < off_by < 1.5  # what the H200 run saw for a slot one layer off
    v = judge(head, "s", ids, early, server)
    assert not v.ok and v.off >= 0.85 * v.checked, v


def test_a_softcapped_head_is_judged_through_its_softcap(model):
    """Gemma's final_logit_softcapping: the server's logprobs are of capped logits; so must ours be."""
    head, ids, final, _, _ = model
    capped = Head(head.weight, 10.0)
    logits = (final.float() @ head.weight.float().T).to(torch.bfloat16).float()
    lp = torch.log_softmax(10.0 * torch.tanh(logits / 10.0), -1)
    server = [[None, 1]] + [[float(lp[t, ids[t + 1]]), int(ids[t + 1])] for t in range(N - 1)]
    assert judge(capped, "s", ids, final, server).off == 0


def test_samples_judged_together_each_get_their_own_verdict(model):
    from recipe.selfcheck import judge_all

    head, ids, final, early, server = model
    for order in ((final, early), (early, final)):
        verdicts = judge_all(head, [(f"s{k}", ids, x, server) for k, x in enumerate(order)])
        assert [v.ok for v in verdicts] == [x is final for x in order]


def test_the_watcher_keeps_watching_while_its_requests_are_out_unanswered():
    """Asked, not yet answered at the first look (nothing pending, every request sent): the watcher
    still judges each sample once it is stored, beside the run, not at its end."""
    import asyncio

    from recipe.selfcheck import SelfCheck, Verdict, judge_as_stored

    check = SelfCheck(model_dir=None, samples=2, final_slot=3)
    check.requested = 2  # both sent
    polled = []

    def poll(store):  # the store commits each sample's record once answered
        polled.append(check.pending())
        for key in list(check.asked):
            check.asked.pop(key)
            check.verdicts.append(Verdict(key, 32, 0, 0.001))

    check.poll = poll

    async def scenario():
        watcher = asyncio.create_task(judge_as_stored(check, store=None))
        await asyncio.sleep(0.6)  # two looks with nothing answered
        check.asked.update({"a": ("a", []), "b": ("b", [])})
        await asyncio.wait_for(watcher, 2)

    asyncio.run(scenario())
    assert len(check.verdicts) == 2 and polled[0] == 0 and max(polled) == 2, polled


def fp8_stored(x):
    """x [N, H] bf16 as an fp8 record stores it and every reader gets it back (recipe/shards/fp8.py)."""
    from recipe.shards import fp8
    from recipe.shards.codec import split_planes

    exp, sm, scales, _, _ = fp8.quantize(*split_planes(x.view(torch.int16).numpy()), x.shape[-1])
    return torch.from_numpy(fp8.dequantize(exp, sm, scales, x.shape[-1]).view(np.int16).reshape(x.shape)).view(
        torch.bfloat16
    )


def test_an_fp8_final_slot_passes_though_its_rounding_moves_logprobs_past_bf16s_bound(model):
    """An fp8 set's final slot carries e4m3's rounding, not bf16's: on the H100 the bf16 bound refused a right
    slot at 8 of 32 positions. Each position may move by what that rounding moves its logprob, no more."""
    head, ids, final, _, server = model
    stored = fp8_stored(final)
    assert not judge(head, "s", ids, stored, server).ok
    v = judge(head, "s", ids, stored, server, fp8=True)
    assert v.ok and v.off == 0, v


def test_an_fp8_final_slot_one_layer_early_is_still_refused(model):
    head, ids, _, early, server = model
    v = judge(head, "s", ids, fp8_stored(early), server, fp8=True)
    assert not v.ok and v.off >= 0.75 * v.checked, v


def test_an_fp8_set_whose_rounding_alone_moves_logprobs_that_far_is_refused_naming_lossless(model):
    """A final state spanning more than e4m3's range within a token (its norm's channels 1e-4 to 1e4 apart,
    lm_head's columns the inverse: the draft bench's target) loses its small channels to fp8: a slot one
    layer off would pass, and the teacher a draft learns from is off by nats. The run says so."""
    from pathlib import Path

    from recipe.selfcheck import SelfCheck, SelfCheckFailed

    head, ids, final, early, server = model
    v = judge(head, "s", ids, fp8_stored(final), server, fp8=True)
    assert v.judged, v  # the model above: an even norm
    s = torch.exp(3.0 * torch.randn(H, generator=torch.Generator().manual_seed(3)))
    check = SelfCheck(Path("/models/spread"), 1, 0, head=Head((head.weight.float() / s).to(torch.bfloat16), None))
    for state in (final, early):
        with pytest.raises(SelfCheckFailed, match=r"fp8 codec's rounding .*shards\.codec=lossless"):
            check._judge([("s", ids, fp8_stored((state.float() * s).to(torch.bfloat16)), server)], fp8=True)


def test_the_self_check_reads_and_judges_on_the_cores_it_is_given_then_leaves_the_count_as_it_was(monkeypatch):
    """It works while the server prefills, whose scheduler launches every kernel from a core of the same
    host: the head's widening and the judging matmul take client.self_check_threads cores, not all."""
    import recipe.selfcheck as sc

    seen = []

    class StubHead:
        def widened(self):
            seen.append(("widen", torch.get_num_threads()))

    monkeypatch.setattr(
        sc, "judge_all", lambda head, items, fp8=False: seen.append(("judge", torch.get_num_threads())) or []
    )
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        check = sc.SelfCheck(model_dir=None, samples=1, final_slot=0, threads=1)
        check.head = StubHead()
        check.warm()
        check._judge([("s", None, None, None)])
        assert seen == [("widen", 1), ("judge", 1)] and torch.get_num_threads() == 4
        seen.clear()
        sc.SelfCheck(model_dir=None, samples=1, final_slot=0, threads=0, head=StubHead()).warm()  # 0: every core
        assert seen == [("widen", 4)]
    finally:
        torch.set_num_threads(before)
