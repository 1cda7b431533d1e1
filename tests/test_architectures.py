"""Every architecture speculates (issue 20): tiny random models of thirteen mlx-lm architectures — full attention,
sliding windows and hybrids — with windows of 8–32, prompts longer than the window and chunked prefill. Every applicable
source gives plain greedy decoding's tokens, with no fall-back and rounds running after the ring has wrapped; sources
that cannot read a target are refused at `check`, naming the architecture."""

import random
import mlx.core as mx, pytest
from specnb import generate, spec_generate
from specnb.models import model_from_config, perturbed
from specnb.models import tiny_hybrid
from specnb.tap import text_model
from specnb.sources.chain import random_head
from specnb.sources.eagle3 import random_eagle3
from specnb.sources.dflash import random_dflash
from specnb.sources.dspark import random_dspark
from specnb.sources.registry import KINDS, make_provider

SLIDING = {  # each architecture's own keys, on top of the shared tiny shape (as in nbs/04a_sliding_window.ipynb)
    "llama": dict(layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma3_text": dict(sliding_window_pattern=2, query_pre_attn_scalar=16),
    "gpt_oss": dict(
        layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4, num_experts_per_tok=2
    ),
    "cohere2": dict(sliding_window_pattern=2),
    "gemma4_text": dict(
        sliding_window_pattern=2, global_head_dim=16, num_kv_shared_layers=2, hidden_size_per_layer_input=0
    ),
}
FULL = {"qwen3": dict(rope_theta=1e4, max_position_embeddings=512)}
HYBRID = [
    "qwen3_5",
    "qwen3_next",
    "lfm2",
    "nemotron_h",
    "mamba2",
    "falcon_h1",
    "granitemoehybrid",
    "recurrent_gemma",
    "mamba",
    "jamba",
    "rwkv7",
    "kimi_linear",
    "plamo2",
    "lfm2_moe",
    "olmo_hybrid",
    "bailing_moe_linear",
    "gear",
]
ARCHS = [*SLIDING, *FULL, *HYBRID]
# the sources that read the target, where they can (nbs/05d_early_exit.ipynb, nbs/05e_head.ipynb); the rest refuse at
# `check`
EARLY_EXIT = {
    "llama",
    "qwen3",
    "gemma3_text",
    "gpt_oss",
    "cohere2",
    "qwen3_5",
    "qwen3_next",
    "granitemoehybrid",
    "kimi_linear",
    "gear",
    "olmo_hybrid",
}
# and EAGLE-3, DFlash (nbs/05m_eagle3.ipynb, 05q_dflash.ipynb); Gemma 4's layers return a tuple, led by the hidden state
HEAD = {
    "gemma4_text",
    "llama",
    "qwen3",
    "gemma3_text",
    "gpt_oss",
    "cohere2",
    "qwen3_5",
    "qwen3_next",
    "granitemoehybrid",
    "kimi_linear",
    "gear",
    "olmo_hybrid",
    # their decoder under `backbone`, read through `specnb.tap.text_model`'s view of it
    "nemotron_h",
    "mamba2",
    "mamba",
}


def windowed(arch: str) -> bool:
    return arch in SLIDING or arch == "recurrent_gemma"


_models = {}


def models(arch: str, window: int):
    """A random `arch` target (its window `window` where it slides), a perturbed copy of it as the draft, and a random
    head, EAGLE-3, DFlash and DSpark drafter for it."""
    key = (arch, window if windowed(arch) else None)
    if key not in _models:
        if arch in HYBRID:
            m = tiny_hybrid(arch, **(dict(attention_window_size=window) if arch == "recurrent_gemma" else {}))
        else:
            cfg = dict(
                model_type=arch,
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
                **SLIDING.get(arch, FULL.get(arch)),
            )
            if arch in SLIDING:
                cfg["sliding_window"] = window
            m = model_from_config(cfg)
        head = random_head(m, [0, 1], hidden_size=32, intermediate_size=64) if arch in HEAD else None
        # hidden_states 1 and 2: the outputs of layers 0 and 1
        eagle = random_eagle3(m, [1, 2]) if arch in HEAD else None
        dflash = random_dflash(m, [0, 1], block_size=16) if arch in HEAD else None
        dspark = random_dspark(m, [0, 1], block_size=8) if arch in HEAD else None
        _models[key] = m, perturbed(m, 0.05), head, eagle, {"dflash": dflash, "dspark": dspark}
    return _models[key]


def sources(arch: str) -> list:
    "The registry's draft kinds that apply to `arch`."
    out = ["two-model", "ngram", "two-model+lookup"]
    if arch in EARLY_EXIT:
        out += ["early-exit", "early-exit+lookup"]
    if arch in HEAD:
        out += ["head", "head+lookup", "eagle3", "dflash", "dspark"]
    return out


def prompt_for(rng: random.Random, window: int) -> list:
    "A prompt several windows long that repeats itself (so prompt lookup finds matches)."
    part = [rng.randrange(128) for _ in range(window // 2 + 3)]
    return (part * 5)[: 2 * window + rng.randrange(1, window)]


def check_case(arch, source, window, gamma, step, prompt, max_tokens=24):
    "One gate case: `source` on `arch` equals plain greedy decoding, never falls back, and runs rounds."
    target, draft, head, eagle, blocks = models(arch, window)
    plain = generate(target, prompt, max_tokens=max_tokens, prefill_step_size=step).tokens
    prov = make_provider(
        source,
        draft if KINDS[source].needs_draft else None,
        target=target,
        num_draft_tokens=gamma,
        **KINDS[source].pick(
            exit_layer=1, draft_head=head, draft_model=blocks.get(source, eagle), ngram_min=1, ngram_max=3
        ),
    )
    r = spec_generate(target, prov, prompt, num_draft_tokens=gamma, max_tokens=max_tokens, prefill_step_size=step)
    assert r.tokens == plain, (arch, source, window, gamma, step)
    # the prompt alone is longer than the window
    assert r.stats.fallback_at is None and r.stats.rounds > 0, (arch, source, r.stats)


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture(arch, request):
    """Each applicable source once on `arch`, with a window, γ and prefill chunk drawn from a fixed seed (the quick
    suite's sample of the sweep below)."""
    if request.config.getoption("--slow"):
        pytest.skip(
            "with --slow, test_architecture_sweep checks every source on every architecture at two γ and two windows"
        )
    rng = random.Random(ARCHS.index(arch))
    window = rng.choice([8, 12, 16, 24, 32])
    prompt = prompt_for(rng, window)
    for source in sources(arch):
        check_case(arch, source, window, rng.randint(1, 5), rng.randint(3, window - 1), prompt)


@pytest.mark.parametrize("arch", sorted(set(ARCHS) - (EARLY_EXIT & HEAD)))
def test_refusals(arch):
    """Early exit, the head, EAGLE-3, DFlash and DSpark (alone or behind prompt lookup) refuse, at `check`, a target
    whose layers they cannot read, naming its architecture."""
    target, llama = models(arch, 8)[0], models("llama", 8)[0]
    head, eagle = random_head(llama, [0, 1], hidden_size=32), random_eagle3(llama, [1, 2])
    sized = target if hasattr(text_model(target), "args") else llama  # PLaMo 2 keeps `config`
    # sized for the target: refused for how its layers are built, not for its sizes
    blocks = {
        "dflash": random_dflash(sized, [0, 1], block_size=8),
        "dspark": random_dspark(sized, [0, 1], block_size=8),
    }
    kinds = [
        k
        for k, ok in (
            ("early-exit", arch in EARLY_EXIT),
            ("head", arch in HEAD),
            ("eagle3", arch in HEAD),
            ("dflash", arch in HEAD),
            ("dspark", arch in HEAD),
        )
        if not ok
    ]
    for kind in kinds + [k + "+lookup" for k in kinds]:
        with pytest.raises(ValueError, match=arch):
            make_provider(
                kind,
                target=target,
                **KINDS[kind].pick(exit_layer=1, draft_head=head, draft_model=blocks.get(kind.split("+")[0], eagle)),
            )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_sweep(arch):
    """Every applicable source on two windows (8 and 32 where the model slides) with two prefill chunks, at one γ per
    source and window that cycles through 1..5 over the architectures: each source meets every γ across the sweep (the
    whole grid of γ, source and architecture cost 5x, for CI time)."""
    rng = random.Random(100 + ARCHS.index(arch))
    for w, window in enumerate((8, 32) if windowed(arch) else (16,)):
        prompt = prompt_for(rng, window)
        for k, source in enumerate(sources(arch)):
            gamma = 1 + (ARCHS.index(arch) + k + 2 * w) % 5
            check_case(arch, source, window, gamma, rng.choice([3, window - 1]), prompt, max_tokens=20)


@pytest.mark.parametrize("arch", list(SLIDING))
def test_batched_sliding(arch):
    """Batched rounds on each sliding-window architecture (issue 31), window 8: five requests of 2 to 40 tokens, three
    at a time, joining mid-stream, with two-model, prompt lookup and plain decoding — each request's tokens and `fed`
    equal `spec_generate` alone."""
    from specnb.batching.rounds import spec_generate_batch
    from specnb.sources.ngram import NgramProvider
    from specnb.sources.two_model import TwoModelProvider

    target, draft, *_ = models(arch, 8)
    rng = random.Random(list(SLIDING).index(arch))
    prompts = [prompt_for(rng, 20)[:n] for n in (2, 9, 17, 26, 40)]
    provs = [TwoModelProvider(draft), NgramProvider(), TwoModelProvider(draft), None, NgramProvider()]
    opts = [
        dict(num_draft_tokens=g, max_tokens=n, prefill_step_size=s)
        for g, n, s in zip([3, 2, 5, 1, 4], [20, 17, 24, 12, 22], [5, 7, 4, 6, 9])
    ]
    alone = [spec_generate(target, p, x, **o) for p, x, o in zip(provs, prompts, opts)]
    batched = spec_generate_batch(target, provs, prompts, options=opts, max_batch_size=3, interleave_prefill=True)
    assert [(r.tokens, r.fed) for r in batched] == [(r.tokens, r.fed) for r in alone], arch


def batched_equals_alone(target, provs: list, seed: int):
    """Six requests of 2 to 40 tokens on `target`, drafting with `provs` (one each), three at a time, joining
    mid-stream, greedy and seeded sampled: each request's tokens, accepted lengths, finish reason and `fed` equal
    `spec_generate` alone."""
    from specnb import Sampling
    from specnb.batching.rounds import spec_generate_batch

    rng = random.Random(seed)
    prompts = [prompt_for(rng, 20)[:n] for n in (2, 9, 17, 26, 33, 40)]
    opts = [
        dict(num_draft_tokens=g, max_tokens=n, prefill_step_size=s)
        for g, n, s in zip([3, 2, 5, 1, 4, 6], [20, 17, 24, 12, 22, 15], [5, 7, 4, 6, 9, 8])
    ]
    key = lambda r: (r.tokens, r.stats.accepted_lengths, r.finish_reason, r.fed)
    for sampler, seeds in ((None, [None] * 6), (Sampling(temp=0.9), list(range(20, 26)))):
        alone = []
        for p, x, o, s in zip(provs, prompts, opts, seeds):
            if s is not None:
                mx.random.seed(s)
            alone.append(spec_generate(target, p, x, sampler=sampler, **o))
        batched = spec_generate_batch(
            target,
            provs,
            prompts,
            options=opts,
            seeds=seeds,
            sampler=sampler,
            max_batch_size=3,
            interleave_prefill=True,
        )
        assert [key(r) for r in batched] == [key(r) for r in alone], sampler


# Batched rounds on every hybrid and recurrent family (greedy and seeded sampled, requests joining mid-stream, each
# equal to its run alone) are nbs/04e_ragged_state.ipynb's gate, over `specnb.models.HYBRIDS`; this file does
# not run them again.


def test_batched_recurrent_refused():
    """A layer whose recurrent state batched rounds cannot hold per row (Baichuan-M1's attention, keeping state beside
    its KV cache) is refused up front, naming it."""
    from specnb.batching.rounds import check_batchable

    cfg = dict(
        model_type="baichuan_m1",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e4,
        sliding_window=8,
        sliding_window_layers=[0],
        conv_window=2,
        rms_norm_eps=1e-6,
    )
    with pytest.raises(ValueError, match="baichuan_m1.Attention"):
        check_batchable(model_from_config(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(EARLY_EXIT))
@pytest.mark.parametrize("exit_layer", [1, 2])
def test_batched_early_exit(arch, exit_layer):
    """Early exit in batched rounds (issue 31), window 8 where the target slides: each request drafts on its own row of
    the target's caches and equals its run alone — or, where its first layers keep recurrent state (a row of which a
    batch keeps only over the whole verify forward), it is refused naming that layer."""
    from specnb.sources.early_exit import EarlyExitProvider
    from specnb.sources.ngram import NgramProvider
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    target, *_ = models(arch, 8)
    recurrent = any(isinstance(c, ArraysCache) for c in make_prompt_cache(target)[:exit_layer])
    ee = EarlyExitProvider(exit_layer)
    try:
        batched_equals_alone(target, [ee, NgramProvider(), ee, None, ee, ee], sorted(EARLY_EXIT).index(arch))
    except ValueError as e:
        assert recurrent and "a recurrent layer" in str(e), (arch, e)
    else:
        assert not recurrent, arch


@pytest.mark.slow
@pytest.mark.parametrize("window", [4, 8, 16])
def test_batched_assistant(window, tmp_path):
    """Gemma 4's assistant in batched rounds (issue 31) on a tiny random gemma4_text target of sliding window `window`:
    each request equals its run alone."""
    from specnb.sources.assistant import AssistantProvider, random_assistant, tiny_gemma4
    from specnb.sources.ngram import NgramProvider

    target = tiny_gemma4(window=window)
    a = AssistantProvider(random_assistant(target, tmp_path))
    batched_equals_alone(target, [a, NgramProvider(), a, None, a, a], window)
    assert type(target.model.norm).__name__ == "RMSNorm"  # every request closed: the target reads its own norm again
