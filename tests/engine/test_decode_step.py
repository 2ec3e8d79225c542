"""The one-call decode step (engine/models/decode_step.py) against the Python layer loop it replaces.

Both make the same kernel calls on the same values, so the logits must be equal bit for bit, in float32 and
in bfloat16 activations, on pages of their dtype and on int8 KV pages, at one row, at several rows of
different context lengths, over a shared prefix and for a verification's rows (attention called back into
the backend); the steps it does not take (a prefill chunk, more rows than the blocks multiply) fall back to
that loop.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention.cpu_kernel import load as load_attention
from engine.models import decode_step
from engine.models import qlinear
from engine.models.qlinear import prefill_on_blocks
from engine.models.qmatmul import load as load_qmatmul
from engine.request import Request
from engine.scheduler import ScheduledBatch

pytestmark = pytest.mark.skipif(load_qmatmul() is None or load_attention() is None or decode_step._library() is None,
                                reason="no C compiler: the kernels could not be built")


# (activations, KV pages): float32 is what ``--dtype auto`` runs on a CPU without native bf16, bfloat16 on one with
@pytest.fixture(scope="module", params=[("float32", "float32"), ("float32", "int8"), ("bfloat16", "bfloat16"),
                                        ("bfloat16", "int8")], ids=lambda p: "-".join(p))
def engine(request):
    dtype, kv_dtype = request.param
    with pytest.MonkeyPatch.context() as mp:   # keeps the dense weights: a test switches prefill back to them
        mp.setattr(qlinear, "RELEASE_DENSE", False)
        eng = LLMEngine(EngineConfig(dtype=dtype, quantization="gguf", kv_cache_tokens=4096, kv_cache_dtype=kv_dtype))
    yield eng
    eng.close()


class Counting:
    """The model's DecodeStep, counting the steps it ran (returned hidden states) and declined."""

    def __init__(self, step) -> None:
        self.step, self.ran, self.declined = step, 0, 0

    def __call__(self, *args):
        out = self.step(*args)
        if out is None:
            self.declined += 1
        else:
            self.ran += 1
        return out


