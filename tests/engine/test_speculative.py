"""Speculative decoding from the request's own context (engine/speculative.py).

The reference is the same engine with speculation off: greedy output must be token for token
the same (drafts accepted or not, stops inside a verified draft, preemption), rollback must
leave the radix cache and page pool as they would be without it, and sampled output must keep
its distribution.
"""

import inspect
import json
import random
import textwrap
from collections import Counter

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tokenizer import encode_chat
from engine.grammar import constraint_for_request
from engine.kv_pool import PagePool
from engine.request import Request
from engine.drafting import DraftLength, NgramDrafter, OutputCorpus, TenantCorpora
from engine.speculative import verify
from engine.step_cost import MIN_ROW, STEP_COST, fit_step_cost, step_cost_for

QUOTED = textwrap.dedent(inspect.getsource(PagePool.alloc))   # real code, as an agent quotes a file
QUOTED_2 = ("The deploy script reads the manifest, checks every service's health endpoint, drains the "
            "old workers one by one and starts the new ones with the same ports and the same limits.")


def chat(tok, text):
    return encode_chat(tok, [{"role": "system", "content": "You are a careful assistant."},
                             {"role": "user", "content": text}])


def quote(tok, text):
    return chat(tok, f"Repeat the following text exactly, with no change and no comment:\n\n{text}")


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


@pytest.fixture(scope="module")
def spec_engine():
    """The conftest default engine's configuration, speculation on."""
    return LLMEngine(EngineConfig(kv_cache_tokens=32768, max_batched_tokens=256, speculative="suffix"))


def spec_counts(engine):
    st = engine.stats()
    return st.spec_draft_tokens_total, st.spec_accepted_tokens_total, st.spec_verifications_total


# -- the drafter ------------------------------------------------------------------------------------

def reference_latest_match(tokens, max_ngram=4, min_ngram=2):
    """Brute force: (end of the latest earlier occurrence of the longest suffix n-gram, n)."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n:e] == tokens[L - n:]:
                return e, n
    return None


def test_drafter_proposes_what_followed_the_longest_latest_match():
    d = NgramDrafter([5, 1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3])
    assert d.propose(3) == [9, 8, 2]           # (1, 2, 3) beats the later (2, 3)
    d.extend([4, 4])                            # suffix (3, 4, 4) / (4, 4) never occurred before
    assert d.propose(3) == []
    d.extend([1, 2])
    assert d.propose(2) == [3, 4]               # (1, 2): its latest earlier occurrence is followed by 3, 4
    assert NgramDrafter([7, 7, 7]).propose(5) == [7, 7, 7, 7, 7]    # a repeating run continues itself
    assert NgramDrafter([1, 2]).propose(3) == []
    assert NgramDrafter([1, 2, 1, 2]).propose(0) == []


def test_drafter_keeps_following_the_place_it_copies():
    """A file whose 4-gram (1 2 3 4) occurs twice, copied from its start: at the second occurrence
    the latest earlier match is the reply's own copy of the first one (followed by 10), but the
    copy goes on from where it is in the file (20)."""
    source = [1, 2, 3, 4, 10, 11, 12, 13, 14, 1, 2, 3, 4, 20, 21, 22, 23]
    d = NgramDrafter(source + [0, 9, 1, 2, 3, 4, 10])   # the reply has copied "1 2 3 4 10"
    assert d.propose(3) == [11, 12, 13]
    d.extend([11, 12])
    assert d.propose(3) == [13, 14, 1]
    d.extend([13, 14, 1, 2, 3, 4])                      # copying on, through the repeated 4-gram
    assert d.latest_match() == (len(source) + 6, 4)     # the reply's own "1 2 3 4", followed by 10
    assert d.propose(2) == [20, 21]
    d.extend([99])                                      # the reply departs from the source
    assert d.propose(2) == []


def test_drafter_index_kept_incrementally_equals_brute_force():
    rng = random.Random(0)
    for trial in range(40):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        d = NgramDrafter(tokens)
        for _ in range(25):
            assert d.latest_match() == reference_latest_match(tokens), (trial, tokens)
            k = rng.randrange(1, 6)
            draft = d.propose(k)
            assert len(draft) == (k if reference_latest_match(tokens) else 0)
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            tokens += new
            d.extend(new)


def reference_draft_rate(history, max_len, step_cost):
    """From scratch: alpha from every (drafted, accepted) so far, the newest weighing most (DECAY
    per verification since); then per k the expected tokens committed (1 + alpha + ... + alpha**k)
    over the step's cost (1 + fixed + row * k; 1 for no draft) -> (best rate, rate per k, alpha)."""
    acc, tried = DraftLength.PRIOR
    for drafted, accepted in history:
        acc = DraftLength.DECAY * acc + accepted
        tried = DraftLength.DECAY * tried + accepted + (accepted < drafted)
    alpha = acc / tried
    fixed, row = step_cost
    rates = [1.0] + [sum(alpha ** j for j in range(k + 1)) / (1 + fixed + row * k) for k in range(1, max_len + 1)]
    return max(rates), rates, alpha


