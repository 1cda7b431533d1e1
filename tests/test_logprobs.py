"""Property test of log-probabilities: any random target (full attention or a sliding window), draft, prompt, γ, sampler
and rule, logits processors, number of alternatives, prefill chunking and halting point — each emitted token's entry is
teacher forcing's (one forward over the prompt and the emitted tokens, each row through the processors with its own
history) and each prompt token's is one full forward's, within 1e-5 (float32)."""

import mlx.core as mx
from hypothesis import given, settings, strategies as st, HealthCheck
from mlx_lm.sample_utils import make_logits_processors
from specnb import spec_generate, generate, Sampling
from specnb.sources.two_model import TwoModelProvider
from specnb.sources.ngram import NgramProvider
from specnb.oracle import forced_logprobs, logprobs_diff
from specnb.models import random_model, perturbed

_cache = {}


def models(seed, window):
    "A random target and a draft perturbed from it."
    if (seed, window) not in _cache:
        t = random_model(seed, scale=4, sliding_window=window)
        _cache[seed, window] = t, perturbed(t, 0.05, seed=seed + 7)
    return _cache[seed, window]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 1),
    window=st.sampled_from([None, 16]),
    prompt=st.lists(st.integers(0, 127), min_size=1, max_size=20),
    gamma=st.integers(1, 5),
    max_tokens=st.integers(1, 16),
    top=st.integers(0, 4),
    step=st.sampled_from([1, 3, 2048]),
    source=st.sampled_from(["two-model", "ngram", None]),
    rule=st.sampled_from([None, "match", "rejection"]),
    penalty=st.booleans(),
    halt=st.one_of(st.none(), st.integers(1, 16)),
    rng=st.integers(0, 2**32 - 1),
)
def test_logprobs_are_teacher_forcings(
    seed, window, prompt, gamma, max_tokens, top, step, source, rule, penalty, halt, rng
):
    target, draft = models(seed, window)
    procs = make_logits_processors(repetition_penalty=1.5) if penalty else None
    sampling = dict(sampler=Sampling(temp=1.0), acceptance=rule) if rule else {}
    seen = []

    def on_token(t):
        seen.append(t)
        return halt is None or len(seen) < halt

    opts = dict(
        max_tokens=max_tokens,
        logprobs=top,
        prompt_logprobs=top,
        prefill_step_size=step,
        logits_processors=procs,
        on_token=on_token,
    )
    mx.random.seed(rng)
    if source is None:
        res = generate(target, prompt, **opts, **({"sampler": sampling["sampler"]} if rule else {}))
    else:
        provider = TwoModelProvider(draft) if source == "two-model" else NgramProvider()
        res = spec_generate(target, provider, prompt, num_draft_tokens=gamma, **opts, **sampling)
    assert len(res.logprobs) == len(res.tokens) == len(seen)
    assert all(len(tops) == top for _, tops in res.logprobs)
    assert logprobs_diff(res.logprobs, forced_logprobs(target, prompt, res.tokens, top, procs)) < 1e-5
    assert logprobs_diff(res.prompt_logprobs, [None] + forced_logprobs(target, prompt[:1], prompt[1:], top)) < 1e-5
