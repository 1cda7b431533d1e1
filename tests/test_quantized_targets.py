"""Drafters on quantized targets (issue #43): every way mlx-lm quantizes a model — affine, and the microscaling formats
mxfp4, mxfp8 and nvfp4, whose scales are `uint8` — keeps speculation exact, and a drafter computes in the target's float
type, never in its scales' integer type (EAGLE-3 and DFlash used to cast themselves to `uint8`, and the head's draft
vocabulary called `mx.dequantize` as if every layer were affine)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from specnb.executor import generate, spec_generate
from specnb.models import random_model
from specnb.sources.base import compute_dtype
from specnb.sources.chain import HeadProvider, random_head
from specnb.sources.dflash import DFlashProvider, random_dflash
from specnb.sources.eagle3 import Eagle3Provider, random_eagle3

MODES = {"affine-4": ("affine", 4, 64), "affine-8": ("affine", 8, 32), "mxfp4": ("mxfp4", 4, 32),
         "mxfp8": ("mxfp8", 8, 32), "nvfp4": ("nvfp4", 4, 16)}  # fmt: skip
DRAFTERS = {
    "eagle3": lambda t: Eagle3Provider(random_eagle3(t, [1, 2, 3], draft_vocab=64, seed=1)),
    "dflash": lambda t: DFlashProvider(random_dflash(t, [1, 3], seed=1)),
    "head": lambda t: HeadProvider(random_head(t, [1, 3], seed=1, draft_vocab=24)),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_drafter_on_a_quantized_target(kind, mode):
    q, bits, group = MODES[mode]
    target = random_model(0, num_layers=4, scale=4)
    provider = DRAFTERS[kind](target)  # drawn on the float target, as a drafter is trained
    nn.quantize(target, group_size=group, bits=bits, mode=q)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for gamma in (1, 3):
        r = spec_generate(target, provider, prompt, num_draft_tokens=gamma, max_tokens=16)
        assert r.tokens == generate(target, prompt, max_tokens=16).tokens, (kind, mode, gamma)
        assert r.stats.drafted > 0
    drafter = getattr(provider, "drafter", None) or provider.head
    dtypes = {v.dtype for _, v in tree_flatten(drafter.parameters()) if v.dtype not in (mx.int32, mx.uint32)}
    assert all(mx.issubdtype(d, mx.floating) for d in dtypes), (kind, mode, dtypes)
    if kind != "head":  # the head computes in float32 by design
        assert dtypes == {compute_dtype(target)}, (kind, mode, dtypes)
