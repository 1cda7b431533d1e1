"""Property test of the executor: any model (random llamas with and without a sliding window, gemma3_text and gpt_oss
with windows, Qwen3.5 and Qwen3-Next hybrids), draft source, prompt, γ, max_tokens, EOS and halting point gives plain
greedy's tokens and a consistent cache — and a follow-up turn on the saved target and draft caches gives a fresh run's
tokens."""

import mlx.core as mx
from hypothesis import assume, given, settings, strategies as st, HealthCheck
from mlx_lm.models.cache import make_prompt_cache
from specnb import spec_generate, generate, Sampling
from specnb.sources.registry import KINDS, make_provider
from specnb.sources.chain import load_head, random_head
from specnb.models import random_model, perturbed

from test_architectures import EARLY_EXIT, HEAD, models as arch_models

# drawn too: random llamas, sliding windows of 16, hybrids
ARCHS = ["llama", "gemma3_text", "gpt_oss", "qwen3_5", "qwen3_next"]

_cache = {}


def models(seed, window, noise, arch="llama"):
    """A random `arch` target and its draft (`noise`: how far it is perturbed; 0: the target itself). Only llamas vary
    with `seed` and `window`."""
    key = (seed, window, noise) if arch == "llama" else (arch, noise)
    if key not in _cache:
        t = random_model(seed, scale=4, sliding_window=window) if arch == "llama" else arch_models(arch, 16)[0]
        _cache[key] = (t, t if noise == 0 else perturbed(t, noise, seed=seed + 7))
    return _cache[key]


def head_for(target, seed, arch="llama"):
    """An untrained draft head on layers 0 and 1 of a random target (drafts mostly rejected; the trained one is tested
    below); odd seeds draft from 40 random tokens only."""
    key = ("head", arch, seed)
    if key not in _cache:
        _cache[key] = random_head(
            target, [0, 1], seed=seed, hidden_size=32, intermediate_size=64, draft_vocab=40 * (seed % 2)
        )
    return _cache[key]


def provider(kind, target, draft, seed, adaptive=False, gamma=3, arch="llama", **ngram):
    """The registry's provider of draft kind `kind` on random models: `draft` for the two-model kinds, an untrained
    head, early exit at layer 1."""
    k = KINDS[kind]
    head = head_for(target, seed, arch) if "draft_head" in k.reads else None
    return make_provider(
        kind,
        draft if k.needs_draft else None,
        adaptive=adaptive,
        num_draft_tokens=gamma,
        **k.pick(exit_layer=1, draft_head=head, **ngram),
    )


def applies(kind, arch) -> bool:
    """Whether draft kind `kind` can serve `arch` (early exit and the head refuse some architectures at `check`:
    tests/test_architectures.py)."""
    return not (
        kind.startswith("early-exit") and arch not in EARLY_EXIT or kind.startswith("head") and arch not in HEAD
    )


