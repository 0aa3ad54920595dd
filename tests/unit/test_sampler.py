"""The batched sampler against simple per-row reference computations."""
from __future__ import annotations

import pytest
import torch

from sluice.sampling_params import SamplingParams
from sluice.worker.sampler import Sampler, SamplingMetadata, apply_penalties, apply_top_k_top_p, seeded_generator

V = 50


def meta_for(params: list[SamplingParams], **overrides) -> SamplingMetadata:
    B = len(params)
    m = SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params]),
        all_greedy=all(p.temperature == 0 for p in params),
        top_p=torch.tensor([p.top_p for p in params]), top_k=torch.tensor([p.top_k if p.top_k > 0 else V for p in params]),
        min_p=torch.tensor([p.min_p for p in params]),
        repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        output_counts=None, prompt_mask=None, banned=None, generators=[None] * B, max_num_logprobs=-1)
    for k, v in overrides.items():
        setattr(m, k, v)
    return m


def test_penalties_match_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 2, 3], [4], [5, 5, 6]]
    outputs = [[1, 7, 7, 7], [], [6, 8]]
    rep, pres, freq = [1.3, 1.0, 0.7], [0.5, 1.0, 0.0], [0.2, 0.0, -0.5]
    counts = torch.zeros(3, V)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for i in range(3):
        for t in outputs[i]:
            counts[i, t] += 1
        mask[i, prompts[i]] = True
    m = meta_for([SamplingParams()] * 3, repetition_penalty=torch.tensor(rep), presence_penalty=torch.tensor(pres),
                 frequency_penalty=torch.tensor(freq), output_counts=counts, prompt_mask=mask)
    got = apply_penalties(logits.clone(), m)
    ref = logits.clone()
    for i in range(3):
        for t in set(prompts[i]) | set(outputs[i]):
            ref[i, t] = ref[i, t] / rep[i] if ref[i, t] > 0 else ref[i, t] * rep[i]
        for t in set(outputs[i]):
            ref[i, t] -= freq[i] * outputs[i].count(t) + pres[i]
    torch.testing.assert_close(got, ref)


def test_top_k_top_p_keep_exactly_the_allowed_tokens():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    out = apply_top_k_top_p(logits.clone(), torch.tensor([5, V]), torch.tensor([1.0, 0.6]))
    kept0 = set(torch.nonzero(out[0] > float("-inf")).flatten().tolist())
    assert kept0 == set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[1], -1)
    order = probs.argsort(descending=True)
    cum, allowed = 0.0, set()
    for t in order.tolist():          # smallest set whose mass reaches 0.6
        allowed.add(t)
        cum += float(probs[t])
        if cum >= 0.6:
            break
    kept1 = set(torch.nonzero(out[1] > float("-inf")).flatten().tolist())
    assert kept1 == allowed


def test_greedy_rows_are_argmax_and_samples_stay_in_top_k():
    torch.manual_seed(2)
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.5, min_p=0.5), SamplingParams(temperature=2.0, top_p=0.3)]
    allowed_k = set(logits[1].topk(3).indices.tolist())
    probs2 = torch.softmax(logits[2] / 0.5, -1)
    allowed_minp = set(torch.nonzero(probs2 >= 0.5 * probs2.max()).flatten().tolist())
    for _ in range(50):
        ids = sampler(logits.clone(), meta_for(params)).token_ids.tolist()
        assert ids[0] == int(logits[0].argmax())
        assert ids[1] in allowed_k
        assert ids[2] in allowed_minp


