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
