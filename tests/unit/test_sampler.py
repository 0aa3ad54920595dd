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
        seen_tokens=None, banned=None, generators=[None] * B, max_num_logprobs=-1)
    for k, v in overrides.items():
        setattr(m, k, v)
    return m


def test_penalties_match_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 2, 3], [4], [5, 5, 6]]
    outputs = [[1, 7, 7, 7], [], [6, 8]]
    rep, pres, freq = [1.3, 1.0, 0.7], [0.5, 1.0, 0.0], [0.2, 0.0, -0.5]
    rows, ids, counts = [], [], []
    for i in range(3):
        for t in sorted(set(prompts[i]) | set(outputs[i])):
            rows.append(i)
            ids.append(t)
            counts.append(float(outputs[i].count(t)))
    seen = (torch.tensor(rows), torch.tensor(ids), torch.tensor(counts))
    m = meta_for([SamplingParams()] * 3, repetition_penalty=torch.tensor(rep), presence_penalty=torch.tensor(pres),
                 frequency_penalty=torch.tensor(freq), seen_tokens=seen)
    got = apply_penalties(logits.clone(), m)
    ref = logits.clone()
    for i in range(3):
        for t in set(prompts[i]) | set(outputs[i]):
            ref[i, t] = ref[i, t] / rep[i] if ref[i, t] > 0 else ref[i, t] * rep[i]
        for t in set(outputs[i]):
            ref[i, t] -= freq[i] * outputs[i].count(t) + pres[i]
    torch.testing.assert_close(got, ref)
    # The dense form (every token of every row) gives the same bits: an unseen token's
    # terms are all 0.
    dense_counts = torch.zeros(3, V)
    dense_seen = torch.zeros(3, V, dtype=torch.bool)
    dense_counts[seen[0], seen[1]] = seen[2]
    dense_seen[seen[0], seen[1]] = True
    r = torch.tensor(rep)[:, None]
    dense = torch.where(dense_seen, torch.where(logits > 0, logits / r, logits * r), logits)
    dense = dense - torch.tensor(freq)[:, None] * dense_counts
    dense = dense - torch.tensor(pres)[:, None] * (dense_counts > 0).float()
    assert torch.equal(got, dense)


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