def test_draft_length_makes_the_most_tokens_per_step_cost():
    rng = random.Random(7)
    for step_cost in ((0.0, 0.05), (0.2, 0.23), (0.1, 0.15)):
        ln, history = DraftLength(6, step_cost), []
        for step in range(600):
            if step % 60 == 0:
                p = rng.choice([0.0, 0.3, 0.7, 0.95, 1.0])    # this stretch's chance a token is kept
            k = ln.limit()
            best, rates, alpha = reference_draft_rate(history, 6, step_cost)
            assert abs(ln.alpha - alpha) < 1e-12
            assert abs(rates[ln.k] - best) < 1e-9, (step_cost, ln.k, rates)
            if k == 0:
                continue
            accepted = next((j for j in range(k) if rng.random() >= p), k)
            ln.update(k, accepted)
            history.append((k, accepted))
        lengths = {k for k, _ in history}
        assert len(lengths) >= 3 and max(lengths) >= 5, step_cost   # it drafted short and long
    ln = DraftLength(4, (0.2, 0.23))
    assert ln.k == 0                      # alpha 0.4: 1.4 tokens for 1.43 steps does not pay
    ln.update(1, 1)                       # an accepted probe: alpha 0.64
    assert ln.limit() == 2                # 2.05 tokens for 1.66 steps beats 1 and 3 drafts
    for _ in range(6):
        ln.update(ln.limit(), ln.limit())  # whole drafts kept: up to the configured length
    assert ln.limit() == 4
    with pytest.raises(ValueError, match="step_cost"):
        DraftLength(4, (0.1, 0.0))


def test_fit_step_cost_is_the_least_squares_line_of_the_relative_costs():
    fixed, row = 0.15, 0.1
    exact = {0: 20.0, **{k: 20.0 * (1 + fixed + row * k) for k in range(1, 5)}}
    assert fit_step_cost(exact) == pytest.approx((fixed, row), abs=1e-12)
    # noise around the line: the closed form against numpy's least squares
    noisy = {0: 10.0, 1: 12.9, 2: 13.1, 3: 15.2, 4: 15.9}
    slope, intercept = torch.linalg.lstsq(torch.tensor([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]],
                                                       dtype=torch.float64),
                                          torch.tensor([[0.29], [0.31], [0.52], [0.59]], dtype=torch.float64)
                                          ).solution.flatten().tolist()
    assert fit_step_cost(noisy) == pytest.approx((intercept, slope), abs=1e-12)
    assert fit_step_cost({0: 10.0, 1: 12.0, 2: 11.0}) == (pytest.approx(0.3), MIN_ROW)  # a slope <= 0
    with pytest.raises(ValueError, match="k=0"):
        fit_step_cost({1: 12.0, 2: 13.0})


def test_a_step_cost_file_applies_only_to_the_setup_it_was_measured_on(tmp_path):
    setup = {"device": "cpu", "cpu_model": "Some CPU", "dtype": "bfloat16", "quantization": "int4",
             "torch_threads": 2, "packed_linear": False}
    path = tmp_path / "step_cost.json"
    cost, why = step_cost_for(setup, path)
    assert cost == STEP_COST and why.startswith("unmeasured: no step_cost.json")
    path.write_text(json.dumps({"setup": setup, "step_cost": [0.05, 0.12]}))
    assert step_cost_for(setup, path) == ((0.05, 0.12), "measured by benchmarks/step_cost.py (step_cost.json)")
    cost, why = step_cost_for({**setup, "torch_threads": 1}, path)
    assert cost == STEP_COST and "torch_threads 2 there, 1 here" in why
    cost, why = step_cost_for({**setup, "packed_linear": True}, path)
    assert cost == STEP_COST and "packed_linear False there, True here" in why
    path.write_text(json.dumps({"setup": setup, "step_cost": [0.05, 0.0]}))
    with pytest.raises(ValueError, match="row > 0"):
        step_cost_for(setup, path)


