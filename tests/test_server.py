"""`specnb serve` end to end: the server started as a user starts it (a subprocess on a free loopback port) and driven
with the official `openai` client — chat and completions, streaming and not, structured output, stop sequences,
usage.speculation, the prompt cache, concurrency, a disconnect, a full queue, bad input and bad start-up arguments — and
a server that holds its ground: the context limit, the body size limit, memory admission, a hang-up during a long
prefill, API keys, SIGTERM — and batched requests (`--max-batch-size`): each gets the text it gets alone, requests join
and leave mid-stream, and 32 clients at once are all answered."""

import json, re, shutil, signal, socket, subprocess, sys, threading, time, warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import httpx, jsonschema, openai, pytest
from mlx_lm.sample_utils import make_logits_processors
from prometheus_client.parser import text_string_to_metric_families
from specnb import spec_generate, TwoModelProvider
from specnb.caches.quantized import kv_flags
from specnb.executor import generate
from specnb.models import load_pair, bundled_dir, PROBE
from specnb.blas import OPENBLAS
from specnb.serve.harness import running_server, serve_process
from specnb.cli import refusal

# The tests here share module-scoped servers: one worker runs them all, in the order written (`--dist loadgroup`; other
# files' tests run beside them on the other worker).
pytestmark = pytest.mark.xdist_group("server")

MODEL = "specnb-bundled"
NO_EOS = {"0": -100}  # the bundled EOS id: banning it makes a generation run to max_tokens


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def url():
    with running_server("--max-queue", "16") as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def metric(url, name, **labels) -> float:
    "The value of one sample of the server's /metrics (0 when absent)."
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def in_process(pair, prompt_ids, max_tokens, **kw):
    return spec_generate(
        pair.target,
        TwoModelProvider(pair.draft),
        prompt_ids,
        max_tokens=max_tokens,
        eos_token_ids=pair.tokenizer.eos_token_ids,
        **kw,
    )


def chat_ids(tok, messages):
    return tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )


def test_completion_equals_in_process(client, pair):
    tok = pair.tokenizer
    for text in ("def read_config(path):\n    ", "import os\nimport sys\n\n", 'class Queue:\n    """'):
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=40)
        ref = in_process(pair, tok.encode(text), 40)
        assert r.choices[0].text == tok.decode(ref.tokens)
        assert r.choices[0].finish_reason == ("length" if len(ref.tokens) == 40 else "stop")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(text)), len(ref.tokens))
        spec = r.usage.speculation
        assert (spec["drafted"], spec["accepted"], spec["target_calls"]) == (
            ref.stats.drafted,
            ref.stats.accepted,
            ref.stats.target_calls,
        )
        assert spec["acceptance_rate"] == pytest.approx(ref.stats.acceptance_rate, abs=1e-4)
        assert spec["mean_accepted_length"] == pytest.approx(ref.stats.mean_accepted_length, abs=1e-4)
    ids = tok.encode("def main():\n")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=20)  # a prompt of token ids
    assert by_ids.choices[0].text == tok.decode(in_process(pair, ids, 20).tokens)


def test_chat_streaming_equals_non_streaming(client, url, pair):
    msgs = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": [{"type": "text", "text": "Write a for loop."}]},
    ]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=50, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    last = chunks[-1]  # the usage chunk: no choices, the whole request's usage
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.speculation == whole.usage.speculation
    ref = in_process(
        pair,
        chat_ids(
            pair.tokenizer,
            [
                {"role": m["role"], "content": "Write a for loop." if m["role"] == "user" else m["content"]}
                for m in msgs
            ],
        ),
        50,
    )
    assert whole.choices[0].message.content == pair.tokenizer.decode(ref.tokens)
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 5, "stream": True}) as r:
        lines = [l for l in r.iter_lines() if l]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(l.startswith("data: ") for l in lines) and lines[-1] == "data: [DONE]"


SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
        "required": ["name", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_response_format(client, pair, i):
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=120, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])
    streamed = list(
        client.completions.create(
            model=MODEL, prompt="data = ", max_tokens=120, stream=True, extra_body={"response_format": fmt}
        )
    )
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in streamed if c.choices)), SCHEMAS[i])


def test_json_object(client):
    r = client.completions.create(
        model=MODEL,
        prompt="config = ",
        max_tokens=200,
        extra_body={"response_format": {"type": "json_object"}, "logit_bias": NO_EOS},
    )
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].text)
    else:
        assert r.choices[0].finish_reason == "length"  # the tiny model may still be inside the object


def test_stop_sequences(client):
    prompt = "def read_config(path):\n    "
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60).choices[0].text
    stop = full[20:24]  # a piece from the middle, possibly spanning tokens
    cut = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, stop=[stop, "never-appears"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_min_tokens_holds_off_stop_sequences(client):
    """vLLM's rule for its `min_tokens` (its test_min_tokens_with_stop): no stop sequence ends the text before that many
    tokens; the first one after them does (issue #46: a newline stopped the first request here after 1 token)."""
    prompt, body = "def f(x):", dict(model=MODEL, max_tokens=30, temperature=0)
    full = client.completions.create(prompt=prompt, **body).choices[0].text
    assert full.startswith("\n")  # the bundled model writes code: a newline first, and more later
    r = client.completions.create(prompt=prompt, stop=["\n"], extra_body={"min_tokens": 20}, **body)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (full, 30, "length")
    r = client.completions.create(prompt=prompt, stop=["\n"], extra_body={"min_tokens": 3}, **body)
    text = r.choices[0].text
    assert r.usage.completion_tokens >= 3 and full.startswith(text) and "\n" in text, (text, full)
    assert (r.choices[0].finish_reason, full[len(text)]) == ("stop", "\n")  # cut at the first newline after 3


def test_token_array_prompt(client, pair):
    """OpenAI's prompt as an array of token arrays, one of them — what lm-evaluation-harness's local-completions sends
    by default (issue #46: refused with "prompt.str: Input should be a valid string"): the same answer as the ids alone
    and as the text, echo and logprobs included."""
    text = "import os\nimport sys\n"
    ids = pair.tokenizer.encode(text)
    body = dict(model=MODEL, max_tokens=1, logprobs=1, echo=True, temperature=0)
    answers = [client.completions.create(prompt=p, **body).choices[0] for p in ([ids], ids, text)]
    assert answers[0].text == answers[1].text == answers[2].text
    assert answers[0].logprobs.token_logprobs == answers[1].logprobs.token_logprobs


def test_echo_scores_an_end_of_text_continuation(client, pair):
    """Under echo, the generated token's entry is there even when it is end-of-text (issue #46: 19 entries came back for
    19 prompt tokens, and lm-evaluation-harness, which drops the last entry, lost the prompt's last token): prompt + 1
    entries, the last one end-of-text's own log-probability, the text the prompt's alone."""
    eos = pair.tokenizer.eos_token_id
    ids = pair.tokenizer.encode("import os\n")
    # a continuation that is end-of-text: forced, by a bias that makes every other token impossible
    bias = {str(eos): 100}
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0, logit_bias=bias
    ).choices[0]
    assert len(r.logprobs.token_logprobs) == len(ids) + 1, (len(r.logprobs.token_logprobs), len(ids))
    assert r.logprobs.token_logprobs[-1] > -1e-3 and r.text == pair.tokenizer.decode(ids)  # ~log 1 under the bias
    free = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert len(free.choices[0].logprobs.token_logprobs) == len(ids) + 1  # and an ordinary token, as before