MODEL_KINDS = ["two-model", "ngram", "early-exit", "head", "two-model+lookup", "head+lookup"]  # registry names


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(ARCHS),
    seed=st.integers(0, 3),
    window=st.sampled_from([None, 16]),
    noise=st.sampled_from([0.0, 0.03, 0.1, 1.0]),
    prompt=st.lists(st.integers(0, 127), min_size=1, max_size=24),
    gamma=st.integers(1, 6),
    max_tokens=st.integers(1, 30),
    halt=st.one_of(st.none(), st.integers(1, 30)),
    eos=st.one_of(st.none(), st.integers(0, 127)),
    source=st.sampled_from([(k, False) for k in MODEL_KINDS] + [("two-model", True)]),
    ngram=st.tuples(st.integers(1, 2), st.integers(0, 3)),
    follow=st.lists(st.integers(0, 127), min_size=1, max_size=6),
)
def test_spec_equals_plain(arch, seed, window, noise, prompt, gamma, max_tokens, halt, eos, source, ngram, follow):
    kind, adaptive = source  # adaptive: draft length adapted per round
    assume(applies(kind, arch))
    target, draft = models(seed, window, noise, arch)
    eos_ids = [] if eos is None else [eos]
    plain = generate(target, prompt, max_tokens=max_tokens, eos_token_ids=eos_ids)
    cache, seen = make_prompt_cache(target), []

    def on_token(t):
        seen.append(t)
        return halt is None or len(seen) < halt

    make = lambda: provider(
        kind, target, draft, seed, adaptive, gamma, arch, ngram_min=ngram[0], ngram_max=ngram[0] + ngram[1]
    )
    res = spec_generate(
        target,
        make(),
        prompt,
        num_draft_tokens=gamma,
        max_tokens=max_tokens,
        eos_token_ids=eos_ids,
        prompt_cache=cache,
        on_token=on_token,
    )
    expected = plain.tokens if halt is None else plain.tokens[:halt]
    assert res.tokens == expected == seen
    # a consumer that stops listening at token `halt` ends the request before it can end by itself
    assert res.finish_reason == (None if halt is not None and halt <= len(plain.tokens) else plain.finish_reason)
    assert eos is None or eos not in res.tokens
    # the cache holds the prompt and exactly the fed tokens; never more than were emitted
    assert all(c.offset == len(prompt) + res.fed for c in cache)
    assert res.fed <= len(res.tokens) and res.fed >= len(res.tokens) - 1
    s = res.stats
    assert s.accepted <= s.drafted and sum(s.accepted_lengths) == s.accepted and sum(s.drafted_by_pos) == s.drafted
    # the source's saved caches hold the same tokens; a follow-up turn on both caches equals a fresh run
    held = prompt + res.tokens[: res.fed]
    # (a head's saved cache keeps the newest position as a row, waiting for the token after it)
    if res.draft_cache is not None:
        assert all(c.offset + (getattr(c, "row", None) is not None) == len(held) for c in res.draft_cache)
    new = res.tokens[res.fed :] + follow
    again = spec_generate(
        target,
        make(),
        new,
        num_draft_tokens=gamma,
        max_tokens=8,
        eos_token_ids=eos_ids,
        prompt_cache=cache,
        cached_tokens=held,
        draft_cache=res.draft_cache,
    )
    assert again.tokens == generate(target, held + new, max_tokens=8, eos_token_ids=eos_ids).tokens


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(ARCHS),
    seed=st.integers(0, 3),
    window=st.sampled_from([None, 16]),
    prompt=st.lists(st.integers(0, 127), min_size=1, max_size=24),
    gamma=st.integers(1, 6),
    max_tokens=st.integers(1, 30),
    halt=st.one_of(st.none(), st.integers(1, 30)),
    eos=st.one_of(st.none(), st.integers(0, 127)),
    rule=st.sampled_from(["match", "rejection"]),
    source=st.sampled_from(MODEL_KINDS),
    temp=st.sampled_from([0.5, 1.0, 1.5]),
    top_p=st.sampled_from([0.0, 0.9]),
    top_k=st.sampled_from([0, 5]),
    draw=st.integers(0, 2**16),
)
def test_sampled_rounds_keep_the_invariant(
    arch, seed, window, prompt, gamma, max_tokens, halt, eos, rule, source, temp, top_p, top_k, draw
):
    """Sampling under either rule: exact max_tokens and halting, no EOS emitted, a cache holding prompt + fed,
    consistent stats, reproducible."""
    assume(applies(source, arch))
    target, draft = models(seed, window, 0.1, arch)
    # before seeding: a random head draws from the generator too
    made = provider(source, target, draft, seed, arch=arch, ngram_min=2 if source == "head+lookup" else 1)

    def run():
        mx.random.seed(draw)
        cache, seen = make_prompt_cache(target), []

        def on_token(t):
            seen.append(t)
            return halt is None or len(seen) < halt

        r = spec_generate(
            target,
            made,
            prompt,
            num_draft_tokens=gamma,
            max_tokens=max_tokens,
            eos_token_ids=[] if eos is None else [eos],
            sampler=Sampling(temp=temp, top_p=top_p, top_k=top_k),
            acceptance=rule,
            prompt_cache=cache,
            on_token=on_token,
        )
        return r, cache, seen

    res, cache, seen = run()
    assert res.tokens == seen and len(res.tokens) <= min(max_tokens, halt or max_tokens)
    assert eos is None or eos not in res.tokens
    assert res.finish_reason in ("stop", "length", None) and (
        res.finish_reason != "length" or len(res.tokens) == max_tokens
    )
    assert all(c.offset == len(prompt) + res.fed for c in cache) and len(res.tokens) - 1 <= res.fed <= len(res.tokens)
    s = res.stats
    assert (
        s.rule == rule
        and s.accepted <= s.drafted
        and sum(s.accepted_lengths) == s.accepted
        and sum(s.drafted_by_pos) == s.drafted
    )
    assert run()[0].tokens == res.tokens  # the same seed, the same tokens


