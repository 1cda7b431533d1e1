"""Issue #30 through a real `specnb serve` and the official `openai` client: tool calls (parsed by mlx-lm's parser;
required, named and strict calls under a grammar the drafts walk too), tool results fed back, reasoning apart from
content, `chat_template_kwargs`, `n` choices sharing one prefill, logprobs equal to plain decoding's and teacher
forcing's (greedy and sampled, whole and streamed), and XTC — all with speculation on.

The model is the bundled pair with the four Qwen markers added and a Qwen3-style chat template
(`specnb.serve.answer.qwen_style_folder`); Gemma 4's call format on the same pair with Gemma's markers and template
(`chat_style_folder(..., "gemma")`); SmolLM2-135M-Instruct with its own template, where #30 applies to it (logprobs,
`n`, streaming); and Gemma 3 270M, a base model (completions: `echo` with `logprobs`)."""

import json, math
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
import jsonschema, mlx.core as mx, mlx_lm, openai, pytest
from mlx_lm.sample_utils import make_logits_processors
from transformers import AutoTokenizer
from specnb.executor import generate
from specnb.oracle import forced_logprobs
from specnb.serve.harness import running_server
from specnb.models import gemma3_270m, smollm2
from specnb.serve.answer import chat_style_folder, qwen_style_folder
from specnb.serve.requests import choice_seed

pytestmark = pytest.mark.xdist_group("test_turns")  # the tests share module-scoped servers: one worker, in order

MODEL = "qwen-style"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    },
]
ASK = [{"role": "user", "content": "Weather in Paris for three days?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# How close two float32 logprobs of the bundled pair must be when they come from forwards of other shapes (a verify
# window against one-token steps, a batch against a row, a whole answer against teacher forcing): the sums run in other
# orders and differ by a few ulps, up to 1.5e-5 measured at logprobs near -8 with one BLAS thread (ulp 9.5e-7). A real
# error (another position's row, a missing penalty) is off by 1e-3 or more.
CLOSE = 3e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-style")
    return qwen_style_folder(d / "target"), qwen_style_folder(d / "draft", "draft")


@pytest.fixture(scope="module")
def loaded(folders):
    return mlx_lm.load(str(folders[0]))


@pytest.fixture(scope="module", params=["1", "8"], ids=["one-at-a-time", "batched"])
def client(request, folders):
    with running_server(
        "--model",
        str(folders[0]),
        "--draft-model",
        str(folders[1]),
        "--served-model-name",
        MODEL,
        "--max-batch-size",
        request.param,
    ) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=180)


def _calls(message) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(stream) -> dict:
    "A streamed chat answer put together as a client does: content, reasoning, tool calls by index, the finish reason."
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        for c in d.tool_calls or []:
            out["calls"][c.index] = (c.function.name, json.loads(c.function.arguments))
        out["finish"] = ch.choices[0].finish_reason or out["finish"]
    return out


def test_named_and_single_calls_parse_validate_and_speculate(client):
    """A named function, and `parallel_tool_calls: false`: exactly one call that validates, `finish_reason: tool_calls`,
    streamed the same, drafts kept."""
    for kw in (
        dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        dict(tool_choice="required", parallel_tool_calls=False),
    ):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, extra_body=NO_THINK, **kw
        )
        calls = _calls(r.choices[0].message)
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
        name, args = calls[0]
        if name == "get_weather":
            jsonschema.validate(args, WEATHER)
        assert r.usage.speculation["accepted"] > 0, r.usage
        s = _streamed(
            client.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, extra_body=NO_THINK, stream=True, **kw
            )
        )
        assert (list(s["calls"].values()), s["finish"], s["content"]) == (
            calls,
            "tool_calls",
            r.choices[0].message.content or "",
        ), s


def test_a_strict_function_in_auto_mode_validates(client):
    """`strict: true` under `tool_choice: auto`: the model may answer in text, and whatever call it writes validates (a
    sampled sweep)."""
    strict, made = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}], 0
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=strict,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            extra_body={**NO_THINK, "logit_bias": {"4098": 4}},
        )  # <tool_call> made likelier
        for name, args in _calls(r.choices[0].message):
            jsonschema.validate(args, WEATHER)
        made += len(_calls(r.choices[0].message))
        # a call cut short stays text
        if "<tool_call>" in (r.choices[0].message.content or ""):
            assert r.choices[0].finish_reason == "length"
    assert made > 0