def test_logprobs_of_partial_characters(client):
    """A token that is one byte of a character (issue #46: each was decoded alone, to U+FFFD): completion tokens join
    into the echoed text and their offsets follow it; chat `bytes` are the token's exact bytes."""
    text = "x = 'café €'\n"
    lp = client.completions.create(model=MODEL, prompt=text, max_tokens=4, logprobs=0, echo=True).choices[0]
    tokens, offsets = lp.logprobs.tokens, lp.logprobs.text_offset
    assert "".join(tokens) == lp.text and lp.text.startswith(text), (tokens, lp.text)
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "é"}], max_tokens=12, logprobs=True
    )
    for e in chat.choices[0].logprobs.content:  # every token's bytes decode to its text, or are part of a character
        assert bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token


def test_several_prompts_are_several_choices(client, pair):
    """A completions prompt that is a list of prompts (strings or token arrays, as OpenAI documents and lm-eval sends in
    batches) is answered with `n` choices of each, in order (issue #46: refused), streamed or not; each prompt is
    counted once in the usage."""
    texts = ["def read(path):\n", "class Stack:\n"]
    one = [client.completions.create(model=MODEL, prompt=t, max_tokens=6, temperature=0) for t in texts]
    for prompt in (texts, [pair.tokenizer.encode(t) for t in texts]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == [o.choices[0].text for o in one for _ in range(2)]
        assert r.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)
    chunks = client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0, stream=True)
    got = ["", ""]
    for c in chunks:
        for ch in c.choices:
            got[ch.index] += ch.text
    assert got == [o.choices[0].text for o in one]


def test_num_draft_tokens_per_request(client):
    kw = dict(model=MODEL, prompt="for i in range(", max_tokens=40)
    plain = client.completions.create(**kw, extra_body={"num_draft_tokens": 0})
    wide = client.completions.create(**kw, extra_body={"num_draft_tokens": 5})
    default = client.completions.create(**kw)
    assert plain.choices[0].text == wide.choices[0].text == default.choices[0].text  # lossless at any γ
    assert (
        plain.usage.speculation["drafted"] == 0
        and plain.usage.speculation["target_calls"] == plain.usage.completion_tokens
    )
    assert (
        len(wide.usage.speculation["drafted_by_position"]) == 5
        and len(default.usage.speculation["drafted_by_position"]) == 3
    )
    assert wide.usage.speculation["accepted"] > 0


def test_seeded_sampling_is_reproducible(client):
    kw = dict(
        model=MODEL,
        prompt="import ",
        max_tokens=30,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        extra_body={"top_k": 50, "min_p": 0.02, "repetition_penalty": 1.1},
    )
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_rejection_sampling_per_request(client):
    kw = dict(model=MODEL, prompt="def f(x):\n    ", max_tokens=40, temperature=1.0, seed=11)
    rej = [
        client.completions.create(**kw, extra_body={"acceptance": "rejection", "logit_bias": NO_EOS}) for _ in range(2)
    ]
    match = client.completions.create(**kw, extra_body={"logit_bias": NO_EOS})
    assert rej[0].choices[0].text == rej[1].choices[0].text  # seeded: reproducible
    assert rej[0].usage.speculation["rule"] == "rejection" and match.usage.speculation["rule"] == "match"
    greedy = client.completions.create(model=MODEL, prompt="x = ", max_tokens=5, extra_body={"acceptance": "rejection"})
    assert greedy.usage.speculation["rule"] == "match"  # at temperature 0 the rules coincide


def test_prompt_cache_follow_up(client, pair):
    msgs = [{"role": "user", "content": "def mean(xs):"}]
    a1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, extra_body={"logit_bias": NO_EOS})
    msgs += [
        {"role": "assistant", "content": a1.choices[0].message.content},
        {"role": "user", "content": "And the median?"},
    ]
    a2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, extra_body={"logit_bias": NO_EOS})
    cached = a2.usage.prompt_tokens_details.cached_tokens
    assert a1.usage.prompt_tokens <= cached < a2.usage.prompt_tokens
    fresh = in_process(pair, chat_ids(pair.tokenizer, msgs), 30, logits_processors=make_logits_processors({0: -100}))
    assert a2.choices[0].message.content == pair.tokenizer.decode(fresh.tokens)  # identical to a fresh run
    assert a2.usage.speculation["accepted"] == fresh.stats.accepted  # the draft's cache came along too
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, extra_body={"logit_bias": NO_EOS})
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # an exact repeat
    assert again.choices[0].message.content == a2.choices[0].message.content


def test_eight_concurrent_clients(client, pair):
    prompts = [
        "import os\n",
        "def add(a, b):\n",
        "class Node:\n",
        "for x in ",
        "while True:\n",
        "try:\n    ",
        "# Copyright ",
        "if __name__",
    ]
    expected = [pair.tokenizer.decode(in_process(pair, pair.tokenizer.encode(p), 40).tokens) for p in prompts]

    def one(i):
        if i % 2:
            return "".join(
                c.choices[0].text
                for c in client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40, stream=True)
                if c.choices
            )
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40).choices[0].text

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, range(8)))
    assert got == expected


def test_disconnect_stops_generation(client, url):
    before = metric(url, "specnb_generated_tokens_total")
    stream = client.completions.create(
        model=MODEL, prompt="def f():\n", max_tokens=1000, stream=True, extra_body={"logit_bias": NO_EOS}
    )
    for _, _ in zip(range(5), stream):
        pass
    stream.close()
    t0 = time.monotonic()
    while metric(url, "specnb_requests_total", endpoint="completions", finish_reason="cancelled") < 1:
        assert time.monotonic() - t0 < 30, "the server did not stop the abandoned generation"
        time.sleep(0.1)
    generated = metric(url, "specnb_generated_tokens_total") - before
    assert generated < 500, generated  # stopped long before max_tokens
    assert metric(url, "specnb_running_requests") == 0 and metric(url, "specnb_queue_depth") == 0
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).usage.completion_tokens == 3


@pytest.mark.parametrize("batch", ["1", "2"])
def test_full_queue_answers_503(batch):
    """One at a time, or two in a batch: beyond the running requests and the one waiting, the server answers 503 with
    Retry-After."""
    with running_server("--max-queue", "1", "--max-batch-size", batch) as u:
        body = {"prompt": "def f():\n", "max_tokens": 400, "logit_bias": NO_EOS}

        def post(_):
            return httpx.post(u + "/v1/completions", json=body, timeout=300)

        with ThreadPoolExecutor(5) as ex:
            rs = list(ex.map(post, range(5)))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 503 in codes, codes
        busy = next(r for r in rs if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "queue_full"
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in rs if r.status_code == 200)
        assert metric(u, "specnb_refused_requests_total", reason="queue_full") == codes.count(503)
        assert httpx.get(u + "/health").json()["status"] == "ok"


