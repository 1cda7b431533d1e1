"""The seam holds: every shipped draft source and wrapper has exactly the `DraftSource`/`DraftProvider` signatures, and
the protocol declares exactly what the executor passes — checked by running the executor on a source that records its
calls."""

import inspect, tempfile
import pytest
from mlx_lm.models.cache import make_prompt_cache
from specnb import spec_generate
from specnb.models import random_model, perturbed
from specnb.sources.base import DraftProvider, DraftSource, NoDraft, TargetView, protocol_mismatches
from specnb.sources.chain import random_head
from specnb.sources.eagle3 import random_eagle3
from specnb.sources.mtp import random_mtp_checkpoint, tiny_mtp_target
from specnb.sources.assistant import random_assistant, tiny_gemma4
from specnb.sources.dflash import random_dflash
from specnb.sources.dspark import random_dspark
from specnb.sources.registry import KINDS, make_provider

TARGET = random_model(0, scale=4)
DRAFT = perturbed(TARGET, 0.1, seed=1)
HEAD = random_head(TARGET, [0, 1], hidden_size=32, intermediate_size=64)
MTP_TARGET, GEMMA4 = tiny_mtp_target("deepseek_v3"), tiny_gemma4()
CHECKPOINTS = {
    "eagle3": random_eagle3(TARGET, [1, 2]),
    "mtp": random_mtp_checkpoint(MTP_TARGET, tempfile.mkdtemp()),
    "assistant": random_assistant(GEMMA4, tempfile.mkdtemp()),
    "dflash": random_dflash(TARGET, [0, 1], block_size=4),
    "dspark": random_dspark(TARGET, [0, 1], block_size=4),
}  # published drafters, each for a target it fits
TARGETS = {"mtp": MTP_TARGET, "assistant": GEMMA4}


def shipped(kind, adaptive=False):
    "The registry's provider for `kind` on the random target (a published drafter's on its own)."
    k = KINDS[kind]
    return make_provider(
        kind,
        DRAFT if k.needs_draft else None,
        adaptive=adaptive,
        **k.pick(exit_layer=1, draft_head=HEAD, draft_model=CHECKPOINTS.get(kind.split("+")[0])),
    )


PROVIDERS = {
    **{k: lambda k=k: shipped(k) for k in KINDS if k != "none"},
    **{f"adaptive {k}": lambda k=k: shipped(k, adaptive=True) for k in KINDS if k != "none"},
    "NoDraft": NoDraft,
}


@pytest.mark.parametrize("name", list(PROVIDERS))
def test_shipped_sources_conform(name):
    provider = PROVIDERS[name]()
    target = TARGETS.get(name.removeprefix("adaptive ").split("+")[0], TARGET)
    source = provider.open(target=TargetView(target, make_prompt_cache(target)))
    assert protocol_mismatches(provider, DraftProvider) == []
    assert protocol_mismatches(source, DraftSource) == []
    source.close()


def test_a_drifted_source_is_caught():
    class Drifted(NoDraft):
        def commit(self, d, k, ctx=None):
            pass  # a parameter no caller passes

        def save(self, held):
            return []  # misses the anchor_hidden the executor passes a tapped source

    assert protocol_mismatches(Drifted()) == [
        "commit(d, k, ctx=None) should be commit(d, k)",
        "save(held) should be save(held, anchor_hidden=None)",
    ]


class Recorder:
    """A provider and source in one that drafts nothing and records every call the executor makes: (method, args,
    kwargs)."""

    def __init__(self, tap_layers=None):
        self.tap_layers, self.calls = tap_layers, []

    def __getattr__(self, name):
        if name not in ("open", "prefill", "draft", "draft_logprobs", "commit", "save", "close"):
            raise AttributeError(name)

        def call(*args, **kw):
            self.calls.append((name, args, kw))
            return {"open": self, "draft": [], "draft_logprobs": None, "save": []}.get(name)

        return call


def test_the_protocol_declares_exactly_what_the_executor_passes():
    """Each call binds to the protocol's signature (nothing undeclared is passed), and every declared parameter is
    passed by some call."""
    calls = []
    for taps in (None, [0]):  # a tapped source is handed rows, at `draft` and at `save`
        for prompt, cached in (([1, 2, 3, 4], None), ([5], [1, 2, 3])):  # a plain prompt; a follow-up turn
            rec, cache = Recorder(taps), make_prompt_cache(TARGET)
            if cached:
                spec_generate(TARGET, None, cached, max_tokens=1, prompt_cache=cache)
            spec_generate(TARGET, rec, prompt, max_tokens=6, prompt_cache=cache, cached_tokens=cached)
            calls += rec.calls
    used = set()
    for name, args, kw in calls:
        proto = DraftProvider.open if name == "open" else getattr(DraftSource, name)
        # a TypeError: the executor passes what the protocol does not declare
        bound = inspect.signature(proto).bind(None, *args, **kw)
        used |= {(name, p) for p in bound.arguments if p != "self"}
    declared = {
        (n, p)
        for n, f in [
            ("open", DraftProvider.open),
            *((m, getattr(DraftSource, m)) for m in ("prefill", "draft", "draft_logprobs", "commit", "save", "close")),
        ]
        for p in list(inspect.signature(f).parameters)[1:]
    }
    assert declared - used == set(), f"declared but never passed by the executor: {sorted(declared - used)}"


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_drafters_in_batched_rounds(kind):
    """DFlash and DSpark sources draft per request inside batched rounds (their target forwards batched): every
    request's output is its plain greedy decoding, and each drafted."""
    from specnb.batching.rounds import spec_generate_batch
    from specnb.executor import generate

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    results = spec_generate_batch(TARGET, shipped(kind), prompts, max_tokens=16)
    assert [r.tokens for r in results] == [generate(TARGET, p, max_tokens=16).tokens for p in prompts]
    assert all(r.stats.drafted > 0 for r in results)
