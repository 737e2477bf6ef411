"""Generation engines: the static-cache engine against the dynamic cache, the sampler, make_generator."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from nitrobrew.hf.generation import (  # noqa: E402
    DynamicCacheGenerator,
    GenerationStats,
    Sampling,
    StaticCacheGenerator,
    make_generator,
)
from nitrobrew.hf.generation.sampler import NUCLEUS_CANDIDATES, processed_logits, sample  # noqa: E402
from tiny_models import causal_lm  # noqa: E402

V = 96


def qwen2(seed=0):
    # the head scaled by 8: peaked rows, greedy ties are out of reach of rounding
    return causal_lm("Qwen2", vocab=V, hidden=32, positions=256, tie=False, seed=seed)


def prompts(batch=3, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[min(1, batch - 1), :3] = 0
    mask[-1, : length - 2] = 0  # a short prompt, left-padded
    return ids, mask


@pytest.mark.parametrize("batch,length", [(3, 7), (1, 5), (5, 20)])
def test_static_greedy_equals_dynamic_greedy(batch, length):
    """Bucketed shapes (batch and prompt padded, filler rows) change nothing: token for token."""
    model = qwen2()
    ids, mask = prompts(batch, length)
    s = Sampling(max_new_tokens=24, temperature=0.0, pad_token_id=0)
    want = DynamicCacheGenerator(model).generate(ids, mask, s)
    got = StaticCacheGenerator(model, prompt_bucket=16, cache_bucket=32).generate(ids, mask, s)
    assert torch.equal(got.ids, want.ids)
    assert got.decode_steps == 24 and got.logprobs.shape == got.ids.shape
    assert bool((got.logprobs <= 0).all())


def test_static_eos_masks_and_pads_like_dynamic():
    model = qwen2(1)
    ids, mask = prompts()
    s = Sampling(max_new_tokens=20, temperature=0.0, pad_token_id=0)
    free = DynamicCacheGenerator(model).generate(ids, mask, s)
    eos = int(free.ids[0, 3])  # a token row 0 emits
    s = Sampling(max_new_tokens=20, temperature=0.0, pad_token_id=0, eos_token_id=eos)
    want = DynamicCacheGenerator(model).generate(ids, mask, s)
    got = StaticCacheGenerator(model, prompt_bucket=8, cache_bucket=16, check_every=2).generate(ids, mask, s)
    n = want.ids.shape[1]
    assert torch.equal(got.ids[:, :n], want.ids) and torch.equal(got.mask[:, :n], want.mask)
    assert bool((got.ids[:, n:] == 0).all()) and int(got.mask[:, n:].sum()) == 0


def test_compiled_decode_reuses_its_graph():
    """One graph per (batch, cache length) bucket; prompts of other lengths in the bucket compile nothing."""
    model = qwen2()
    engine = StaticCacheGenerator(model, compile=True, compile_backend="eager", prompt_bucket=16, cache_bucket=32)
    s = Sampling(max_new_tokens=8, temperature=0.0, pad_token_id=0)
    stats = GenerationStats()
    ref = DynamicCacheGenerator(model)
    for batch, length in ((3, 7), (4, 9), (3, 12), (2, 5)):  # batch buckets 4, 4, 4, 2
        ids, mask = prompts(batch, length)
        c = engine.generate(ids, mask, s)
        assert torch.equal(c.ids, ref.generate(ids, mask, s).ids)
        stats.add(c)
    assert engine.compiles >= 1 and engine.recompiles == 0
    assert stats.calls == 4 and stats.compiles == engine.compiles and stats.recompiles == 0


def test_static_sampling_is_seeded_and_sleep_frees_the_cache():
    model = qwen2()
    engine = make_generator("static", model, prompt_bucket=8, cache_bucket=16)
    assert isinstance(engine, StaticCacheGenerator)
    ids, mask = prompts()
    s = Sampling(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, pad_token_id=0)
    torch.manual_seed(3)
    a = engine.generate(ids, mask, s)
    assert engine._caches
    engine.sleep()
    assert not engine._caches
    engine.wake()
    torch.manual_seed(3)
    b = engine.generate(ids, mask, s)
    torch.manual_seed(4)
    c = engine.generate(ids, mask, s)
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)


def test_auto_and_options():
    model = qwen2()
    assert isinstance(make_generator("auto", model), DynamicCacheGenerator)  # CPU: the dynamic cache
    with pytest.raises(ValueError, match="generation_backend"):
        make_generator("fast", model)
    with pytest.raises(ValueError, match="prompt_bucket"):
        make_generator("static", model, prompt_bucket=0)


def test_sync_weights_into_a_copy():
    """A generator on a copy of the student (asynchronous rollouts) follows the student after sync_weights."""
    student = qwen2(0)
    engine = StaticCacheGenerator(copy.deepcopy(student), prompt_bucket=8, cache_bucket=16)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids, mask = prompts()
    s = Sampling(max_new_tokens=10, temperature=0.0, pad_token_id=0)
    want = DynamicCacheGenerator(student).generate(ids, mask, s)
    assert not torch.equal(engine.generate(ids, mask, s).ids, want.ids)
    engine.sync_weights(student)
    got = engine.generate(ids, mask, s)
    assert torch.equal(got.ids, want.ids) and got.weight_version == 1


# ---------------------------------------------------------------------------------------------- sampler


def reference_filter(logits, s: Sampling):
    """transformers' processors (temperature, top-k, top-p, min-p) on float32 logits."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = logits.float()
    for proc in (
        TemperatureLogitsWarper(s.temperature),
        TopKLogitsWarper(s.top_k) if s.top_k else None,
        TopPLogitsWarper(s.top_p) if s.top_p < 1 else None,
        MinPLogitsWarper(s.min_p) if s.min_p > 0 else None,
    ):
        if proc is not None:
            x = proc(None, x)
    return x