BAD = [  # (endpoint, body, text the error message must contain)
    ("completions", b'{"prompt": "x", "max_tokens": 5', "We could not parse the JSON body of your request"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -3}, "-3"),
    ("completions", {"prompt": "x", "max_tokens": 10**9}, "1000000000"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": ""}, "prompt is empty"),
    ("completions", {"prompt": []}, "prompt is empty"),
    ("completions", {"prompt": [1, 99999]}, "99999"),
    ("completions", {"prompt": ["a"] * 9, "n": 2}, "at most 16 choices"),
    ("completions", {"prompt": [[1, 2], [3, 99999]]}, "99999"),
    ("completions", {"prompt": [[1, 99999]]}, "99999"),
    ("completions", {"max_tokens": 5}, "prompt: field required"),
    ("completions", {"prompt": "x", "stop": [1, 2]}, "stop"),
    ("completions", {"prompt": "x", "n": 17}, "n"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "'abc'"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 500}}, "500"),
    ("completions", {"prompt": "x", "num_draft_tokens": -1}, "num_draft_tokens"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "acceptance": "sometimes"}, "acceptance"),
    ("completions", {"prompt": "x", "temperature": 1, "top_p": 0}, "top_p"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    # issue #46: these answered 500
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": 5}},
        "chat_template_kwargs may not set messages",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": "x"}},
        "chat_template_kwargs may not set tools",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"documents": 5}},
        "chat_template_kwargs: the chat template cannot use them",
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        "invalid JSON schema",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
        "json_schema",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "xml"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("endpoint,body,says", BAD, ids=[f"{e}:{str(b)[:40]}" for e, b, _ in BAD])
def test_bad_input_is_a_400_with_an_openai_error(url, endpoint, body, says):
    r = post_bad(url, endpoint, body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert says in err["message"], err
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}


def post_bad(url, endpoint, body) -> httpx.Response:
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    return httpx.post(f"{url}/v1/{endpoint}", timeout=60, **kw)


def test_bad_input_through_the_client_and_server_survives(client, url):
    before = metric(url, "specnb_refused_requests_total", reason="bad_request")
    assert all(post_bad(url, endpoint, body).status_code == 400 for endpoint, body, _ in BAD)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}},
            },
        )
    r = httpx.get(url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    # every bad body above counted once as a bad request (the schema and model errors carry codes of their own, the path
    # is not counted)
    assert metric(url, "specnb_refused_requests_total", reason="bad_request") - before == len(BAD)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).usage.completion_tokens == 3


HOSTILE = [
    {"seed": -1},
    {"seed": 2**64},
    {"top_k": 2**64, "temperature": 1},
    {"top_k": 4096, "temperature": 1},
    {"logit_bias": {"²": 1}},
    {"repetition_penalty": 5e-324},
    {"temperature": 1e-40, "response_format": {"type": "json_object"}},
    {"xtc_threshold": 0.9},
    {"min_tokens": 4, "ignore_eos": True},
]


def test_every_field_is_honoured_or_refused(client, url):
    """Issue #30: a field the server does not read is a 400 naming it (it was ignored); `min_tokens` and `ignore_eos`
    are honoured under speculation (EOS made the likeliest token: it comes exactly at `min_tokens`, or never with
    `ignore_eos`); unhonourable values are refused."""
    EOS_FIRST = {"logit_bias": {"0": 100}}  # the bundled EOS id, made certain
    for field, value in (
        ("typical_p", 0.5),
        ("adapters", "lora"),
        ("functions", []),
        ("store", True),
        ("best_of", 3),
        ("draft_model", "x"),
        ("prediction", {"type": "audio", "content": "x"}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x = ", max_tokens=4, extra_body={field: value})
        assert e.value.body["param"] == field and field in e.value.body["message"], (field, e.value.body)
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=12, extra_body={**EOS_FIRST, "min_tokens": 5})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason, r.usage.speculation["drafted"] > 0) == (
        5,
        "stop",
        True,
    )
    r = client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=12, extra_body={**EOS_FIRST, "ignore_eos": True}
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (12, "length")
    msgs = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello", "refusal": None, "annotations": []},
        {"role": "user", "content": "and?"},
    ]
    ok = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, user="u1", metadata={"run": "7"}, store=False, service_tier="auto"
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort"
    # the bundled template knows no tool-call format: tools would be ignored
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=4, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert e.value.body["param"] == "tools"
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a class."}],
        max_tokens=48,
        extra_body={"logit_bias": NO_EOS},
    )
    plain = client.chat.completions.create(**ask)
    # drafted from first
    pred = client.chat.completions.create(
        **ask, prediction={"type": "content", "content": plain.choices[0].message.content}
    )
    assert pred.choices[0].message.content == plain.choices[0].message.content
    assert pred.usage.speculation["target_calls"] < plain.usage.speculation["target_calls"], (pred.usage, plain.usage)
    # echo: the prompt, then the answer
    echoed = client.completions.create(model=MODEL, prompt="x = ", max_tokens=6, echo=True).choices[0].text
    assert echoed == "x = " + client.completions.create(model=MODEL, prompt="x = ", max_tokens=6).choices[0].text
    assert (
        "".join(
            c.choices[0].text
            for c in client.completions.create(model=MODEL, prompt="x = ", max_tokens=6, echo=True, stream=True)
        )
        == echoed
    )


def test_a_bad_request_beside_a_batch_stays_its_own(client, url):
    """Three greedy requests of 120 tokens running; hostile requests arrive among them, one by one: each gets its own
    answer (a 400 naming the field, or a 200 where the value is valid), and the three finish with exactly the text each
    gets alone — issue #29's batch that all got the bad request's 500."""
    prompts = BATCH_PROMPTS[:3]
    alone = [_text(client, False, prompt=p, max_tokens=120, extra_body={"logit_bias": NO_EOS}) for p in prompts]

    def hostile():
        out = []
        for extra in HOSTILE:
            # json.dumps: 2**64 and 5e-324 as written
            body = json.dumps({"prompt": "def f(", "max_tokens": 8, **extra}).encode()
            r = httpx.post(
                url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
            )
            out.append((extra, r.status_code, r.json()))
        return out

    with ThreadPoolExecutor(4) as ex:
        running = [
            ex.submit(_text, client, True, prompt=p, max_tokens=120, extra_body={"logit_bias": NO_EOS}) for p in prompts
        ]
        _wait(lambda: httpx.get(url + "/health").json()["running"] >= 2, "the greedy requests did not start")
        answers = ex.submit(hostile).result()
        together = [f.result() for f in running]
    assert together == alone
    for extra, status, body in answers:
        assert status in (200, 400), (extra, status, body)
        if status == 400:
            assert body["error"]["param"] == next(iter(extra)), (extra, body)
    assert [s for _, s, _ in answers] == [400, 400, 200, 200, 400, 400, 200, 400, 200], answers
    # a temperature too small for float32: greedy, inside the grammar
    assert answers[6][2]["choices"][0]["text"].startswith("{")
    assert answers[-1][2]["usage"]["completion_tokens"] == 8  # ignore_eos: to max_tokens