def test_tool_results_go_back_through_the_template(client, loaded):
    """An answer's call and the tool's result, sent back as OpenAI's client sends them: the prompt is the template's
    rendering of exactly that."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        extra_body=NO_THINK,
    )
    call = r.choices[0].message.tool_calls[0]
    msgs = ASK + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8)
    _, tok = loaded
    text = tok.apply_chat_template(
        [
            *ASK,
            {
                "role": "assistant",
                "content": r.choices[0].message.content or "",
                "tool_calls": [
                    {"function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                ],
            },
            {"role": "tool", "content": "sunny, 21 C"},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert again.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_reasoning_is_apart_from_content(client, loaded):
    """Thinking on (the template opens `<think>`): the raw completion of the same prompt, split at `</think>`, is the
    chat answer's `reasoning_content` and `content`, streamed and whole; thinking off: no marker ever reaches the
    content."""
    _, tok = loaded
    prompt = tok.encode(
        tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    # </think> likelier, not certain
    kw = dict(max_tokens=40, temperature=1.0, seed=5, extra_body={"logit_bias": {"4097": 6}})
    raw = client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text
    whole = client.chat.completions.create(model=MODEL, messages=ASK, **kw).choices[0].message
    reasoning, _, content = raw.partition("</think>")
    assert (whole.model_extra["reasoning_content"], whole.content) == (reasoning, content), raw
    s = _streamed(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kw))
    assert (s["reasoning"], s["content"]) == (reasoning, content)
    off = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=40,
        temperature=1.0,
        seed=5,
        extra_body={**NO_THINK, "logit_bias": {"4096": 6, "4097": 6}},
    )  # the markers likelier
    assert "<think>" not in off.choices[0].message.content and "</think>" not in off.choices[0].message.content


def test_n_choices_share_one_prefill(client):
    """n = 3 seeded: choice i is the single request seeded `choice_seed(seed, i)`; the prompt counted once, read once
    (every choice a cache hit)."""
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, temperature=1.0, extra_body=NO_THINK)
    many = client.chat.completions.create(n=3, seed=7, **kw)
    alone = [client.chat.completions.create(seed=choice_seed(7, i), **kw) for i in range(3)]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert (
        many.usage.prompt_tokens == alone[0].usage.prompt_tokens == many.usage.prompt_tokens_details.cached_tokens + 1
    )
    streamed = ["", "", ""]
    for ch in client.chat.completions.create(n=3, seed=7, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in many.choices]


def _plain_logprobs(model, ids, n, k=5):
    "Plain decoding's tokens and logprobs for the same prompt (the oracle)."
    res = generate(model, ids, max_tokens=n, logprobs=k)
    return res.tokens, res.logprobs


def test_logprobs_equal_plain_decoding(client, loaded):
    """Greedy chat with `logprobs`/`top_logprobs=5`, whole and streamed: each token's logprob and alternatives equal
    plain decoding's within `CLOSE`."""
    model, tok = loaded
    ids = tok.encode(
        tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, enable_thinking=False),
        add_special_tokens=False,
    )
    toks, ref = _plain_logprobs(model, ids, 24)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=24, logprobs=True, top_logprobs=5, extra_body=NO_THINK
    )
    got = r.choices[0].logprobs.content
    assert r.usage.speculation["drafted"] > 0 and len(got) == len(toks)
    for g, (lp, top) in zip(got, ref):
        assert abs(g.logprob - lp) < CLOSE
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([l for _, l in top], abs=CLOSE)
    streamed = [
        e
        for ch in client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=24, logprobs=True, top_logprobs=5, extra_body=NO_THINK, stream=True
        )
        for e in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in got]


@lru_cache(maxsize=2)
def _vocab(tok) -> dict:
    """Each token's text as chat logprobs show it — its exact bytes, escaped where they are part of a character
    (`specnb.detok.token_bytes`) — → the ids with that text (one each in these vocabularies)."""
    from specnb.detok import token_bytes

    out = {}
    for i in range(len(tok._tokenizer)):
        out.setdefault(token_bytes(tok, i).decode("utf-8", "backslashreplace"), []).append(i)
    return out


def test_sampled_logprobs_are_teacher_forcings(client, loaded):
    """Sampled (seeded, temperature 0.7, a repetition penalty), whole and streamed at once (one batch on the batched
    server): each token's logprob and top 5 are teacher forcing's — one forward over prompt and answer, each row through
    the same penalty — within `CLOSE`. They are the target's distribution after the logits processors and before
    temperature, as mlx_lm.server reports them."""
    model, tok = loaded
    ids = tok.encode(
        tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, enable_thinking=False),
        add_special_tokens=False,
    )
    kw = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=24,
        temperature=0.7,
        seed=11,
        logprobs=True,
        top_logprobs=5,
        extra_body={**NO_THINK, "repetition_penalty": 1.3},
    )

    def streamed():
        chunks = client.chat.completions.create(stream=True, **kw)
        return [
            e
            for ch in chunks
            for e in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])
        ]

    with ThreadPoolExecutor(2) as pool:
        whole, stream = pool.submit(client.chat.completions.create, **kw), pool.submit(streamed)
        whole, stream = whole.result(), stream.result()
    got = whole.choices[0].logprobs.content
    assert whole.usage.speculation["drafted"] > 0 and len(got) == whole.usage.completion_tokens
    answer = [_vocab(tok)[e.token] for e in got]
    assert all(len(c) == 1 for c in answer), [e.token for e in got]
    ref = forced_logprobs(
        model,
        ids,
        [c[0] for c in answer],
        5,
        make_logits_processors(repetition_penalty=1.3, repetition_context_size=20),
    )
    raw = forced_logprobs(model, ids, [c[0] for c in answer], 0)
    # the penalty shows: these are not the unprocessed logits
    assert max(abs(e.logprob - lp) for e, (lp, _) in zip(got, raw)) > 1e-3
    for entries in (got, stream):
        assert [e.token for e in entries] == [e.token for e in got]
        for e, (lp, top) in zip(entries, ref):
            assert abs(e.logprob - lp) < CLOSE
            assert [t.logprob for t in e.top_logprobs] == pytest.approx([l for _, l in top], abs=CLOSE)