def batch_of(engine: LLMEngine, ctx_lens: list[int], new: list[int] | None = None, shared: int = 0,
             drafts: int = 0, seed: int = 0) -> ScheduledBatch:
    """One sequence per context length, each with its last ``new`` tokens (default 1: decoding) to compute;
    the first ``shared`` tokens (whole pages) on pages they all share; ``drafts`` tokens drafted after the
    first sequence's last one, to verify."""
    P = engine.config.page_size
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    common = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    common_pages = engine.pool.alloc(shared // P)
    new = new or [1] * len(ctx_lens)
    reqs = []
    for i, (ctx, n) in enumerate(zip(ctx_lens, new)):
        req = Request(f"r{i}", common + torch.randint(0, vocab, (ctx - shared,), generator=gen).tolist(),
                      SamplingParams(max_tokens=1))
        req.pages = common_pages + engine.pool.alloc(-(-(ctx + (drafts if i == 0 else 0) - shared) // P))
        req.num_computed = ctx - n
        reqs.append(req)
    draft = {0: torch.randint(0, vocab, (drafts,), generator=gen).tolist()} if drafts else {}
    return ScheduledBatch(reqs, new, draft)


def both_paths(engine: LLMEngine, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, Counting]:
    """The step's logits with the one-call step on (counted), then with the Python loop (the same KV
    written again by the same RoPE + store)."""
    model = engine.runner.model
    step = model.decode_step
    counting = Counting(step)
    try:
        model.decode_step = counting
        fast = engine.runner.run(batch)[0].clone()
        model.decode_step = None
        ref = engine.runner.run(batch)[0].clone()
    finally:
        model.decode_step = step
        engine.pool.free(sorted({p for req in batch.requests for p in req.pages}))
    return fast, ref, counting


def test_on_for_steps_on_blocks(engine, default_engine):
    assert engine.runner.model.decode_step is not None
    assert engine.active_kernels["decode_step"]
    assert engine.stats().cpu_kernels["decode_step"]
    # the float32 dense reference engine keeps its torch layers
    assert default_engine.runner.model.decode_step is None and not default_engine.active_kernels["decode_step"]
    assert "the C layer ops are off" == decode_step.eligible(default_engine.runner.model)


CASES = {"b1": dict(ctx_lens=[64]), "b3_mixed": dict(ctx_lens=[300, 17, 129]),
         "b8": dict(ctx_lens=[40, 80, 120, 160, 200, 240, 280, 33]),
         # rows over a prefix they share (an agent's system prompt): the cascade, attention called back
         "b3_shared_prefix": dict(ctx_lens=[200, 210, 220], shared=128),
         # a verification of 3 drafts: 4 rows of one sequence, over the same pages
         "verify": dict(ctx_lens=[150], drafts=3)}


@pytest.mark.parametrize("case", list(CASES))
def test_same_logits_as_the_python_loop(engine, case):
    fast, ref, counting = both_paths(engine, batch_of(engine, **CASES[case]))
    assert counting.ran == 1 and counting.declined == 0
    assert torch.equal(fast, ref), f"largest difference {(fast - ref).abs().max().item()}"
    rows = len(CASES[case]["ctx_lens"]) + CASES[case].get("drafts", 0)   # a logits row per verified token
    assert fast.shape == (rows, engine.model_config.vocab_size) and torch.isfinite(fast).all()


def test_an_error_in_the_called_back_attention_reaches_the_caller(engine, monkeypatch):
    """A shared-prefix step calls the backend's attention from C: an exception there stops the step and is
    raised to the caller as it was, not swallowed by ctypes."""
    backend = engine.runner.attn
    real = backend.forward

    def failing(layer, q, k, v):
        if layer == 5:
            raise ValueError("planted failure in layer 5")
        return real(layer, q, k, v)

    batch = batch_of(engine, [200, 210, 220], shared=128)
    monkeypatch.setattr(backend, "forward", failing)
    try:
        with pytest.raises(ValueError, match="planted failure in layer 5"):
            engine.runner.run(batch)
    finally:
        engine.pool.free(sorted({p for req in batch.requests for p in req.pages}))


def test_greedy_generation_unchanged(engine):
    """A whole generation (prefill through the Python loop, decode steps in one call) gives the tokens it
    gives with the Python loop alone."""
    prompt = engine.tokenizer.encode("List three prime numbers and say why each is prime.")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    model = engine.runner.model
    step = model.decode_step
    counting = Counting(step)
    try:
        model.decode_step = counting
        fast = engine.generate([prompt], params)[0].token_ids
        model.decode_step = None
        ref = engine.generate([prompt], params)[0].token_ids
    finally:
        model.decode_step = step
    assert counting.ran >= 20
    assert fast == ref and len(fast) == 24


def test_a_step_with_a_prefill_chunk_takes_the_python_loop(engine):
    fast, ref, counting = both_paths(engine, batch_of(engine, [96, 50], new=[1, 50]))
    assert counting.ran == 0 and counting.declined == 1    # the backend reports no C decode rows
    assert torch.equal(fast, ref)


@pytest.mark.parametrize("on_blocks", [False, True])
def test_rows_past_the_blocks_limit_follow_the_projections(engine, on_blocks):
    """9 rows: past MAX_QUANT_ROWS the Python loop's projections multiply the dense weights unless prefill
    runs on the blocks (``prefill_on_blocks``, picked by measurement): the one-call step declines exactly
    when they go dense."""
    model = engine.runner.model
    before = model.layers[0].self_attn.qkv_proj.max_rows
    prefill_on_blocks(model, on_blocks)
    try:
        fast, ref, counting = both_paths(engine, batch_of(engine, [40 + 10 * i for i in range(9)]))
    finally:
        prefill_on_blocks(model, before is None)
    assert (counting.ran, counting.declined) == ((1, 0) if on_blocks else (0, 1))
    assert torch.equal(fast, ref)


def test_pools_it_reads(engine):
    """Pages of the activations' dtype or int8, HSD, no sliding-window pages: a pool of the other float dtype
    (the Python path converts q to the pool's dtype and back) or another layout is declined."""
    from engine.kv_pool import KVCache
    step, cfg = engine.runner.model.decode_step, engine.model_config
    act = engine.runner.model.embed_tokens.weight.dtype
    other = torch.float32 if act is torch.bfloat16 else torch.bfloat16

    def pool(**kw):
        args = dict(num_layers=cfg.num_layers, num_pages=4, page_size=engine.config.page_size,
                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=act, device="cpu", layout="HSD")
        return KVCache(**{**args, **kw})

    assert step.supports(pool()) and step.supports(pool(kv_dtype=torch.int8))
    assert not step.supports(pool(kv_dtype=other))
    assert not step.supports(pool(layout="NHD"))
    assert not step.supports(pool(window_layers=(1,), window_pages=2))