def test_the_engine_drafts_with_its_setups_step_cost(spec_engine, tokenizer):
    """The engine's cost is what step_cost_for gives its setup, and a request's DraftLength uses it:
    at the prior (alpha 0.4) a cheap verification drafts at once, the constant's does not."""
    assert spec_engine.spec.step_cost == step_cost_for(spec_engine.step_cost_setup())[0]
    ids = tokenizer.encode(QUOTED)
    prompt = ids + ids[:12]  # its last tokens occurred before: the drafter has a continuation

    def first_draft(cost):
        kept, spec_engine.spec.step_cost = spec_engine.spec.step_cost, cost
        try:
            req = Request("step-cost", prompt, greedy(32))
            draft = spec_engine.spec.propose(req, 8)
            assert (req.speculative.length.fixed, req.speculative.length.row) == cost
            return draft
        finally:
            spec_engine.spec.step_cost = kept

    assert first_draft(STEP_COST) == []
    assert DraftLength(4, (0.0, 0.05)).k == 2       # 1.56 tokens for 1.1 steps: the best k at the prior
    assert first_draft((0.0, 0.05)) == ids[12:14]


def test_draft_length_stops_drafting_and_reprobes():
    ln = DraftLength(4)
    ln.update(1, 1)
    assert ln.k > 0                       # drafting
    while ln.k:                           # nothing accepted: no draft pays for its rows any more
        ln.update(ln.limit(), 0)
    assert ln.alpha < 0.5
    back_off = ln.probe_after
    assert back_off == 2 * DraftLength.PROBE_AFTER   # the failure that reached 0 doubled it
    limits = [ln.limit() for _ in range(back_off * 2)]
    assert [i for i, n in enumerate(limits) if n] == [back_off - 1, 2 * back_off - 1]   # one-token probes
    ln.update(1, 0)                       # a failed probe: the back-off doubles again
    assert ln.probe_after == 2 * back_off
    while not ln.k:                       # probes accepted: drafting resumes, the back-off resets
        ln.update(1, 1)
    assert ln.probe_after == DraftLength.PROBE_AFTER

def test_greedy_verify_takes_the_agreeing_prefix_and_the_models_next_token():
    logits = torch.tensor([[0., 5, 1], [9, 1, 1], [0, 0, 3]])
    g = greedy(8)
    assert verify(logits, [1, 0], g, None) == ([1, 0, 2], 2)
    assert verify(logits, [2, 0], g, None) == ([1], 0)
    assert verify(logits, [1, 1], g, None) == ([1, 0], 1)