def test_xtc_never_emits_a_token_it_cuts(client, loaded):
    """`xtc_probability: 1` (every position cuts), under exact match and under speculative sampling: no emitted token is
    one XTC drops — more likely than `xtc_threshold` while a less likely token is too (the newline and EOS spared) —
    read off the returned top 10, which holds every token above 0.1; positions where XTC cut were there, and drafts were
    still accepted."""
    _, tok = loaded
    spared, cuts, accepted = {"\n", *(tok.decode([i]) for i in tok.eos_token_ids)}, 0, 0
    for rule in ("match", "rejection"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=32,
            temperature=1.0,
            seed=3,
            logprobs=True,
            top_logprobs=10,
            extra_body={**NO_THINK, "xtc_probability": 1.0, "xtc_threshold": 0.1, "acceptance": rule},
        )
        for e in r.choices[0].logprobs.content:
            above = [t.logprob for t in e.top_logprobs if math.exp(t.logprob) > 0.1]
            cuts += len(above) > 1
            if e.token not in spared:
                assert not (math.exp(e.logprob) > 0.1 and e.logprob > min(above)), (rule, e)
        accepted += r.usage.speculation["accepted"]
    assert cuts > 0 and accepted > 0, (cuts, accepted)


def test_echo_with_logprobs_scores_the_prompt(client, loaded):
    """lm-evaluation-harness's loglikelihood request: `echo` + `logprobs` + `max_tokens: 1` — the prompt's tokens scored
    by one full forward (first: null); streamed, the chunks' logprobs put together are the whole answer's (tokens,
    values, alternatives, offsets)."""
    model, tok = loaded
    text = "def add(a, b):\n    return a + b\n"
    ids = tok.encode(text)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    logits = model(mx.array([ids]))[0]
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[mx.arange(len(ids) - 1), mx.array(ids[1:])].tolist()
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) >= len(ids)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=CLOSE)
    assert r.choices[0].text.startswith(text) and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    chunks = [
        ch.choices[0].logprobs
        for ch in client.completions.create(model=MODEL, prompt=text, max_tokens=4, echo=True, logprobs=2, stream=True)
        if ch.choices and ch.choices[0].logprobs
    ]
    whole = client.completions.create(model=MODEL, prompt=text, max_tokens=4, echo=True, logprobs=2).choices[0].logprobs
    assert [t for c in chunks for t in c.tokens] == whole.tokens and [
        x for c in chunks for x in c.token_logprobs
    ] == whole.token_logprobs
    assert [x for c in chunks for x in c.top_logprobs] == whole.top_logprobs and [
        x for c in chunks for x in c.text_offset
    ] == whole.text_offset


