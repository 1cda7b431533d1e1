"""Every published-drafter loader through a hub id (issue #43), on the loopback hub: EAGLE-3, DFlash, DSpark, split MTP
and a Gemma 4 assistant each load from `owner/name` as from a folder, are detected by the registry from their config,
and draft losslessly."""

import pytest

from specnb.executor import generate, spec_generate
from specnb.hub_fixture import LoopbackHub
from specnb.models import random_model
from specnb.sources.dflash import random_dflash, save_dflash
from specnb.sources.dspark import random_dspark, save_dspark
from specnb.sources.eagle3 import random_eagle3, save_eagle3
from specnb.sources.registry import draft_kind, make_provider

TARGET = random_model(0, scale=4)
WRITERS = {
    "eagle3": lambda p: save_eagle3(random_eagle3(TARGET, [1, 2]), p),
    "dflash": lambda p: save_dflash(random_dflash(TARGET, [0, 1], block_size=4), p),
    "dspark": lambda p: save_dspark(random_dspark(TARGET, [0, 1], block_size=4), p),
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_drafter_from_a_hub_id(kind, tmp_path):
    WRITERS[kind](tmp_path / "hub" / "me" / f"tiny-{kind}")
    prompt = [1, 2, 3, 4, 5, 6]
    with LoopbackHub(tmp_path / "hub"):
        repo = f"me/tiny-{kind}"
        assert draft_kind(None, repo) == kind  # detected from the config.json the hub serves
        provider = make_provider(kind, target=TARGET, draft_model=repo)
        r = spec_generate(TARGET, provider, prompt, num_draft_tokens=3, max_tokens=16)
    assert r.tokens == generate(TARGET, prompt, max_tokens=16).tokens and r.stats.drafted > 0


def test_mlx_lm_models_from_hub_ids(tmp_path):
    """A target and a draft model that are mlx-lm folders, given as hub ids (`specnb.models.load_pair`, which the CLI
    and the server call): each is fetched from the hub, the pair is checked, and two-model drafting with it is exact;
    a quantized copy (`specnb convert`) is read the same way."""
    import shutil

    from specnb.convert import convert
    from specnb.models import bundled_dir, load_pair

    for name in ("target", "draft"):
        shutil.copytree(bundled_dir(name), tmp_path / "hub" / "me" / f"bundled-{name}")
    convert(bundled_dir("draft"), tmp_path / "hub" / "me" / "bundled-draft-8bit", bits=8)
    prompt = [1, 2, 3, 4, 5, 6]
    want = generate(load_pair().target, prompt, max_tokens=16).tokens
    with LoopbackHub(tmp_path / "hub"):
        for draft in ("me/bundled-draft", "me/bundled-draft-8bit"):
            pair = load_pair("me/bundled-target", draft)
            assert draft_kind("me/bundled-target", draft) == "two-model"
            provider = make_provider("two-model", pair.draft, target=pair.target)
            r = spec_generate(pair.target, provider, prompt, num_draft_tokens=3, max_tokens=16)
            assert r.tokens == want and r.stats.accepted > 0, draft
