"""lm-evaluation-harness end to end (issue #46): its `local-completions` model against a real `specnb serve` — sending
token ids, as it does by default, and sending text — gives the loglikelihoods, greedy flags and rolling loglikelihoods
(the perplexities) its `hf` model gives on the same weights, and the same greedy continuations; a small local task, no
hub."""

import pytest

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

from specnb.models import bundled_dir  # noqa: E402
from specnb.serve.harness import running_server  # noqa: E402

pytestmark = pytest.mark.xdist_group("lm_eval")

SNIPPETS = [
    "import os\nimport sys\n\n\ndef main():\n    print(sys.argv)\n",
    "class Config:\n    def __init__(self, path):\n        self.path = path\n",
    "for i in range(10):\n    if i % 2:\n        continue\n",
]
# (context, continuation): a choice of continuations per context, as a multiple-choice task scores them
CHOICES = [(s[: s.index("\n") + 1], c) for s in SNIPPETS for c in (s[s.index("\n") + 1 :][:12], "    return None")]


def requests(kind: str, args: list) -> list:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def models():
    folder = str(bundled_dir("target"))
    hf = HFLM(pretrained=folder, dtype="float32", batch_size=1, device="cpu")
    with running_server() as url:
        api = {
            tokenized: LocalCompletionsAPI(
                base_url=f"{url}/v1/completions",
                model="specnb-bundled",
                tokenizer=folder,
                tokenizer_backend="huggingface",
                tokenized_requests=tokenized,
                max_length=1024,
            )
            for tokenized in (True, False)
        }
        yield hf, api


@pytest.mark.parametrize("tokenized", [True, False], ids=["token ids", "text"])
def test_loglikelihoods_equal_the_hf_model(models, tokenized):
    hf, api = models
    want = hf.loglikelihood(requests("loglikelihood", CHOICES))
    got = api[tokenized].loglikelihood(requests("loglikelihood", CHOICES))
    for (lw, gw), (lg, gg) in zip(want, got):
        assert abs(lw - lg) < 1e-3 and gw == gg, (want, got)
    # the multiple-choice answer (the likelier continuation) is the same
    pick = lambda r: [int(r[i + 1][0] > r[i][0]) for i in range(0, len(r), 2)]
    assert pick(got) == pick(want)


@pytest.mark.parametrize("tokenized", [True, False], ids=["token ids", "text"])
def test_perplexities_equal_the_hf_model(models, tokenized):
    hf, api = models
    args = [(s,) for s in SNIPPETS]
    want = hf.loglikelihood_rolling(requests("loglikelihood_rolling", args))
    got = api[tokenized].loglikelihood_rolling(requests("loglikelihood_rolling", args))
    assert all(abs(w - g) < 1e-3 for w, g in zip(want, got)), (want, got)


def test_greedy_continuations_equal_the_hf_model(models):
    hf, api = models
    args = [(s[:30], {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False}) for s in SNIPPETS]
    assert api[True].generate_until(requests("generate_until", args)) == hf.generate_until(
        requests("generate_until", args)
    )


def test_chat_continuations_equal_the_hf_model(models):
    """Its `local-chat-completions` model (what lm-eval runs with `--apply_chat_template` against a chat endpoint) gets
    the continuation its `hf` model makes of the same conversation through the model's chat template."""
    import json

    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    hf, api = models
    chat = LocalChatCompletion(
        base_url=api[True].base_url.replace("/v1/completions", "/v1/chat/completions"),
        model="specnb-bundled",
        tokenizer_backend=None,
    )
    gen = {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False}
    convs = [[{"role": "user", "content": s[:30]}] for s in SNIPPETS]
    got = chat.generate_until(requests("generate_until", [(JsonChatStr(json.dumps(c)), dict(gen)) for c in convs]))
    want = hf.generate_until(requests("generate_until", [(hf.apply_chat_template(c), dict(gen)) for c in convs]))
    assert got == want