def test_what_cannot_be_done_is_refused_by_name(client):
    bad = [
        dict(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS),
        dict(tool_choice="required"),
        dict(n=17),
        dict(tools=TOOLS, response_format={"type": "json_object"}),
    ]
    for kw, param in zip(bad, ["tool_choice", "tool_choice", "n", "response_format"]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_a_gemma_style_model_calls_under_its_grammar(tmp_path):
    """Gemma 4's format (`gemma4` parser, xgrammar's `gemma_4` tag without free whitespace, 08ca): a free call is
    served; required (one call) and named calls, a sampled sweep with `<|"|>` made likelier (the model never learnt it),
    each parse, validate and end `tool_calls`, streamed the same, with drafts accepted; a property Gemma's syntax cannot
    write is refused by name."""
    folder, draft = (
        chat_style_folder(tmp_path / "gemma-style", "gemma"),
        chat_style_folder(tmp_path / "gemma-draft", "gemma", "draft"),
    )
    quote = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids('<|"|>')
    with running_server(
        "--model", str(folder), "--draft-model", str(draft), "--served-model-name", "gemma-style"
    ) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        ask = lambda **kw: c.chat.completions.create(
            **{
                "model": "gemma-style",
                "messages": ASK,
                "tools": TOOLS,
                "max_tokens": 100,
                "extra_body": {**NO_THINK, "logit_bias": {str(quote): 6}},
                **kw,
            }
        )
        assert ask(max_tokens=8, tool_choice="auto").choices[0].finish_reason in ("stop", "length", "tool_calls")
        accepted = 0
        for kw in (
            dict(tool_choice="required", parallel_tool_calls=False),
            dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        ):
            for seed in range(3):
                r = ask(temperature=1.0, seed=seed, **kw)
                calls = _calls(r.choices[0].message)
                assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
                if calls[0][0] == "get_weather":
                    jsonschema.validate(calls[0][1], WEATHER)
                accepted += r.usage.speculation["accepted"]
            s = _streamed(ask(temperature=1.0, seed=seed, stream=True, **kw))
            assert (list(s["calls"].values()), s["finish"]) == (calls, "tool_calls"), s
        assert accepted > 0
        dashed = [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"a-b": {"type": "integer"}}}},
            }
        ]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model="gemma-style", messages=ASK, tools=dashed, tool_choice="required", max_tokens=8
            )
        assert e.value.body["param"] == "tools" and "'a-b'" in e.value.body["message"], e.value.body


def test_smollm2_chat_with_logprobs_and_choices():
    """SmolLM2-135M-Instruct through its own chat template (it has no tool-call format and no thinking markers: there
    #30 is logprobs, `n` and streaming, with prompt lookup drafting): n = 2 seeded choices at temperature 0.7, each
    token's logprob and top 5 teacher forcing's within 1e-4 (the bundled pair's gate is `CLOSE`, 3e-5: here float32
    forwards over windows of other shapes already differ by up to 4.8e-5, and greedy speculation against plain decoding
    by 3.2e-5, both measured), the stream the same text; `tools` refused by name rather than ignored."""
    folder = smollm2()
    model, tok = mlx_lm.load(str(folder))
    with running_server("--model", str(folder), "--draft-kind", "ngram", "--served-model-name", "smollm2") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=180)
        msgs = [{"role": "user", "content": "List the numbers from 1 to 10, separated by commas."}]
        kw = dict(
            model="smollm2", messages=msgs, max_tokens=16, temperature=0.7, seed=2, n=2, logprobs=True, top_logprobs=5
        )
        r = c.chat.completions.create(**kw)
        ids = tok.encode(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        for choice in r.choices:
            got = choice.logprobs.content
            answer = [_vocab(tok)[e.token] for e in got]
            assert all(len(a) == 1 for a in answer), [e.token for e in got]
            ref = forced_logprobs(model, ids, [a[0] for a in answer], 5)
            # 1e-4: a 30-layer float32 model's sums in windows of other shapes (4.8e-5 seen, OpenBLAS)
            for e, (lp, top) in zip(got, ref):
                assert abs(e.logprob - lp) < 1e-4
                assert [t.logprob for t in e.top_logprobs] == pytest.approx([l for _, l in top], abs=1e-4)
        assert r.usage.speculation["drafted"] > 0, r.usage
        streamed = ["", ""]
        for ch in c.chat.completions.create(stream=True, **kw):
            for x in ch.choices:
                streamed[x.index] += x.delta.content or ""
        assert streamed == [x.message.content for x in r.choices]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4, tools=TOOLS)
        assert e.value.body["param"] == "tools", e.value.body


def test_gemma3_270m_scores_a_prompt():
    """Gemma 3 270M (a base model: no chat template, so chat is refused by name, and #30's part for it is completions):
    lm-evaluation-harness's loglikelihood request — `echo` + `logprobs` — scores the prompt as one full forward does,
    the first token null: within 2e-5 (9.5e-6 seen under OpenBLAS: the server reads the prompt through its prefill and
    first verify window, the oracle in one forward, and an 18-layer float32 model's sums differ by that much)."""
    folder = gemma3_270m()
    model, tok = mlx_lm.load(str(folder))
    with running_server("--model", str(folder), "--draft-kind", "ngram", "--served-model-name", "gemma3") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=180)
        text = "The capital of France is Paris. The capital of Italy is Rome."
        r = c.completions.create(model="gemma3", prompt=text, max_tokens=1, echo=True, logprobs=3)
        ids = tok.encode(text)
        logits = model(mx.array([ids]))[0]
        want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[
            mx.arange(len(ids) - 1), mx.array(ids[1:])
        ].tolist()
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and r.choices[0].text.startswith(text)
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=2e-5)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="gemma3", messages=ASK, max_tokens=4)
        assert e.value.body["param"] == "messages" and "chat template" in e.value.body["message"], e.value.body