def chi2_pvalue(observed, expected):
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
def test_sampled_verify_commits_tokens_distributed_as_the_model():
    """The first committed token is distributed as p0 whatever the draft; after an accepted first
    token, the second as p1: chi-square against the exact (temperature, top-k processed) probabilities."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6)
    probs = [torch.softmax(torch.where(row >= torch.topk(row, 6).values[-1], row / 0.8,
                                       torch.tensor(float("-inf"))), -1) for row in logits]
    g = torch.Generator().manual_seed(1)
    draft = [int(torch.argmax(probs[0])), int(torch.argsort(probs[1])[-2])]  # likely, then less likely
    firsts, seconds, accepted = Counter(), Counter(), Counter()
    N = 12000
    for _ in range(N):
        out, a = verify(logits, draft, params, g)
        assert len(out) == a + 1 and out[:a] == draft[:a]
        firsts[out[0]] += 1
        accepted[a] += 1
        if out[0] == draft[0]:
            seconds[out[1]] += 1
    for counts, p in ((firsts, probs[0]), (seconds, probs[1])):
        n = sum(counts.values())
        support = [t for t in range(8) if p[t] > 0]
        assert set(counts) <= set(support)         # never a token top-k removed
        assert chi2_pvalue([counts[t] for t in support], [n * float(p[t]) for t in support]) > 1e-3
    # acceptance as the standard rule has it: the first drafted token with probability p0(x)
    assert abs(accepted[0] / N - (1 - float(probs[0][draft[0]]))) < 0.02


# -- the engine: speculation off is the reference ---------------------------------------------------

@pytest.mark.slow
def test_greedy_batch_is_token_for_token_the_same(default_engine, spec_engine, tokenizer):
    """Requests that quote their context (drafts accepted) batched with ones that do not."""
    prompts = [quote(tokenizer, QUOTED), chat(tokenizer, "Name three animals that live in the ocean."),
               quote(tokenizer, QUOTED_2), chat(tokenizer, "What is the capital of France? Explain.")]
    params = greedy(96)
    before = spec_counts(spec_engine)
    ref = default_engine.generate(prompts, params)
    got = spec_engine.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [(r.text, r.finish_reason) for r in got] == [(r.text, r.finish_reason) for r in ref]
    drafted, accepted, verifications = (a - b for a, b in zip(spec_counts(spec_engine), before))
    assert accepted > 40 and verifications > 0            # the quoting requests really ran on drafts
    assert accepted / drafted > 0.5
    st = spec_engine.stats()
    assert st.spec_acceptance_rate > 0 and st.spec_mean_accepted_length > 1
    # a request with logprobs does not draft, and still matches
    lp = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    before = spec_counts(spec_engine)
    r_off, r_on = default_engine.generate([prompts[0]], lp)[0], spec_engine.generate([prompts[0]], lp)[0]
    assert r_on.token_ids == r_off.token_ids and len(r_on.logprobs) == 24
    assert spec_counts(spec_engine) == before


@pytest.mark.slow
def test_stops_inside_a_verified_draft(default_engine, spec_engine, tokenizer):
    """max_tokens at every length, stop strings and a stop token from the middle of a reply that
    copies its prompt: tokens after a stop are dropped exactly as without speculation."""
    prompt = quote(tokenizer, QUOTED)
    ref = default_engine.generate([prompt], greedy(60))[0]
    text = ref.text
    assert len(text) > 80
    stops = [text[40:46], text[70:73]]
    params = ([greedy(m) for m in range(1, 21)]
              + [greedy(60, stop=[s]) for s in stops]
              + [greedy(60, stop_token_ids=[ref.token_ids[17]])])
    before = spec_counts(spec_engine)
    off = default_engine.generate([prompt] * len(params), params)
    on = spec_engine.generate([prompt] * len(params), params)
    assert [(r.token_ids, r.text, r.finish_reason) for r in on] == \
        [(r.token_ids, r.text, r.finish_reason) for r in off]
    assert [len(r.token_ids) for r in on[:20]] == list(range(1, 21))
    assert all(r.finish_reason == "stop" for r in on[20:])
    assert spec_counts(spec_engine)[1] > before[1]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_preemption_with_a_tiny_pool(kv_cache_dtype):
    """Rolled-back drafts and preemptions, with pages of the activation dtype and 8-bit pages. float32
    pages: the tokens of the engine without speculation, exactly. 8-bit pages: a verification's K/V rows
    come from an extend batch, whose float32 sums differ in the last bits from a decode step's, and the
    8-bit rounding of a value on a step boundary then differs by a whole step, so a greedy near-tie can
    flip late in a reply (seen: one of six replies at token 35 of 40). Held: every reply complete, at
    least 4 of 6 identical, and none diverging in its first 20 tokens (a broken rollback or a page
    given to two sequences garbles a reply from the token it hits)."""
    cfg = dict(kv_cache_tokens=24 * 16 + 16, max_batched_tokens=64, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    off, on = LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg, speculative="ngram"))
    tok = off.tokenizer
    prompts = [quote(tok, f"{i} apples, {i + 1} pears, {i + 2} plums, {i} apples, {i + 1} pears.") for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref, got = off.generate(prompts, params), on.generate(prompts, params)
    assert all(len(r.token_ids) == 40 for r in got)
    if kv_cache_dtype == "auto":
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    else:
        same = [a.token_ids == b.token_ids for a, b in zip(got, ref)]
        assert sum(same) >= 4, same
        assert all(a.token_ids[:20] == b.token_ids[:20] for a, b in zip(got, ref))
    assert off.scheduler.num_preemptions > 0 and on.scheduler.num_preemptions > 0
    assert on.stats().spec_accepted_tokens_total > 0
    st = on.stats()
    assert st.running == 0 and st.pages_used == st.pages_cached


@pytest.mark.slow
def test_rollback_leaves_cache_and_pool_as_without_speculation(default_engine, spec_engine, tokenizer):
    prompts = [quote(tokenizer, QUOTED), quote(tokenizer, QUOTED_2), chat(tokenizer, "Tell me about owls.")]
    params = [greedy(70), greedy(50, stop=["limits"]), greedy(33)]
    states = []
    for engine in (default_engine, spec_engine):
        engine.flush_cache()
        engine.step()                                   # applies the flush
        residue = set(engine.cache.all_hashes())        # anything pinned by earlier tests stays
        free, cached = engine.pool.num_free, engine.cache.cached_pages
        engine.generate(prompts, params)
        hashes = sorted(set(engine.cache.all_hashes()) - residue)
        states.append((hashes, free - engine.pool.num_free, engine.cache.cached_pages - cached,
                       engine.pool.capacity - engine.pool.num_free - engine.cache.cached_pages))
    assert states[0] == states[1]
    assert states[0][0] and states[0][3] == 0           # pages went to the cache; nothing else held


@pytest.mark.slow
def test_sampled_output_keeps_its_distribution(default_engine, spec_engine, tokenizer):
    """Seeded sampled runs with and without speculation: the token frequencies match (chi-square), and
    since a verification draws one uniform per committed token, as sampling does, seeded requests
    draw the same tokens."""
    prompt = quote(tokenizer, QUOTED_2)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=s) for s in range(64)]
    before = spec_counts(spec_engine)
    off = default_engine.generate([prompt] * len(params), params)
    on = spec_engine.generate([prompt] * len(params), params)
    drafted, accepted, _ = (a - b for a, b in zip(spec_counts(spec_engine), before))
    assert accepted > 50 and drafted > accepted           # drafts were accepted and rejected
    same = sum(a.token_ids == b.token_ids for a, b in zip(off, on))
    assert same >= 0.97 * len(params)
    c_off = Counter(t for r in off for t in r.token_ids)
    c_on = Counter(t for r in on for t in r.token_ids)
    frequent = [t for t in c_off | c_on if c_off[t] + c_on[t] >= 10]
    rows = [[c[t] for t in frequent] + [sum(c.values()) - sum(c[t] for t in frequent)] for c in (c_off, c_on)]
    # two-sample chi-square (homogeneity), 2 x K
    total = [a + b for a, b in zip(*rows)]
    n = [sum(r) for r in rows]
    stat = sum((rows[i][k] - n[i] * total[k] / sum(n)) ** 2 / (n[i] * total[k] / sum(n))
               for i in range(2) for k in range(len(total)) if total[k])
    df = sum(1 for t in total if t) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    assert p > 1e-3, (stat, df)


def test_speculative_settings_are_checked():
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer from 1 to 16"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


# -- the tenant corpus (speculative="suffix") ----------------------------------------------------------

def reference_corpus_draft(outputs, tokens, k, max_ngram=4, min_ngram=2):
    """Brute force over the kept outputs: the longest suffix of ``tokens`` (``max_ngram`` down to
    ``min_ngram``) found inside one output with a token after it, at its latest occurrence (newest
    output, latest place) -> (n, up to ``k`` tokens that followed, to that output's end)."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        for out in reversed(outputs):
            for e in range(len(out) - 1, n - 1, -1):
                if out[e - n:e] == tokens[-n:]:
                    return n, out[e:e + k]
    return None


def test_corpus_matches_equal_brute_force_and_stay_bounded():
    rng = random.Random(11)
    max_tokens = 64
    corpus, kept = OutputCorpus(max_tokens), []
    for _ in range(300):
        ids = [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        corpus.add(ids)
        ids = ids[-(max_tokens // 2):]
        if len(ids) >= 3:   # the rule it keeps: oldest outputs dropped down to half, whole outputs only
            if sum(1 + len(o) for o in kept) + 1 + len(ids) > max_tokens:
                while kept and sum(1 + len(o) for o in kept) > max_tokens // 2 - len(ids) - 1:
                    kept.pop(0)
            kept.append(ids)
        assert len(corpus) <= max_tokens
        for _ in range(3):
            tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            want = reference_corpus_draft(kept, tokens, 6)
            got = corpus.match(tokens)
            assert (None if got is None else (got[1], corpus.draft_at(got[0], 6))) == want, (kept, tokens)


def test_corpus_follows_the_output_it_copies_and_tenants_stay_apart():
    corpus = OutputCorpus(256)
    corpus.add([1, 2, 3, 4, 5, 6, 7, 8])
    corpus.add([3, 4, 9, 9])                 # a later "3 4", followed by something else
    tokens = [20, 1, 2]
    e, n = corpus.match(tokens)
    assert (n, corpus.draft_at(e, 3)) == (2, [3, 4, 5])
    tokens += [3, 4]                         # two accepted, then the model wrote 4 -> "3 4" again
    follow = (e, 3)
    e2, n2 = corpus.match(tokens, follow)
    assert corpus.draft_at(e2, 4) == [5, 6, 7, 8] and n2 == 4   # still the first output, not "9 9"
    assert corpus.draft_at(corpus.match(tokens)[0], 4) == [5, 6, 7, 8]
    corpora = TenantCorpora(max_tenants=2, max_tokens=64)
    corpora.add("a", [1, 2, 3, 4])
    assert corpora.get("b") is None          # another cache salt never sees tenant a's outputs
    corpora.add("b", [5, 6, 7])
    corpora.get("a")                         # a used last: b is the least recently used
    corpora.add("c", [8, 9, 10])
    assert corpora.get("b") is None and corpora.get("a") is not None and corpora.get("c") is not None


def run_one(engine, prompt, params, cache_salt="", constraint=None):
    rid = engine.add_request(prompt, params, cache_salt=cache_salt, constraint=constraint)
    ids, out = [], None
    while out is None or not out.finished:
        for o in engine.step():
            if o.request_id == rid:
                ids += o.token_ids
                out = o
    return ids, out


@pytest.mark.slow
def test_suffix_drafts_from_the_tenants_earlier_replies(default_engine, spec_engine, tokenizer):
    """A question another session of the same tenant asked before (another system prompt, so
    nothing of the reply is in the prompt): drafts come from the earlier reply, the output is
    the output without speculation, and a tenant with another cache salt drafts nothing from it."""
    q = "Describe the life cycle of a star, from nebula to its end."
    first = encode_chat(tokenizer, [{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": q}])
    again = encode_chat(tokenizer, [{"role": "system", "content": "You are a helpful assistant for a school."},
                                    {"role": "user", "content": q}])
    params = greedy(64)

    def measured(engine, salt):
        before = spec_counts(engine)
        ids, _ = run_one(engine, again, params, cache_salt=salt)
        return ids, [a - b for a, b in zip(spec_counts(engine), before)]

    run_one(spec_engine, first, params, cache_salt="tenant-a")
    results = {("suffix", salt): measured(spec_engine, salt) for salt in ("tenant-a", "tenant-b")}
    # prompt lookup alone: drafts from the request's own context, whatever ran before and whatever its salt
    ngram = LLMEngine(EngineConfig(kv_cache_tokens=8192, max_batched_tokens=256, speculative="ngram"))
    results["ngram"] = measured(ngram, "tenant-a")
    ref = default_engine.generate([again], params)[0].token_ids
    assert all(ids == ref for ids, _ in results.values())
    accepted = {key: counts[1] for key, (_, counts) in results.items()}
    # the same tenant drafts from its earlier reply; without the corpus that reply is not there
    assert accepted["suffix", "tenant-a"] > accepted["ngram"] + 16
    # another tenant drafts exactly as prompt lookup alone does
    assert results["suffix", "tenant-b"][1] == results["ngram"][1]


@pytest.mark.slow
def test_draft_rows_cap_bounds_every_step(default_engine, spec_engine, tokenizer):
    """With a cap on a step's rows (what quantized weights set), no step with drafts passes it
    and the output is unchanged."""
    prompts = [quote(tokenizer, QUOTED), quote(tokenizer, QUOTED_2), quote(tokenizer, QUOTED[:400])]
    params = greedy(48)
    steps = []
    prepare = spec_engine.runner.prepare

    def spy(batch, source=None):
        steps.append((sum(batch.num_new), sum(len(d) for d in batch.drafts.values())))
        return prepare(batch, source)
    spec_engine.runner.prepare, spec_engine.scheduler.draft_rows_cap = spy, 5
    try:
        got = spec_engine.generate(prompts, params)
    finally:
        spec_engine.runner.prepare, spec_engine.scheduler.draft_rows_cap = prepare, None
    assert [r.token_ids for r in got] == [r.token_ids for r in default_engine.generate(prompts, params)]
    drafted = [(rows, d) for rows, d in steps if d]
    assert drafted and all(rows + d <= 5 for rows, d in drafted)
    assert max(rows + d for rows, d in drafted) == 5          # the cap is used, not just respected


# -- constrained requests draft too --------------------------------------------------------------------

QUOTE_SCHEMA = {"type": "json_schema", "json_schema": {"name": "quote", "strict": True, "schema": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
    "additionalProperties": False}}}


@pytest.mark.slow
def test_constrained_requests_draft_and_match_decoding_without_drafts(default_engine, spec_engine, tokenizer):
    """A JSON reply quoting its prompt: drafts the grammar accepts are verified under the grammar's
    mask at every position; the output is token for token the output without speculation, with
    room to spare and closed under a tight max_tokens."""
    prompt = chat(tokenizer, "Reply with JSON {\"text\": ...} holding the following text exactly:\n\n" + QUOTED_2)
    for max_tokens in (96, 30, 17):
        params = greedy(max_tokens)
        ref = run_one(default_engine, prompt, params, constraint=constraint_for_request(
            tokenizer, response_format=QUOTE_SCHEMA))
        before = spec_counts(spec_engine)
        got = run_one(spec_engine, prompt, params, constraint=constraint_for_request(
            tokenizer, response_format=QUOTE_SCHEMA))
        drafted, accepted, _ = (a - b for a, b in zip(spec_counts(spec_engine), before))
        assert got[0] == ref[0], max_tokens
        assert (got[1].finish_reason, got[1].stop_reason) == (ref[1].finish_reason, ref[1].stop_reason)
        json.loads(tokenizer.decode(got[0], skip_special_tokens=True))
        if max_tokens == 96:
            assert accepted > 10                           # drafts really ran under the grammar
    # a drafted token the grammar refuses ends the draft before it
    c = constraint_for_request(tokenizer, response_format=QUOTE_SCHEMA)
    open_obj = tokenizer.encode('{"text": "')
    assert c.valid_prefix(open_obj + tokenizer.encode('hi"}') + tokenizer.encode("{")) == len(
        open_obj + tokenizer.encode('hi"}'))
    assert c.valid_prefix(tokenizer.encode("hello")) == 0
    assert c.valid_prefix(open_obj) == len(open_obj) and c.accept(open_obj[0])   # the state was not moved


@pytest.mark.slow
def test_a_draft_that_completes_a_tool_call_ends_it(default_engine, spec_engine, tokenizer):
    """A named tool call asked twice: the second drafts the whole call from the first's reply
    (the corpus), tokens past the call's end included; the output stops where the call
    completes, as without drafts (found as a served reply cut at "</tool")."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}]
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "What is the weather in Paris?"}], tools)

    def call(engine):
        c = constraint_for_request(tokenizer, tools=tools, tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, parallel_tool_calls=False)
        return run_one(engine, prompt, greedy(40), cache_salt="tools", constraint=c)
    ref_ids, ref = call(default_engine)
    call(spec_engine)
    before = spec_counts(spec_engine)
    ids, out = call(spec_engine)
    accepted = spec_counts(spec_engine)[1] - before[1]
    assert ids == ref_ids and (out.finish_reason, out.stop_reason) == (ref.finish_reason, ref.stop_reason)
    assert tokenizer.decode(ids, skip_special_tokens=False).rstrip().endswith("</tool_call>")
    assert accepted >= len(ids) // 2      # the call came from drafts