def dense(x, cand, V):
    return x if cand is None else torch.full((x.shape[0], V), float("-inf")).scatter(1, cand, x)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(top_k=50),
        dict(top_p=0.8),
        dict(top_k=200, top_p=0.95),
        dict(top_p=0.9, min_p=0.05),
        dict(min_p=0.2, temperature=1.3),
    ],
)
def test_filters_keep_what_transformers_keeps(settings):
    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * 3
    logits[0] = torch.randn(3000) * 0.01  # flat: the nucleus spans more than the candidates
    s = Sampling(**{"temperature": 1.0, **settings})
    got, cand = processed_logits(logits, s)
    got = dense(got, cand, logits.shape[1])
    want = reference_filter(logits, s)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])
    if settings.get("top_p", 1) < 1 and "top_k" not in settings:
        assert int(torch.isfinite(got[0]).sum()) > NUCLEUS_CANDIDATES  # the full-sort fallback was taken


def test_sample_draws_from_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).expand(40000, 5)
    s = Sampling(temperature=1.0, top_k=3)
    tok, lp = sample(logits, s)
    p = torch.softmax(logits[0, :3], -1)
    freq = torch.bincount(tok, minlength=5).float() / tok.numel()
    torch.testing.assert_close(freq[:3], p, atol=0.01, rtol=0)
    assert int(freq[3:].sum()) == 0
    torch.testing.assert_close(lp, p.log()[tok])


def test_caches_kept_are_bounded():
    model = qwen2()
    engine = StaticCacheGenerator(model, prompt_bucket=8, cache_bucket=16, max_caches=2)
    s = Sampling(max_new_tokens=4, temperature=0.0, pad_token_id=0)
    for batch in (1, 2, 4, 2):
        engine.generate(*prompts(batch, 6), s)
    assert list(engine._caches) == [(4, 16), (2, 16)]  # the two most recently used buckets