_bundled = {}


def bundled_head():
    "The bundled target, the head trained for it, and a held-out source file's tokens to cut prompts from."
    if not _bundled:
        import copy, mlx_lm
        from pathlib import Path
        from specnb.models import bundled_dir

        target, tok = mlx_lm.load(str(bundled_dir("target")))
        text = Path(copy.__file__).read_text()  # a file held out from the target's and the head's training
        _bundled.update(target=target, head=load_head(), ids=tok.encode(text), eos=list(tok.eos_token_ids))
    return _bundled


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    start=st.integers(0, 1500),
    plen=st.integers(1, 48),
    gamma=st.integers(1, 6),
    max_tokens=st.integers(1, 40),
    halt=st.one_of(st.none(), st.integers(1, 40)),
    follow=st.integers(1, 6),
    lookup=st.booleans(),
)
def test_trained_head_equals_plain(start, plen, gamma, max_tokens, halt, follow, lookup):
    """The shipped head on the bundled target (alone, or behind prompt lookup), where most drafts are accepted: plain
    greedy's tokens, the cache invariant, a follow-up turn."""
    b = bundled_head()
    target, prompt, eos = b["target"], b["ids"][start : start + plen], b["eos"]
    made = make_provider("head+lookup" if lookup else "head", target=target, draft_head=b["head"])
    plain = generate(target, prompt, max_tokens=max_tokens, eos_token_ids=eos)
    cache, seen = make_prompt_cache(target), []

    def on_token(t):
        seen.append(t)
        return halt is None or len(seen) < halt

    res = spec_generate(
        target,
        made,
        prompt,
        num_draft_tokens=gamma,
        max_tokens=max_tokens,
        eos_token_ids=eos,
        prompt_cache=cache,
        on_token=on_token,
    )
    assert res.tokens == (plain.tokens if halt is None else plain.tokens[:halt]) == seen
    assert all(c.offset == len(prompt) + res.fed for c in cache)
    s = res.stats
    assert s.accepted <= s.drafted and sum(s.accepted_lengths) == s.accepted and sum(s.accepted_by_pos) == s.accepted
    held = prompt + res.tokens[: res.fed]
    new = res.tokens[res.fed :] + b["ids"][start + plen : start + plen + follow]
    assert [c.offset + (c.row is not None) for c in res.draft_cache] == [len(held)]
    again = spec_generate(
        target,
        made,
        new,
        num_draft_tokens=gamma,
        max_tokens=8,
        eos_token_ids=eos,
        prompt_cache=cache,
        cached_tokens=held,
        draft_cache=res.draft_cache,
    )
    assert again.tokens == generate(target, held + new, max_tokens=8, eos_token_ids=eos).tokens