def test_sampling_follows_the_distribution():
    """10k draws from softmax(logits / T) land within a few percent of the true probabilities."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(10000, 1)
    params = [SamplingParams(temperature=0.8)] * 10000
    m = meta_for(params)
    m.top_k = m.top_p = m.min_p = None
    ids = sampler(logits, m).token_ids
    freq = torch.bincount(ids, minlength=4).float() / 10000
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.8, -1), atol=0.02, rtol=0)


def test_seeded_rows_depend_only_on_seed_and_position():
    sampler = Sampler(torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=1.0)] * 3
    m = meta_for(params)
    m.top_k = m.top_p = m.min_p = None
    m.generators = [None, seeded_generator(42, 10, torch.device("cpu")), None]
    a = sampler(logits.clone(), m).token_ids[1]
    draws = set()
    for _ in range(20):
        m2 = meta_for([params[0]] * 2)
        m2.top_k = m2.top_p = m2.min_p = None
        m2.generators = [None, seeded_generator(42, 10, torch.device("cpu"))]
        draws.add(int(sampler(torch.stack([torch.randn(V), logits[1]]), m2).token_ids[1]))
    assert draws == {int(a)}


def test_logprobs_and_ranks():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    m = meta_for([SamplingParams(temperature=0)], max_num_logprobs=2)
    m.top_k = m.top_p = m.min_p = None
    out = sampler(logits, m)
    lp = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.tolist() == [1]
    assert out.logprob_ids.tolist() == [[1, 1, 3]]
    torch.testing.assert_close(out.logprobs[0], lp[[1, 1, 3]])
    assert out.ranks.tolist() == [1]


def test_kernel_argmax_matches_torch_argmax_ties_nan_and_inf_included(isa_kernels):
    k = isa_kernels
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 49152), (33, 1000), (5, 17), (3, 3)]:
        x = torch.randn(rows, vocab, generator=g)
        assert torch.equal(k.argmax_rows(x), x.argmax(dim=-1))
    x = torch.randn(5, 100, generator=g)
    x[0, 40] = x[0, 7] = x[0, 99] = 50.0        # ties: the first index wins
    x[1, 60] = x[1, 20] = float("nan")          # a NaN counts as the maximum
    x[2] = float("-inf")                        # nothing finite
    x[3, 98] = float("inf")
    x[4, 99] = 1e9                               # in the scalar tail
    assert k.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [7, 20, 0, 98, 99]
    # The sampler uses it for greedy rows and the exponential race alike: the same draws.
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.7), SamplingParams(temperature=2.0, top_p=0.3)]
    logits = torch.randn(4, V, generator=g)
    ours, theirs = Sampler(torch.Generator().manual_seed(1), k.argmax_rows), Sampler(torch.Generator().manual_seed(1))
    for _ in range(20):
        assert torch.equal(ours(logits.clone(), meta_for(params)).token_ids,
                           theirs(logits.clone(), meta_for(params)).token_ids)


@pytest.mark.parametrize("seven_bit", [False, True], ids=["w8a8", "w8a7"])
def test_greedy_head_rescores_int8_candidates_to_the_bf16_heads_argmax(isa_kernels, seven_bit):
    """The LM head's greedy fast path: int8 x int8 logits (or int8 weights by 7-bit
    activations, head_w8a7) pick 16 candidates per row, which are rescored with the bf16
    head's own arithmetic; the answer is the bf16 head's argmax, even where the rounding
    ranked a different token first."""
    from sluice.quantization.int8 import quantize_per_channel
    k = isa_kernels
    g = torch.Generator().manual_seed(0)
    vocab, hidden = 3000, 97  # odd K: the last pair is half padding
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
    x = torch.randn(40, hidden, generator=g).bfloat16()
    # Near-ties: per row, a twin of the best column, a hair apart (below int8 resolution).
    exact0 = k.bi_linear(x, k.bi_pack_weight(w), vocab, None, True)
    for r in range(0, 40, 2):
        best = int(exact0[r].argmax())
        w[vocab - 1 - r] = w[best]
        w[vocab - 1 - r, r % hidden] += 0.0005
    packed = k.bi_pack_weight(w)
    q, scale = quantize_per_channel(w)
    if seven_bit:
        approx = k.head_w8a7(x, k.head_w8a7_pack(q), scale.float(), vocab)
        # The kernel's 7-bit values (as it rounds them, in float32), summed in float64.
        xp = torch.nn.functional.pad(x.float(), (0, -hidden % 32)).view(40, -1, 32)
        mx = xp.abs().amax(2, keepdim=True)
        x7 = torch.round(xp * torch.where(mx > 0, 63 / mx, 0)) * (mx / 63)
        ref = (x7.view(40, -1)[:, :hidden].double() @ q.double().T) * scale.double()
        torch.testing.assert_close(approx.double(), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    else:
        approx = k.w8a8_linear(x, k.w8a8_pack_weight(q), scale, vocab, None, True)
    exact = k.bi_linear(x, packed, vocab, None, True)
    assert not torch.equal(approx.argmax(-1), exact.argmax(-1))  # the rounding alone gets some rows wrong
    assert torch.equal(k.greedy_head(approx, x, packed, 16), exact.argmax(-1))
    assert torch.equal(k.greedy_head(approx, x, packed, 1), approx.argmax(-1))
    for rows in (1, 3, 17):  # rows are independent of their batch
        if seven_bit:  # the 1-, 2- and 4-row blocks give the same sums
            assert torch.equal(k.head_w8a7(x[:rows], k.head_w8a7_pack(q), scale.float(), vocab), approx[:rows])
        assert torch.equal(k.greedy_head(approx[:rows], x[:rows], packed), exact[:rows].argmax(-1))


def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    # row 0: +2.5 on token 2 overtakes token 1; row 1: -100 bans the best; row 2: none.
    bias = (torch.tensor([0, 1, 1]), torch.tensor([2, 1, 3]), torch.tensor([2.5, -100.0, 0.5]))
    m = meta_for([SamplingParams(temperature=0)] * 3, max_num_logprobs=0, logit_bias=bias)
    m.top_k = m.top_p = m.min_p = None
    out = sampler(logits, m)
    assert out.token_ids.tolist() == [2, 3, 1]
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs[:, 0], lp[[0, 1, 2], [2, 3, 1]])  # the model's own
    # Sampling: +100 all but forces a token, whatever the draw.
    m = meta_for([SamplingParams(temperature=1.0)] * 3,
                 logit_bias=(torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]), torch.tensor([100.0] * 3)))
    for _ in range(20):
        assert sampler(logits, m).token_ids.tolist() == [0, 0, 0]


def test_allowed_token_ids_limit_the_draw_and_leave_logprobs_raw():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    mask = torch.tensor([[True, False, True, False]])  # row 1 may sample only tokens 0 and 2
    m = meta_for([SamplingParams(temperature=1.0)] * 2, allowed=(torch.tensor([1]), mask), max_num_logprobs=0)
    m.top_k = m.top_p = m.min_p = None
    seen = set()
    for _ in range(50):
        out = sampler(logits, m)
        seen.add(out.token_ids[1].item())
        torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0])
    assert seen == {0, 2}
    m = meta_for([SamplingParams(temperature=0)] * 2, allowed=(torch.tensor([1]), mask))
    m.top_k = m.top_p = m.min_p = None
    assert sampler(logits, m).token_ids.tolist() == [1, 2]