def _reference_probs(x: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """sampler.py's distribution for one row, in float64: softmax(x / t) after top-k (ties at
    the k-th value kept), top-p (ascending, drop while the dropped mass is at most 1 - p)
    and min-p."""
    x = x.double()
    live = x > float("-inf")
    if 0 < top_k < int(live.sum()):
        live &= x >= x[live].topk(top_k).values[-1]
    w = torch.where(live, torch.exp(x / t - (x[live] / t).max()), torch.zeros_like(x))
    if top_p < 1.0:
        total, dropped = float(w.sum()), 0.0
        order = sorted((i for i in range(x.numel()) if w[i] > 0), key=lambda i: (float(w[i]), -i))
        for i in order[:-1]:
            dropped += float(w[i])
            if dropped > (1 - top_p) * total:
                break
            w[i] = 0.0
    if min_p > 0:
        w = torch.where(w < min_p * w.max(), torch.zeros_like(w), w)
    return w / w.sum()


def test_kernel_sample_rows_draws_the_inverse_cdf_of_the_exact_distribution(isa_kernels):
    """sample.cpp against a float64 reference, row by row: the token it returns for u is the
    one whose interval of the reference CDF holds u (to 1e-5: its probabilities are exp16's
    float32 ones), under temperature, top-k, top-p, min-p and masked (-inf) tokens, at
    vocabulary sizes that leave a scalar tail and span several of its partial sums; greedy
    rows are the argmax; a row's token does not depend on the rows beside it."""
    k = isa_kernels
    g = torch.Generator().manual_seed(5)
    configs = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (2.0, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0),
               (1.0, 0, 0.6, 0.0), (0.8, 40, 0.9, 0.0), (1.0, 0, 1.0, 0.2), (1.3, 100, 0.95, 0.05),
               (1.0, 1, 1.0, 0.0), (0.5, 0, 0.3, 0.0)]
    us = [0.0, 1e-9, 0.1, 0.37, 0.5, 0.77, 0.999, 1.0 - 2 ** -40]
    for vocab in (37, 1000, 4099):
        for t, top_k, top_p, min_p in configs:
            x = torch.randn(len(us), vocab, generator=g) * 3
            x[:, 7] = float("-inf")                          # a masked token is never drawn
            x[2, :] = float("-inf")
            x[2, 11] = 0.5                                   # one token allowed in this row
            n = len(us)
            out = k.sample_rows(x, torch.full((n,), t), torch.tensor(us, dtype=torch.float64),
                                torch.full((n,), top_k if top_k else vocab), torch.full((n,), top_p),
                                torch.full((n,), min_p))
            for r, u in enumerate(us):
                probs = _reference_probs(x[r], t, top_k, top_p, min_p)
                tok = int(out[r])
                assert probs[tok] > 0, (vocab, t, top_k, top_p, min_p, u)
                cdf = probs.cumsum(0)
                lo = float(cdf[tok] - probs[tok])
                assert lo - 1e-5 <= u <= float(cdf[tok]) + 1e-5, (vocab, t, top_k, top_p, min_p, u, tok)
                alone = k.sample_rows(x[r:r + 1], torch.tensor([t]), torch.tensor([u], dtype=torch.float64),
                                      torch.tensor([top_k if top_k else vocab]), torch.tensor([top_p]),
                                      torch.tensor([min_p]))
                assert int(alone) == tok
    x = torch.randn(4, 49152, generator=g)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.6])
    out = k.sample_rows(x, temps, torch.tensor([0.3, 0.3, 0.9, 0.9], dtype=torch.float64))
    assert int(out[0]) == int(x[0].argmax()) and int(out[2]) == int(x[2].argmax())
    for r in (1, 3):
        probs = _reference_probs(x[r], float(temps[r]), 0, 1.0, 0.0)
        cdf = probs.cumsum(0)
        u = 0.3 if r == 1 else 0.9
        assert float(cdf[out[r]] - probs[out[r]]) - 1e-5 <= u <= float(cdf[out[r]]) + 1e-5


def test_sampler_with_the_kernel_follows_the_distribution(isa_kernels):
    """20k kernel draws per configuration land within a percent or two of the reference
    probabilities, and seeded rows draw the same tokens as the torch path (the same u)."""
    k = isa_kernels
    ours = Sampler(torch.Generator().manual_seed(0), k.argmax_rows, k.apply_token_bitmask, k.sample_rows)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, float("-inf")]]).repeat(20000, 1)
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.8),
                   SamplingParams(temperature=1.5, top_k=3), SamplingParams(temperature=1.0, min_p=0.3)):
        m = meta_for([params] * 20000)
        m.top_k = torch.tensor([params.top_k if params.top_k > 0 else 6] * 20000)
        ids = ours(logits, m).token_ids
        freq = torch.bincount(ids, minlength=6).double() / 20000
        ref = _reference_probs(logits[0], params.temperature, params.top_k if params.top_k > 0 else 0,
                               params.top_p, params.min_p)
        torch.testing.assert_close(freq, ref, atol=0.015, rtol=0)
    torch.manual_seed(4)
    logits = torch.randn(3, 300)
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.2, top_k=20, min_p=0.01)]
    theirs = Sampler(torch.Generator().manual_seed(0))
    for pos in range(30):
        gens = [seeded_generator(7, pos, torch.device("cpu")) for _ in params]
        top_k = torch.tensor([300, 300, 20])
        a = ours(logits.clone(), meta_for(params, generators=gens, top_k=top_k)).token_ids
        gens = [seeded_generator(7, pos, torch.device("cpu")) for _ in params]
        b = theirs(logits.clone(), meta_for(params, generators=gens, top_k=top_k)).token_ids
        assert torch.equal(a, b)