@pytest.mark.parametrize(
    "endpoint,body",
    [("completions", {"prompt": "x"}), ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})],
)
def test_unknown_model_is_a_404_model_not_found(client, url, endpoint, body):
    "OpenAI answers a model it does not have with 404 and code model_not_found; so does the server, on both endpoints."
    before = metric(url, "specnb_refused_requests_total", reason="model_not_found")
    r = httpx.post(f"{url}/v1/{endpoint}", json={**body, "model": "gpt-9"}, timeout=60)
    assert r.status_code == 404, (r.status_code, r.text)
    assert r.json() == {
        "error": {
            "message": f"model 'gpt-9' is not served here; this server serves '{MODEL}'",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    # openai 1.x hands over the inner object, later versions the whole body
    err = e.value.body.get("error", e.value.body)
    assert (e.value.status_code, err["code"], err["param"]) == (404, "model_not_found", "model")
    assert metric(url, "specnb_refused_requests_total", reason="model_not_found") == before + 2


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "x" "max_tokens": 5}',
        b'{"prompt": "x", "max_tokens": 5',
        b'{\n  "prompt": "x",\n  "max_tokens": 5,\n}',
        b"prompt=x",
    ],
)
def test_malformed_json_says_where_not_a_char_offset(url, body):
    "A body that is not JSON: the message says what broke and where, as line and column (json's own count); no param."
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(body)
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] == (
        f"We could not parse the JSON body of your request: {want.value.msg} "
        f"(at line {want.value.lineno} column {want.value.colno})"
    ), err
    assert (err["param"], err["code"], err["type"]) == (None, None, "invalid_request_error")


