"""Drafters on quantized targets (issue #43): every way mlx-lm quantizes a model — affine, and the microscaling formats
mxfp4, mxfp8 and nvfp4, whose scales are `uint8` — keeps speculation exact, and a drafter computes in the target's float
type, never in its scales' integer type (EAGLE-3 and DFlash used to cast themselves to `uint8`, and the head's draft
vocabulary called `mx.dequantize` as if every layer were affine)."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from specnb.executor import generate, spec_generate
from specnb.models import bundled_dir, random_model
from specnb.sources.base import compute_dtype
from specnb.sources.chain import HeadProvider, random_head
from specnb.sources.dflash import DFlashProvider, load_dflash, random_dflash, save_dflash
from specnb.sources.eagle3 import Eagle3Provider, load_eagle3, random_eagle3, save_eagle3

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


WRITERS = {
    "dflash": lambda t, p: save_dflash(random_dflash(t, [1, 3], seed=1), p),
    "eagle3": lambda t, p: save_eagle3(random_eagle3(t, [1, 2, 3], draft_vocab=64, seed=1), p),
}
READERS = {"dflash": (load_dflash, DFlashProvider), "eagle3": (load_eagle3, Eagle3Provider)}


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
@pytest.mark.parametrize("kind", list(WRITERS))
def test_drafter_quantized_by_mlx_vlm(kind, mode, tmp_path):
    """A drafter folder quantized by mlx-vlm's own `convert` (4-bit, its `quantization` entry in config.json) loads
    quantized as written — in specnb and in mlx-vlm's `load_drafter` — and drafts losslessly (it used to be refused:
    "Received 16 parameters not in model: fc.biases, fc.scales, …")."""
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.convert import convert
    from mlx_vlm.speculative.drafters import load_drafter

    target = random_model(0, num_layers=4, scale=4)
    WRITERS[kind](target, tmp_path / "float")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # convert insists on a tokenizer beside the weights
        shutil.copy(bundled_dir("target") / f, tmp_path / "float" / f)
    convert(str(tmp_path / "float"), str(tmp_path / "q"), quantize=True, q_group_size=32, q_bits=4, q_mode=mode)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["mode"] == mode
    load, provider = READERS[kind]
    drafter = load(tmp_path / "q")
    assert type(drafter.fc).__name__ == "QuantizedLinear" and drafter.fc.mode == mode
    load_drafter(str(tmp_path / "q"))  # mlx-vlm reads the same folder
    prompt = [5, 6, 7, 8, 9, 10, 11]
    r = spec_generate(target, provider(drafter), prompt, num_draft_tokens=3, max_tokens=16)
    assert r.tokens == generate(target, prompt, max_tokens=16).tokens and r.stats.drafted > 0
