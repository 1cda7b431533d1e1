"""Property test of batched rounds (#31): on any architecture the batch takes — full attention, sliding windows of 8,
hybrid and recurrent layers — requests of any length joining at any round (a batch smaller than the request count,
prompts read a chunk per round), with any γ, any mix of sources, greedy or seeded sampled: every request's tokens,
accepted lengths (so every rollback length), finish reason and `fed` equal `spec_generate` alone."""

import mlx.core as mx
from hypothesis import given, settings, strategies as st, HealthCheck
from specnb import spec_generate, Sampling
from specnb.batching.rounds import spec_generate_batch
from specnb.sources.ngram import NgramProvider
from specnb.sources.two_model import TwoModelProvider
from test_architectures import models

# windows of 8 where they slide
ARCHS = ["llama", "gemma3_text", "gpt_oss", "qwen3_5", "lfm2", "mamba2", "nemotron_h", "recurrent_gemma", "falcon_h1"]


def provider(kind: str, draft):
    return {"two-model": lambda: TwoModelProvider(draft), "ngram": NgramProvider, "plain": lambda: None}[kind]()


request = st.tuples(
    st.lists(st.integers(0, 127), min_size=1, max_size=30),  # prompt
    st.sampled_from(["two-model", "ngram", "plain"]),
    st.integers(1, 6),
    st.integers(1, 20),
    st.integers(2, 9),
)  # γ, max_tokens, prefill step


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(ARCHS),
    requests=st.lists(request, min_size=2, max_size=5),
    size=st.integers(1, 3),
    sampled=st.booleans(),
    eos=st.one_of(st.none(), st.integers(0, 127)),
)
def test_batched_equals_alone(arch, requests, size, sampled, eos):
    target, draft, *_ = models(arch, 8)
    prompts = [r[0] for r in requests]
    provs = [provider(r[1], draft) for r in requests]
    opts = [dict(num_draft_tokens=g, max_tokens=n, prefill_step_size=s) for _, _, g, n, s in requests]
    seeds = list(range(len(requests))) if sampled else [None] * len(requests)
    common = dict(sampler=Sampling(temp=0.9) if sampled else None, eos_token_ids=() if eos is None else (eos,))
    key = lambda r: (r.tokens, r.stats.accepted_lengths, r.finish_reason, r.fed)
    alone = []
    for p, x, o, s in zip(provs, prompts, opts, seeds):
        if s is not None:
            mx.random.seed(s)
        alone.append(key(spec_generate(target, p, x, **o, **common)))
    batched = spec_generate_batch(
        target,
        [provider(r[1], draft) for r in requests],
        prompts,
        options=opts,
        seeds=seeds,
        max_batch_size=size,
        interleave_prefill=True,
        **common,
    )
    assert [key(r) for r in batched] == alone