@pytest.mark.parametrize(
    "schema,names",
    [
        ({"type": "nonsense"}, "nonsense"),
        ({"type": "object", "properties": 5}, "properties"),
        ({"type": "string", "pattern": "(("}, "parenthesis"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ],
)
def test_invalid_schema_message_is_a_plain_sentence(client, schema, names):
    """An invalid schema is refused with the compiler's sentence naming the problem, without its source path or
    timestamp."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    err = e.value.body.get("error", e.value.body)
    msg = err["message"]
    assert msg.startswith("invalid JSON schema: ") and names in msg, msg
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.(cc|h|cpp)\b|/project/|\n", msg), msg
    assert err["param"] == "response_format.json_schema.schema"


def test_models_health_metrics(client, url):
    assert [m.id for m in client.models.list()] == [MODEL]
    h = httpx.get(url + "/health").json()
    assert (h["status"], h["model"], h["draft_kind"]) == ("ok", MODEL, "two-model")
    # the server restarts itself with OpenBLAS
    assert h["blas"].startswith("openblas") if OPENBLAS.exists() else h["blas"] == "reference"
    names = {f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for n in (
        "specnb_requests",
        "specnb_generated_tokens",
        "specnb_drafted_tokens",
        "specnb_accepted_tokens",
        "specnb_accepted_tokens_by_position",
        "specnb_drafted_tokens_by_position",
        "specnb_target_calls",
        "specnb_queue_depth",
        "specnb_request_seconds",
        "specnb_time_to_first_token_seconds",
        "specnb_cached_prompt_tokens",
    ):
        assert n in names, n
    assert metric(url, "specnb_accepted_tokens_by_position_total", position="0") > 0


@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory, pair):
    "A copy of the bundled draft whose tokenizer numbers two tokens the other way round: a different tokenizer."
    d = tmp_path_factory.mktemp("foreign") / "draft"
    shutil.copytree(bundled_dir("draft"), d)
    tj = json.loads((d / "tokenizer.json").read_text())
    ids = pair.tokenizer.encode(PROBE)[:2]
    inv = {v: k for k, v in tj["model"]["vocab"].items()}
    a, b = inv[ids[0]], inv[ids[1]]
    tj["model"]["vocab"][a], tj["model"]["vocab"][b] = ids[1], ids[0]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


@pytest.mark.parametrize(
    "args,says",
    [
        (["--draft-kind", "early-exit", "--exit-layer", "9"], "not below the target's 6 layers"),
        (["--draft-kind", "ngram", "--draft-model", "x/y"], "--draft-model is read only by two-model"),
        (["--draft-kind", "ngram", "--lookup-first"], "not ngram"),
        (["--draft-head", "/nonexistent/head"], "no draft head at /nonexistent/head"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--max-queue", "0"], "--max-queue must be >= 1"),
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        (["--port", "70000"], "--port must be <= 65535"),
        (["--memory-budget", "lots"], "--memory-budget must be a size such as 512M"),
        (["FOREIGN"], "do not share a tokenizer"),
    ],
)
def test_bad_start_up_fails_with_one_line(args, says, foreign_draft, fast_env):
    "Each refusal in this process (a subprocess adds only a start-up); two of them as a user starts `specnb serve`."
    real = args in (["--port", "70000"], ["FOREIGN"])  # an option check and a load check, through the real command
    if args == ["FOREIGN"]:
        args = ["--model", str(bundled_dir("target")), "--draft-model", str(foreign_draft)]
    if real:
        exe = Path(sys.executable).with_name("specnb")
        r = subprocess.run(
            [str(exe), "serve", "--port", "0", *args], capture_output=True, text=True, timeout=300, env=fast_env
        )
        status, err = r.returncode, r.stderr
    else:
        status, err = refusal(["serve", "--port", "0", *args])
    assert status == 2, (status, err[-2000:])
    assert err.startswith("specnb: error:") and says in err and "Traceback" not in err, err


def test_the_server_imports_no_http_client_and_no_cli():
    """Talking HTTP to a server is the harness's job (`specnb.serve.harness`), and the CLI sits above the server:
    importing the server loads neither."""
    code = (
        "import sys, specnb.serve; print(sorted(m for m in ('httpx', 'specnb.serve.harness', 'specnb.cli') if m in "
        "sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout.strip()) == (0, "[]"), (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("kind", ["ngram", "early-exit", "head"])
def test_other_draft_kinds_serve_the_same_text(kind, client):
    "Every draft kind is lossless through the server, and the prompt cache works without a draft cache."
    ref = client.completions.create(model=MODEL, prompt="def read_config(path):\n    ", max_tokens=40).choices[0].text
    with running_server("--draft-kind", kind, *(["--exit-layer", "3"] if kind == "early-exit" else [])) as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0)
        assert httpx.get(u + "/health").json()["draft_kind"] == kind
        r = c.completions.create(model=MODEL, prompt="def read_config(path):\n    ", max_tokens=40)
        assert r.choices[0].text == ref and r.usage.speculation["rounds"] > 0
        again = c.completions.create(model=MODEL, prompt="def read_config(path):\n    " + ref + "\n", max_tokens=10)
        assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.fixture(scope="module", params=["eagle3", "dflash"])
def published_folder(request, tmp_path_factory, pair):
    """A published drafter's checkpoint for the bundled target — EAGLE-3 in vLLM's layout, DFlash in z-lab's — with
    random weights: the text must not change, whatever it drafts."""
    from specnb.sources.eagle3 import random_eagle3, save_eagle3
    from specnb.sources.dflash import random_dflash, save_dflash

    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "eagle3":
        save_eagle3(random_eagle3(pair.target, [2, 4, 6], draft_vocab=1024), folder)
    else:
        save_dflash(random_dflash(pair.target, [1, 3, 4], block_size=8), folder)
    return request.param, folder


def test_a_published_drafter_serves_the_same_text(client, published_folder):
    """`--draft-model` with an EAGLE-3 or DFlash checkpoint: recognised by its config, lossless through the server, and
    a follow-up turn on the saved caches."""
    kind, folder = published_folder
    prompt = "def read_config(path):\n    "
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40).choices[0].text
    with running_server("--draft-model", str(folder), "--num-draft-tokens", "7" if kind == "dflash" else "3") as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0)
        assert httpx.get(u + "/health").json()["draft_kind"] == kind
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
        assert r.choices[0].text == ref and r.usage.speculation["drafted"] > 0
        follow = prompt + ref + "\n"
        again = c.completions.create(model=MODEL, prompt=follow, max_tokens=16)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert (
            again.choices[0].text
            == client.completions.create(model=MODEL, prompt=follow, max_tokens=16).choices[0].text
        )


def test_lookup_first_serves_the_same_text(client):
    """Prompt lookup in front of the head through the server: the same text, a follow-up turn on the saved target and
    head caches."""
    prompt = (
        "class Node:\n    def __init__(self, name):\n        self.name = name\n\nclass Leaf:\n    def "
        "__init__(self, name):\n"
    )
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40).choices[0].text
    with running_server("--draft-kind", "head", "--lookup-first") as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0)
        assert httpx.get(u + "/health").json()["draft_kind"] == "head+lookup"
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
        assert r.choices[0].text == ref and r.usage.speculation["rounds"] > 0
        follow = prompt + ref + "\n"
        again = c.completions.create(model=MODEL, prompt=follow, max_tokens=24)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert (
            again.choices[0].text
            == client.completions.create(model=MODEL, prompt=follow, max_tokens=24).choices[0].text
        )


def test_trees_serve_the_same_text(client):
    """`--tree-budget`: a real server's trees (prompt lookup's, else the head's) give the default server's text, four
    requests at once in batched tree rounds, a follow-up turn from the prompt cache, and a `json_schema` request and a
    `logit_bias` one walk their trees under the mask, each as the default server answers it; a start-up a tree cannot
    run is refused naming the flag."""
    prompts = [
        "def read_config(path):\n    ",
        "class Node:\n    def __init__(self, name):\n        self.name = name\n\nclass Leaf:\n    def __init__(self",
    ]
    refs = [client.completions.create(model=MODEL, prompt=p, max_tokens=40).choices[0].text for p in prompts]
    args = ("--draft-kind", "head", "--lookup-first", "--num-draft-tokens", "4", "--tree-budget", "8")
    with running_server(*args) as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        health = httpx.get(u + "/health").json()
        assert (health["draft_kind"], health["tree_budget"]) == ("head+lookup", 8)
        assert (health["batch"]["max_size"], health["batch"]["not_batched"]) == (8, None)  # batched trees (07ea)
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=40), prompts * 2))
        assert [o.choices[0].text for o in outs] == refs * 2
        spec = outs[0].usage.speculation
        assert spec["rounds"] > 0 and spec["accepted"] > 0
        follow = prompts[0] + refs[0] + "\n"
        again = c.completions.create(model=MODEL, prompt=follow, max_tokens=24)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        want = client.completions.create(model=MODEL, prompt=follow, max_tokens=24).choices[0].text
        assert again.choices[0].text == want
        fmt = {"type": "json_schema", "json_schema": {"name": "s0", "schema": SCHEMAS[0], "strict": True}}
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=120, response_format=fmt
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[0])
        ask = dict(messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=120, response_format=fmt)
        assert (
            r.choices[0].message.content
            == client.chat.completions.create(model=MODEL, **ask).choices[0].message.content
        )
        biased = dict(prompt=prompts[1], max_tokens=40, extra_body={"logit_bias": NO_EOS})
        assert (
            c.completions.create(model=MODEL, **biased).choices[0].text
            == client.completions.create(model=MODEL, **biased).choices[0].text
        )
    for bad, says in (
        (["--draft-kind", "none", "--tree-budget", "8"], "--tree-budget 8: --draft-kind none drafts nothing"),
        (["--tree-budget", "0"], "--tree-budget must be >= 1 (draft nodes per round), got 0"),
    ):
        status, err = refusal(["serve", "--port", "0", *bad])
        assert status == 2 and err.startswith("specnb: error:") and says in err and "Traceback" not in err, err


def _save_tiny(folder: Path, cfg: dict, seed: int, noise: float = 0.0):
    """A random mlx-lm model from `cfg` (weights from seed 0, times 1 + `noise` N(0, 1) drawn from `seed`) saved with
    the bundled tokenizer."""
    from specnb.models import model_from_config, perturbed, save_model

    m = model_from_config(cfg)
    save_model(perturbed(m, noise, seed=seed) if noise else m, cfg, folder)


def _tiny_configs(vocab: int) -> dict:
    """A llama whose even layers slide over 16 tokens, and a Qwen3-Next hybrid (Gated DeltaNet), with the bundled
    tokenizer's vocabulary."""
    from specnb.models import HYBRIDS

    shape = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    return {
        "sliding": dict(
            model_type="llama",
            **shape,
            num_hidden_layers=4,
            rms_norm_eps=1e-5,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "hybrid": dict(model_type="qwen3_next", **{**HYBRIDS["qwen3_next"], **shape}),
        # head dim 32: the smallest a quantized KV's group (32) divides
        "hybrid-kv": dict(model_type="qwen3_next", **{**HYBRIDS["qwen3_next"], **shape, "head_dim": 32}),
    }


@pytest.mark.parametrize("kind", ["sliding", "hybrid"])
def test_trees_on_sliding_and_hybrid_targets(kind, tmp_path):
    """`--tree-budget` on a sliding-window target: trees run past the window, two requests at once in batched tree
    rounds (each row's path kept on its own ring); on a hybrid target (Gated DeltaNet beside attention), batched tree
    rounds of leaf rows (04g, 07ea); each answer plain decoding's, with a bad request among them refused on its own."""
    import mlx_lm
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(bundled_dir("target") / "tokenizer.json")).get_vocab_size()
    cfg = _tiny_configs(vocab)[kind]
    _save_tiny(tmp_path / "target", cfg, 0)
    target, tok = mlx_lm.load(str(tmp_path / "target"))
    prompts = [tok.encode("def read_config(path):\n    with open(path) as f:\n") * k for k in (1, 3)]
    wants = [tok.decode(generate(target, p, max_tokens=24, eos_token_ids=tok.eos_token_ids).tokens) for p in prompts]
    # prompt lookup's trees: the two-model source grows trees on full-attention drafts only, and start-up says so
    args = ("--model", str(tmp_path / "target"), "--draft-kind", "ngram", "--tree-budget", "6")
    with running_server(*args) as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        health = httpx.get(u + "/health").json()
        assert (health["tree_budget"], health["batch"]["max_size"], health["batch"]["not_batched"]) == (6, 8, None)
        name = c.models.list().data[0].id
        with ThreadPoolExecutor(3) as pool:  # one bad request among them: a 400 naming it, the others unchanged
            bad = pool.submit(post_bad, u, "completions", {"model": name, "prompt": [1, 10**6], "max_tokens": 8})
            got = list(pool.map(lambda p: c.completions.create(model=name, prompt=p, max_tokens=24), prompts))
        assert bad.result().status_code == 400 and "1000000" in bad.result().json()["error"]["message"]
        assert [g.choices[0].text for g in got] == wants
        assert got[1].usage.speculation["rounds"] > 0


# the hybrid target with a quantized KV (#47): 4-bit from token 12, inside the longer prompts and among the answers'
KV_FLAGS = {"hybrid-kv": ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "12")}