def test_repetition_penalty_as_transformers():
    """Greedy under a repetition penalty (prompts without padding: transformers also penalizes pad ids)."""
    model = qwen2(2)
    ids = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    s = Sampling(max_new_tokens=16, temperature=0.0, pad_token_id=0, repetition_penalty=1.5)
    want = DynamicCacheGenerator(model).generate(ids, mask, s)
    got = StaticCacheGenerator(model, prompt_bucket=8, cache_bucket=16).generate(ids, mask, s)
    assert torch.equal(got.ids, want.ids)
    plain = DynamicCacheGenerator(model).generate(ids, mask, Sampling(max_new_tokens=16, temperature=0.0))
    assert not torch.equal(plain.ids, want.ids)  # the penalty changed something


def test_logprobs_are_those_of_the_sampling_distribution():
    """The static engine's log-probs: log softmax of the processed logits (T, top-k) at the sampled tokens,
    as a teacher-forced forward of the prompt and the completion gives them."""
    model = qwen2(3).eval()
    ids, mask = prompts(2, 6)
    mask[:] = 1
    s = Sampling(max_new_tokens=8, temperature=0.7, top_k=20, pad_token_id=0, seed=1)
    c = StaticCacheGenerator(model, prompt_bucket=8, cache_bucket=16).generate(ids, mask, s)
    full = torch.cat([ids, c.ids], 1)
    with torch.no_grad():
        logits = model(full).logits[:, ids.shape[1] - 1 : -1].float()
    filtered = reference_filter(logits.reshape(-1, V), s).reshape(logits.shape)
    want = torch.log_softmax(filtered, -1).gather(-1, c.ids[..., None])[..., 0]
    torch.testing.assert_close(c.logprobs, want, rtol=1e-4, atol=1e-4)


def test_decode_attention_runs_on_the_key_value_heads():
    """One query token, grouped heads: decode_attention == transformers' SDPA (which repeats the cache), on a
    padding mask; the engine switches the model to it for the call only."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from nitrobrew.hf.generation.static_engine import decode_attention

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[1, ..., :4] = False  # a left-padded row
    got, _ = decode_attention(module, q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, want)
    assert got.shape == (2, 1, 6, 8)

    model = qwen2()
    assert model.config._attn_implementation == "sdpa"
    ids, mask = prompts()
    s = Sampling(max_new_tokens=12, temperature=0.0, pad_token_id=0)
    packed = StaticCacheGenerator(model, prompt_bucket=8, cache_bucket=16).generate(ids, mask, s)
    assert model.config._attn_implementation == "sdpa"  # restored
    repeated = StaticCacheGenerator(model, prompt_bucket=8, cache_bucket=16, gqa_decode=False).generate(ids, mask, s)
    assert torch.equal(packed.ids, repeated.ids)


def test_a_deep_copy_compiles_its_own_decode_step():
    """transformers caches torch.compile(self.__call__) on the model: a deepcopy (the asynchronous replica) must
    not decode with the original's weights through it."""
    model = qwen2()
    ids, mask = prompts()
    s = Sampling(max_new_tokens=8, temperature=0.0, pad_token_id=0)
    StaticCacheGenerator(model, compile=True, compile_backend="eager", prompt_bucket=16, cache_bucket=32).generate(
        ids, mask, s
    )
    assert "_compiled_call" in model.__dict__
    replica = copy.deepcopy(model)
    with torch.no_grad():
        replica.lm_head.weight.copy_(qwen2(seed=1).lm_head.weight)
    engine = StaticCacheGenerator(replica, compile=True, compile_backend="eager", prompt_bucket=16, cache_bucket=32)
    want = DynamicCacheGenerator(replica).generate(ids, mask, s)
    assert not torch.equal(want.ids, DynamicCacheGenerator(model).generate(ids, mask, s).ids)
    assert torch.equal(engine.generate(ids, mask, s).ids, want.ids)
