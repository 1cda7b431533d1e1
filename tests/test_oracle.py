"""The correctness gates of the executor against its oracles (`specnb.oracle`), over more cases than the notebooks run:
mlx-lm's `speculative_generate_step` and plain greedy decoding."""

import random
import pytest
from specnb import spec_generate, generate, TwoModelProvider
from specnb.oracle import mlx_lm_tokens, mlx_lm_spec_tokens, first_diff, near_tie
from specnb.models import random_model, perturbed, load_pair

SEEDS, PROMPT_LENS, GAMMAS = (0, 1, 2, 3), (1, 2, 7, 600), (1, 2, 3, 5)
_models = {}


def pair(seed, noise=0.05):
    if (seed, noise) not in _models:
        t = random_model(seed, scale=4)
        _models[seed, noise] = (t, perturbed(t, noise, seed=100 + seed))
    return _models[seed, noise]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("plen", PROMPT_LENS)
def test_random_models_match_mlx_lm_and_plain(seed, plen):
    target, draft = pair(seed)
    rng = random.Random(1000 * seed + plen)
    prompt = [rng.randrange(128) for _ in range(plen)]
    plain = generate(target, prompt, max_tokens=32).tokens
    assert plain == mlx_lm_tokens(target, prompt, 32), (seed, plen)
    for g in GAMMAS:
        ours = spec_generate(
            target, TwoModelProvider(draft), prompt, num_draft_tokens=g, max_tokens=32, prefill_step_size=512
        )
        assert ours.tokens == mlx_lm_spec_tokens(target, draft, prompt, g, 32, 512), (seed, plen, g)
        assert ours.tokens == plain, (seed, plen, g)
        assert ours.stats.drafted > 0


BUNDLED_PROMPTS = [
    "import os\nimport sys\n\n",
    "def __init__(self, ",
    'class Queue:\n    """',
    "    for i in range(len(",
    "# Copyright (C) 2001 Python Software Foundation\n",
    "if __name__ == '__main__':\n    ",
]


@pytest.mark.parametrize("text", BUNDLED_PROMPTS)
def test_bundled_pair_matches_mlx_lm(text):
    p = load_pair()
    prompt = p.tokenizer.encode(text)
    plain = generate(p.target, prompt, max_tokens=48).tokens
    for g in GAMMAS:
        ours = spec_generate(
            p.target, TwoModelProvider(p.draft), prompt, num_draft_tokens=g, max_tokens=48, prefill_step_size=512
        )
        assert ours.tokens == mlx_lm_spec_tokens(p.target, p.draft, prompt, g, 48, 512), (text, g)
        i = first_diff(ours.tokens, plain)
        # plain greedy reads one token per forward, a verify window several: only a near tie may differ
        assert i is None or near_tie(p.target, prompt + plain[:i]), (text, g, i)


def test_sliding_window_targets_match_plain():
    for seed in range(4):
        target = random_model(seed, sliding_window=12, num_layers=4, scale=4)
        draft = perturbed(target, 0.05, seed=seed)
        for plen in (1, 5, 11, 30):
            prompt = list(range(2, 2 + plen))
            plain = generate(target, prompt, max_tokens=40).tokens
            for g in (1, 3, 5):
                ours = spec_generate(target, TwoModelProvider(draft), prompt, num_draft_tokens=g, max_tokens=40)
                assert ours.tokens == plain, (seed, plen, g)
                assert ours.stats.fallback_at is None and ours.stats.rounds > 0  # speculation past the window (04a)


def test_every_source_on_the_bundled_pair_matches_plain():
    from specnb import NgramProvider, EarlyExitProvider, AdaptiveProvider

    p = load_pair()
    providers = {
        "ngram": lambda: NgramProvider(),
        "early-exit L=2": lambda: EarlyExitProvider(2),
        "early-exit L=4": lambda: EarlyExitProvider(4),
        "adaptive two-model": lambda: AdaptiveProvider(TwoModelProvider(p.draft)),
        "two-model p_min": lambda: TwoModelProvider(p.draft, p_min=0.4),
    }
    for text in BUNDLED_PROMPTS[:3]:
        prompt = p.tokenizer.encode(text)
        plain = generate(p.target, prompt, max_tokens=40).tokens
        for name, make in providers.items():
            for g in (2, 5):
                ours = spec_generate(p.target, make(), prompt, num_draft_tokens=g, max_tokens=40).tokens
                i = first_diff(ours, plain)
                assert i is None or near_tie(p.target, prompt + plain[:i]), (text, name, g, i)