@pytest.mark.parametrize("kind", ["sliding", "hybrid", "hybrid-kv"])
def test_prompt_cache_on_sliding_and_hybrid_targets(kind, tmp_path):
    """`specnb serve` on a tiny sliding-window and a tiny hybrid target with a perturbed draft, and the hybrid with a
    quantized KV: answers one at a time and batched equal plain decoding's with the same cache, and a follow-up turn
    reuses the cache and equals a fresh run."""
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(bundled_dir("target") / "tokenizer.json")).get_vocab_size()
    cfg = _tiny_configs(vocab)[kind]
    _save_tiny(tmp_path / "target", cfg, 0)
    _save_tiny(tmp_path / "draft", cfg, 1, noise=0.05)
    target, tok = mlx_lm.load(str(tmp_path / "target"))
    draft, _ = mlx_lm.load(str(tmp_path / "draft"))
    procs, eos = make_logits_processors({0: -100}), tok.eos_token_ids
    flags = KV_FLAGS.get(kind, ())
    kv = kv_flags(*(int(v) for v in flags[1::2]))
    run = lambda ids: (
        spec_generate(
            target, TwoModelProvider(draft), ids, max_tokens=24, eos_token_ids=eos, logits_processors=procs, **kv
        ).tokens
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "2 RecurrentCache stay full precision"
        plain = generate(target, [1, 2, 3], max_tokens=24, logits_processors=procs, **kv).tokens
    assert plain == run([1, 2, 3])  # speculation = plain decoding with the same cache
    # token ids, not text: a random model's text need not encode back to the same tokens, and a wrapped ring cannot be
    # cut back to a shorter match longer than the window
    prompt = tok.encode("def read_config(path):\n    with open(path) as f:\n        return f.read()\n\n" * 2)
    with running_server("--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"), *flags) as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        name = c.models.list().data[0].id
        first = c.completions.create(model=name, prompt=prompt, max_tokens=24, extra_body={"logit_bias": NO_EOS})
        tokens = run(prompt)
        assert first.choices[0].text == tok.decode(tokens) and first.usage.speculation["rounds"] > 0
        follow = prompt + tokens + tok.encode("\ndef main():\n")
        again = c.completions.create(model=name, prompt=follow, max_tokens=24, extra_body={"logit_bias": NO_EOS})
        batch = httpx.get(u + "/health").json()["batch"]
        # batched rounds take sliding windows and Gated DeltaNet layers (#31): three clients at once, each its text
        # alone
        assert (batch["max_size"], batch["not_batched"]) == (8, None), batch
        asks = [prompt[:n] for n in (9, 30, len(prompt))]
        with ThreadPoolExecutor(3) as ex:
            got = list(
                ex.map(
                    lambda p: c.completions.create(
                        model=name, prompt=p, max_tokens=24, extra_body={"logit_bias": NO_EOS}
                    ),
                    asks,
                )
            )
        assert [r.choices[0].text for r in got] == [tok.decode(run(p)) for p in asks]
    assert again.usage.prompt_tokens_details.cached_tokens >= len(prompt)
    assert again.choices[0].text == tok.decode(run(follow))  # identical to a fresh run


# --- The server holds its ground (issue 24)
# -------------------------------------------------------------------------------


# openai 1.x hands over the inner object, later versions the whole body
def _error(e) -> dict:
    return e.value.body.get("error", e.value.body)


def test_an_over_long_prompt_is_refused_within_a_second(client, url):
    """200,000 words (~400,000 tokens) against a 1,024-token context: 400 context_length_exceeded, counted only as far
    as it takes."""
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 200_000, max_tokens=16)
    took = time.monotonic() - t0
    assert took < 3, took  # about 0.1 s on a quiet machine: the slack is for a loaded 2-core one
    err = _error(e)
    assert (err["code"], err["param"]) == (
        "context_length_exceeded",
        "prompt",
    ) and "maximum context length is 1024 tokens" in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:  # exact numbers when the prompt is short enough to count
        client.completions.create(model=MODEL, prompt=[5] * 1000, max_tokens=100)
    assert "needs 1100 tokens (1000 in the prompt, 100 to generate)" in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 2000}], max_tokens=10
        )
    assert (_error(e)["code"], _error(e)["param"]) == ("context_length_exceeded", "messages")
    # no max_tokens: what fits
    r = client.completions.create(model=MODEL, prompt=[5] * 1000, extra_body={"logit_bias": NO_EOS})
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    assert metric(url, "specnb_refused_requests_total", reason="context_length_exceeded") >= 3


def _raw_post(url: str, head: bytes, body: bytes) -> tuple:
    "Send a request's headers and the start of its body on a raw socket; (status, JSON body, seconds until the answer)."
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        t0, data = time.monotonic(), b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    took = time.monotonic() - t0
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1]), took


def test_an_oversized_body_is_a_413_before_it_is_read(url):
    "A body declared at 50 MB is refused from its headers, while the client has sent only a kilobyte of it."
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: "
        b"50000000\r\n\r\n"
    )
    status, body, took = _raw_post(url, head, b'{"prompt": "' + b"x" * 1000)
    assert status == 413 and took < 3, (status, took)  # at once: the rest of the 50 MB would take far longer
    assert body["error"]["code"] == "request_too_large" and "50000000 bytes" in body["error"]["message"], body
    assert metric(url, "specnb_refused_requests_total", reason="request_too_large") >= 1
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200


