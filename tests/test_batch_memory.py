"""What the server reserves for a batched request covers what its row really holds, on the caches that do not grow with
the text (#31): a sliding-window layer's ring is bounded by its window, a recurrent layer's state is constant per
row."""

import pytest
import mlx.core as mx
from specnb.batching.rounds import Batch
from specnb.models import random_model
from specnb.models import tiny_hybrid
from specnb.sources.ngram import NgramProvider
from specnb.serve.memory import held_by, measure_footprints


def peak_bytes(model, prompts: list, max_tokens: int) -> int:
    "The most bytes the batch's target caches held at a round boundary, serving `prompts` together with prompt lookup."
    batch, peak = Batch(model), 0
    for i, p in enumerate(prompts):
        batch.add(p, NgramProvider(), id=i, max_tokens=max_tokens, num_draft_tokens=3)
    while len(batch):
        batch.step()
        peak = max(peak, sum(c.nbytes for c in batch.cache))
    batch.close()
    return peak


MODELS = {
    "sliding": lambda: random_model(seed=0, num_layers=4, sliding_window=16),  # even layers see 16 tokens
    "full": lambda: random_model(seed=0, num_layers=4),
    "hybrid": lambda: tiny_hybrid("qwen3_next"),
}


@pytest.mark.parametrize("arch", MODELS)
def test_reserved_covers_the_batch(arch):
    """Four requests of 40–160 prompt tokens: the batch's peak is within the reservations the server holds for them, and
    a window or a state keeps them small."""
    model = MODELS[arch]()
    target, _ = measure_footprints(model, NgramProvider())
    lengths, max_tokens = [40, 90, 120, 160], 24
    prompts = [[(7 * i + j) % 100 + 1 for j in range(n)] for i, n in enumerate(lengths)]  # repeats: lookup drafts
    # the Engine's estimate at γ 3: 4 positions verified a round
    reserved = [target.bytes(n + max_tokens + 4, 4) for n in lengths]
    peak = peak_bytes(model, prompts, max_tokens)
    assert 0 < peak <= held_by(reserved), (peak, held_by(reserved))


def test_windows_and_states_are_reserved_as_such():
    """A sliding layer reserves its window, not the text; a recurrent layer its constant state — at 2,000 tokens the
    reservations show it."""
    full, _ = measure_footprints(MODELS["full"](), NgramProvider())
    sliding, _ = measure_footprints(MODELS["sliding"](), NgramProvider())
    hybrid, _ = measure_footprints(MODELS["hybrid"](), NgramProvider())
    # 2 of 4 layers keep ~16 positions
    assert sliding.bytes(2000) < 0.6 * full.bytes(2000), (sliding.bytes(2000), full.bytes(2000))
    assert sliding.bytes(4000) - sliding.bytes(2000) <= 0.5 * (full.bytes(4000) - full.bytes(2000))
    # Gated DeltaNet state: constant; only its 2 attention layers grow
    assert hybrid.fixed == hybrid.state > 0 and len(hybrid.terms) == 2
    assert hybrid.bytes(2000, 4) == hybrid.bytes(2000) + 5 * hybrid.state and sliding.state == full.state == 0


def test_reserved_covers_a_recurrent_draft_group():
    """A draft model with recurrent layers keeps its rows' windows of a round (04e's history): its reservation at twice
    the verify width covers its group's peak."""
    from specnb.models import perturbed
    from specnb.sources.two_model import TwoModelProvider

    model = MODELS["hybrid"]()
    prov = TwoModelProvider(perturbed(model, 0.02))
    _, draft = measure_footprints(model, prov)
    lengths, max_tokens = [40, 90, 120, 160], 24
    batch, peak = Batch(model), 0
    for i, n in enumerate(lengths):
        batch.add([(5 * i + j) % 100 + 1 for j in range(n)], prov, id=i, max_tokens=max_tokens, num_draft_tokens=3)
    while len(batch):
        batch.step()
        peak = max(peak, sum(c.nbytes for g in batch.groups.values() for c in g.cache))
    batch.close()
    reserved = [draft.bytes(n + max_tokens + 4, 8) for n in lengths]  # the Engine's estimate of the draft at γ 3
    assert draft.state > 0 and 0 < peak <= held_by(reserved), (peak, held_by(reserved))