LONG_CONTEXT = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=65536,
)  # KV: 2 KiB a token


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """A tiny random llama with a 64Ki-token context, served with prompt lookup, 64-token prefill chunks and a 48 MiB
    memory budget."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("long") / "target"
    _save_tiny(
        folder,
        {
            **LONG_CONTEXT,
            "vocab_size": Tokenizer.from_file(str(bundled_dir("target") / "tokenizer.json")).get_vocab_size(),
        },
        0,
    )
    with running_server(
        "--model", str(folder), "--draft-kind", "ngram", "--prefill-step-size", "64", "--memory-budget", "48MiB"
    ) as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        name = c.models.list().data[0].id
        c.completions.create(model=name, prompt=[5, 6, 7], max_tokens=4)  # warm: the thread pool has its threads
        yield u, c, name, httpx.get(u + "/health").json()


def _wait(cond, what: str, limit: float = 30):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, what
        time.sleep(0.05)


def test_memory_admission(long_context):
    """Never fits (also as n = 2 choices of a request that fits once): 400 at once. Fits alone but not beside the
    running one: waits in the queue, served once the first is done."""
    url, c, name, start = long_context
    mem = start["memory"]
    room, per = mem["budget"] - mem["resident"], 2048
    assert start["context_length"] == 65536 and mem["budget"] == 48 * 2**20, start
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt=[5] * 8, max_tokens=32_000)
    assert _error(e)["code"] == "memory_budget_exceeded" and "48.0 MiB" in _error(e)["message"], _error(e)
    big, small = int(room * 0.6) // per, int(room * 0.5) // per  # each fits alone; together they do not
    with pytest.raises(openai.BadRequestError) as e:  # n choices are n rows: one fits, two never do
        c.completions.create(model=name, prompt=[5] * 8, max_tokens=big, n=2)
    assert _error(e)["code"] == "memory_budget_exceeded" and "n = 2 choices" in _error(e)["message"], _error(e)
    a = c.completions.create(model=name, prompt=[5] * 8, max_tokens=big, stream=True, extra_body={"logit_bias": NO_EOS})
    for _, _ in zip(range(3), a):
        pass
    held = httpx.get(url + "/health").json()
    assert held["running"] == 1 and 0.55 * room < held["memory"]["requests"] <= room, held
    got = {}

    def second():
        b = c.completions.create(
            model=name, prompt=[6] * 8, max_tokens=small, stream=True, extra_body={"logit_bias": NO_EOS}
        )
        next(iter(b))
        got["first"] = time.monotonic()
        b.close()

    t = threading.Thread(target=second)
    t.start()
    _wait(lambda: httpx.get(url + "/health").json()["queue_depth"] == 1, "the second request was not queued")
    time.sleep(0.5)
    assert "first" not in got  # it waits while the first holds its memory
    a.close()
    closed = time.monotonic()
    t.join(60)
    assert got["first"] > closed
    _wait(lambda: httpx.get(url + "/health").json()["running"] == 0, "the worker did not finish")
    after = httpx.get(url + "/health").json()
    assert (after["queue_depth"], after["memory"]["requests"]) == (0, 0), after


def test_a_hang_up_during_a_long_prefill_frees_the_worker(long_context):
    """A 20,000-token prompt prefills in 64-token chunks for tens of seconds; the client leaves after a second, and the
    next request is served at once."""
    url, c, name, start = long_context
    long_prompt = [i % 4000 + 1 for i in range(20_000)]
    before = metric(url, "specnb_requests_total", endpoint="completions", finish_reason="cancelled")
    stream = c.completions.create(model=name, prompt=long_prompt, max_tokens=8, stream=True)  # streamed
    time.sleep(1.0)
    stream.close()
    t0 = time.monotonic()
    assert c.completions.create(model=name, prompt=[5, 6, 7], max_tokens=4).usage.completion_tokens == 4
    streamed_freed = time.monotonic() - t0
    with pytest.raises(httpx.ReadTimeout):  # one body at the end: the client gives up waiting
        httpx.post(
            url + "/v1/completions",
            json={"model": name, "prompt": long_prompt, "max_tokens": 8},
            timeout=httpx.Timeout(60, read=1.0),
        )
    t0 = time.monotonic()
    assert c.completions.create(model=name, prompt=[5, 6, 7], max_tokens=4).usage.completion_tokens == 4
    whole_freed = time.monotonic() - t0
    # a 64-token chunk, plus slack for a loaded machine
    assert streamed_freed < 6 and whole_freed < 6, (streamed_freed, whole_freed)
    assert metric(url, "specnb_requests_total", endpoint="completions", finish_reason="cancelled") == before + 2


def test_nothing_is_left_behind(long_context):
    """After the refused, queued, cancelled and abandoned requests above: no job, no reservation, no extra thread,
    memory back down."""
    url, c, name, start = long_context
    c.completions.create(model=name, prompt=[5, 6, 7], max_tokens=4)
    _wait(lambda: httpx.get(url + "/health").json()["running"] == 0, "the worker is still busy")
    h = httpx.get(url + "/health").json()
    assert (h["queue_depth"], h["running"], h["memory"]["requests"]) == (0, 0, 0), h
    assert h["threads"] <= start["threads"] + 4, (h["threads"], start["threads"])
    assert h["memory"]["mlx_active"] <= h["memory"]["resident"] + h["memory"]["prompt_cache"] + 2**20, h["memory"]
    if start["memory"]["rss"]:
        assert h["memory"]["rss"] < start["memory"]["rss"] + 48 * 2**20, (h["memory"]["rss"], start["memory"]["rss"])


def test_api_keys_and_a_prompt_exit_on_sigterm():
    """SPECNB_API_KEY: wrong or missing key 401 (openai.AuthenticationError), /health open, right key 200; then SIGTERM
    with a long generation running and one queued (or batched beside it): the stream ends with an error event, the
    second request gets 503, and the process is gone within 10 s."""
    key = "sk-specnb-test-0123"
    with serve_process(env={"SPECNB_API_KEY": key}) as s:
        wrong = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-wrong-key-999", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert (e.value.status_code, _error(e)["code"]) == (401, "invalid_api_key") and key not in str(e.value)
        missing = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert missing.status_code == 401 and set(missing.json()["error"]) == {"message", "type", "param", "code"}, (
            missing.text
        )
        assert httpx.get(s.url + "/health").status_code == 200
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=3).usage.completion_tokens == 3
        stream = c.completions.create(
            model=MODEL, prompt="def f():\n", max_tokens=900, stream=True, extra_body={"logit_bias": NO_EOS}
        )
        for _, _ in zip(range(3), stream):
            pass
        # the second cannot end before SIGTERM: 900 tokens and no EOS, whether it waits or joins the batch
        with ThreadPoolExecutor(1) as ex:
            queued = ex.submit(
                httpx.post,
                s.url + "/v1/completions",
                json={"prompt": "x", "max_tokens": 900, "logit_bias": NO_EOS},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            # batched (the default), the second joins the first's batch instead of waiting
            on = lambda h: h["queue_depth"] + h["running"]
            _wait(
                lambda: on(httpx.get(s.url + "/health").json()) == 2,
                "the second request was neither queued nor running",
            )
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            with pytest.raises(openai.APIError, match="shutting down"):
                for _ in stream:
                    pass
            r = queued.result()
        s.proc.wait(20)
        took = time.monotonic() - t0
    assert took < 20, took  # the server's own bound is a 5 s grace; the rest is slack for a loaded 2-core machine
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text


# ---- batched requests (--max-batch-size, default 8: the `client` server batches) ----

BATCH_PROMPTS = [
    "import os\n",
    "def add(a, b):\n",
    "class Node:\n",
    "for x in ",
    "while True:\n",
    "try:\n    ",
    "# Copyright ",
    "if __name__",
]


def _text(c, stream: bool, **kw) -> str:
    if not stream:
        return c.completions.create(model=MODEL, **kw).choices[0].text
    return "".join(x.choices[0].text for x in c.completions.create(model=MODEL, stream=True, **kw) if x.choices)


def test_eight_concurrent_batched_requests_equal_alone(client, url, pair):
    """8 at once — different prompts, lengths, γ (0: no draft source), two seeded sampled: each text is the one it gets
    alone, in shared rounds."""
    tok, no_eos = pair.tokenizer, make_logits_processors({0: -100})
    reqs = [
        dict(prompt=p, max_tokens=12 + 5 * i, extra_body={"num_draft_tokens": i % 5, "logit_bias": NO_EOS})
        for i, p in enumerate(BATCH_PROMPTS)
    ]
    for i in (3, 6):
        reqs[i].update(temperature=0.9, top_p=0.95, seed=100 + i)
    alone = [_text(client, i % 2 == 1, **kw) for i, kw in enumerate(reqs)]
    rounds, single = (
        metric(url, "specnb_batch_size_per_round_count"),
        metric(url, "specnb_batch_size_per_round_bucket", le="1.0"),
    )
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda i: _text(client, i % 2 == 1, **reqs[i]), range(8)))
    assert together == alone
    for i, kw in enumerate(reqs):
        if "seed" in kw:
            continue
        ref = in_process(
            pair, tok.encode(kw["prompt"]), kw["max_tokens"], num_draft_tokens=max(i % 5, 1), logits_processors=no_eos
        )
        assert alone[i] == tok.decode(ref.tokens), i
    shared = (metric(url, "specnb_batch_size_per_round_count") - rounds) - (
        metric(url, "specnb_batch_size_per_round_bucket", le="1.0") - single
    )
    assert shared > 0, "no round held more than one request"
    assert (
        metric(url, "specnb_request_tokens_per_second_count") >= 16
        and httpx.get(url + "/health").json()["batch"]["max_size"] == 8
    )


def _idle(u: str) -> dict:
    _wait(lambda: httpx.get(u + "/health").json()["running"] == 0, "the worker is still busy")
    return httpx.get(u + "/health").json()


def test_join_leave_cancel_full_queue_and_a_follow_up(pair):
    """Requests arrive mid-stream and end at different lengths, one is cancelled mid-stream, a burst fills the queue:
    every request is answered (200 or 503), each 200 is its text alone, and a follow-up turn on a cache saved from the
    batch equals a fresh run."""
    tok, no_eos = pair.tokenizer, make_logits_processors({0: -100})
    lengths = [8, 40, 16, 64, 24, 12, 48, 32]
    with running_server("--max-batch-size", "3", "--max-queue", "2") as u:
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0, timeout=120)

        def one(i):
            time.sleep(0.1 * i)  # each arrives while the others are generating
            body = {"prompt": BATCH_PROMPTS[i], "max_tokens": lengths[i], "logit_bias": NO_EOS}
            if i == 1:  # its client leaves after a few chunks
                with httpx.stream("POST", u + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                    for _, _ in zip(range(4), r.iter_lines()):
                        pass
                return r.status_code, None
            r = httpx.post(u + "/v1/completions", json=body, timeout=120)
            return r.status_code, r.json()

        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(one, range(8)))
        assert all(code in (200, 503) for code, _ in got), got
        for i, (code, body) in enumerate(got):
            if code != 200 or body is None:
                continue
            ref = in_process(pair, tok.encode(BATCH_PROMPTS[i]), lengths[i], logits_processors=no_eos)
            assert body["choices"][0]["text"] == tok.decode(ref.tokens), i
        burst = {"prompt": "def f():\n", "max_tokens": 150, "logit_bias": NO_EOS}
        with ThreadPoolExecutor(8) as ex:
            rs = list(ex.map(lambda _: httpx.post(u + "/v1/completions", json=burst, timeout=120), range(8)))
        codes = sorted(r.status_code for r in rs)
        # three in the batch, two waiting; the rest are told to retry
        assert set(codes) == {200, 503} and codes.count(200) >= 3, codes
        assert all(r.headers["retry-after"] == "1" for r in rs if r.status_code == 503)
        assert metric(u, "specnb_requests_total", endpoint="completions", finish_reason="cancelled") >= 1
        msgs = [{"role": "user", "content": "def mean(xs):"}]
        a1 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, extra_body={"logit_bias": NO_EOS})
        msgs += [
            {"role": "assistant", "content": a1.choices[0].message.content},
            {"role": "user", "content": "And the median?"},
        ]
        with ThreadPoolExecutor(3) as ex:  # the follow-up runs in a batch beside two others
            side = [ex.submit(c.completions.create, model=MODEL, prompt=p, max_tokens=40) for p in BATCH_PROMPTS[:2]]
            a2 = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, extra_body={"logit_bias": NO_EOS})
            assert all(f.result().usage.completion_tokens > 0 for f in side)
        assert a1.usage.prompt_tokens <= a2.usage.prompt_tokens_details.cached_tokens < a2.usage.prompt_tokens
        fresh = in_process(pair, chat_ids(tok, msgs), 30, logits_processors=no_eos)
        assert a2.choices[0].message.content == tok.decode(fresh.tokens)
        h = _idle(u)
        assert (h["queue_depth"], h["running"], h["memory"]["requests"], h["batch"]["size"]) == (0, 0, 0, 0), h


def test_load_32_clients_all_answered():
    """32 clients at once on loopback against 8 in a batch and 8 waiting, twice: every request is answered (200 or 503)
    in bounded time, nothing is left running, and no thread is left per request (anyio keeps up to 40 idle workers for
    prompts tokenized off the loop)."""
    with running_server("--max-batch-size", "8", "--max-queue", "8") as u:
        start = httpx.get(u + "/health").json()
        body, refused = {"prompt": "def f():\n", "max_tokens": 24, "logit_bias": NO_EOS}, 0
        for _ in range(2):  # 64 requests: a thread per request would pass anyio's 40
            t0 = time.monotonic()
            with ThreadPoolExecutor(32) as ex:
                rs = list(ex.map(lambda _: httpx.post(u + "/v1/completions", json=body, timeout=120), range(32)))
            took = time.monotonic() - t0
            codes = [r.status_code for r in rs]
            refused += codes.count(503)
            assert set(codes) <= {200, 503} and 200 in codes, codes
            assert all(r.json()["usage"]["completion_tokens"] == 24 for r in rs if r.status_code == 200)
            # the same request, the same text
            assert len({r.json()["choices"][0]["text"] for r in rs if r.status_code == 200}) == 1
            assert took < 90, took
            h = _idle(u)
            assert (h["status"], h["queue_depth"], h["running"], h["memory"]["requests"]) == ("ok", 0, 0, 0), h
        assert metric(u, "specnb_refused_requests_total", reason="queue_full") == refused
        assert h["threads"] <= start["threads"] + 40 + 2, (h["threads"], start["threads"])


def batched_as_alone(pair, provider, server_args: tuple, clients: int, max_tokens: int):
    """A server started with `server_args` batches (its `/health` says so), and `clients` concurrent clients each get
    the text `provider` gives alone."""
    tok = pair.tokenizer
    with running_server(*server_args) as u:
        b = httpx.get(u + "/health").json()["batch"]
        assert (b["max_size"], b["not_batched"]) == (8, None), b
        c = openai.OpenAI(base_url=u + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        ask = lambda p: c.completions.create(
            model=MODEL, prompt=p, max_tokens=max_tokens, extra_body={"logit_bias": NO_EOS}
        )
        with ThreadPoolExecutor(clients) as ex:
            got = list(ex.map(ask, BATCH_PROMPTS[:clients]))
    no_eos = make_logits_processors({0: -100})
    for r, p in zip(got, BATCH_PROMPTS[:clients]):
        ref = spec_generate(pair.target, provider, tok.encode(p), max_tokens=max_tokens, logits_processors=no_eos)
        assert r.choices[0].text == tok.decode(ref.tokens) and r.usage.speculation["drafted"] > 0


def test_cache_reading_sources_are_batched(pair):
    """An early-exit source drafts on the target's own caches: batched rounds lend each request its own row of them
    (#31) — 2 concurrent clients, each its text alone."""
    from specnb.sources.early_exit import EarlyExitProvider

    batched_as_alone(
        pair, EarlyExitProvider(3), ("--draft-kind", "early-exit", "--exit-layer", "3"), clients=2, max_tokens=16
    )


def test_hidden_state_drafters_are_batched(pair):
    """The draft head reads the target's hidden states: batched rounds hand each request its rows (#31) — 4 concurrent
    clients, each its text alone."""
    from specnb.sources.chain import HeadProvider

    batched_as_alone(pair, HeadProvider(), ("--draft-kind", "head"), clients=4, max_tokens=24)
