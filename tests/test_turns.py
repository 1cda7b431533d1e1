"""Issue #30 through a real `specnb serve` and the official `openai` client: tool calls (parsed by mlx-lm's parser; required, named
and strict calls under a grammar the drafts walk too), tool results fed back, reasoning apart from content, `chat_template_kwargs`,
`n` choices sharing one prefill, and logprobs equal to plain decoding's — all with speculation on.

The model is the bundled pair with the four Qwen markers added and a Qwen3-style chat template (`specnb.serve.answer.qwen_style_folder`)."""
import json
import jsonschema, mlx.core as mx, mlx_lm, openai, pytest
from specnb.executor import generate
from specnb.harness import running_server
from specnb.serve.answer import qwen_style_folder
from specnb.serve.requests import choice_seed

MODEL = "qwen-style"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris for three days?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-style")
    return qwen_style_folder(d / "target"), qwen_style_folder(d / "draft", "draft")

@pytest.fixture(scope="module")
def loaded(folders): return mlx_lm.load(str(folders[0]))

@pytest.fixture(scope="module", params=["1", "8"], ids=["one-at-a-time", "batched"])
def client(request, folders):
    with running_server("--model", str(folders[0]), "--draft-model", str(folders[1]), "--served-model-name", MODEL,
                        "--max-batch-size", request.param) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=180)

def _calls(message)->list: return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]

def _streamed(stream)->dict:
    "A streamed chat answer put together as a client does: content, reasoning, tool calls by index, the finish reason."
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for ch in stream:
        if not ch.choices: continue
        d = ch.choices[0].delta
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        for c in d.tool_calls or []: out["calls"][c.index] = (c.function.name, json.loads(c.function.arguments))
        out["finish"] = ch.choices[0].finish_reason or out["finish"]
    return out

def test_named_and_single_calls_parse_validate_and_speculate(client):
    "A named function, and `parallel_tool_calls: false`: exactly one call that validates, `finish_reason: tool_calls`, streamed the same, drafts kept."
    for kw in (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), dict(tool_choice="required", parallel_tool_calls=False)):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, extra_body=NO_THINK, **kw)
        calls = _calls(r.choices[0].message)
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
        name, args = calls[0]
        if name == "get_weather": jsonschema.validate(args, WEATHER)
        assert r.usage.speculation["accepted"] > 0, r.usage
        s = _streamed(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, extra_body=NO_THINK, stream=True, **kw))
        assert (list(s["calls"].values()), s["finish"], s["content"]) == (calls, "tool_calls", r.choices[0].message.content or ""), s

def test_a_strict_function_in_auto_mode_validates(client):
    "`strict: true` under `tool_choice: auto`: the model may answer in text, and whatever call it writes validates (a sampled sweep)."
    strict, made = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}], 0
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=strict, max_tokens=120, temperature=1.0, seed=seed,
                                           extra_body={**NO_THINK, "logit_bias": {"4098": 4}})   # <tool_call> made likelier
        for name, args in _calls(r.choices[0].message): jsonschema.validate(args, WEATHER)
        made += len(_calls(r.choices[0].message))
        if "<tool_call>" in (r.choices[0].message.content or ""): assert r.choices[0].finish_reason == "length"   # a call cut short stays text
    assert made > 0

def test_tool_results_go_back_through_the_template(client, loaded):
    "An answer's call and the tool's result, sent back as OpenAI's client sends them: the prompt is the template's rendering of exactly that."
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                       extra_body=NO_THINK)
    call = r.choices[0].message.tool_calls[0]
    msgs = ASK + [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8)
    _, tok = loaded
    text = tok.apply_chat_template([*ASK, {"role": "assistant", "content": r.choices[0].message.content or "",
                                           "tool_calls": [{"function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
                                    {"role": "tool", "content": "sunny, 21 C"}], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert again.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))

def test_reasoning_is_apart_from_content(client, loaded):
    """Thinking on (the template opens `<think>`): the raw completion of the same prompt, split at `</think>`, is the chat answer's
    `reasoning_content` and `content`, streamed and whole; thinking off: no marker ever reaches the content."""
    _, tok = loaded
    prompt = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    kw = dict(max_tokens=40, temperature=1.0, seed=5, extra_body={"logit_bias": {"4097": 6}})   # </think> likelier, not certain
    raw = client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text
    whole = client.chat.completions.create(model=MODEL, messages=ASK, **kw).choices[0].message
    reasoning, _, content = raw.partition("</think>")
    assert (whole.model_extra["reasoning_content"], whole.content) == (reasoning, content), raw
    s = _streamed(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kw))
    assert (s["reasoning"], s["content"]) == (reasoning, content)
    off = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=5,
                                         extra_body={**NO_THINK, "logit_bias": {"4096": 6, "4097": 6}})   # the markers likelier
    assert "<think>" not in off.choices[0].message.content and "</think>" not in off.choices[0].message.content

def test_n_choices_share_one_prefill(client):
    "n = 3 seeded: choice i is the single request seeded `choice_seed(seed, i)`; the prompt counted once, read once (every choice a cache hit)."
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, temperature=1.0, extra_body=NO_THINK)
    many = client.chat.completions.create(n=3, seed=7, **kw)
    alone = [client.chat.completions.create(seed=choice_seed(7, i), **kw) for i in range(3)]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens == many.usage.prompt_tokens_details.cached_tokens + 1
    streamed = ["", "", ""]
    for ch in client.chat.completions.create(n=3, seed=7, stream=True, **kw):
        for c in ch.choices: streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in many.choices]

def _plain_logprobs(model, ids, n, k=5):
    "Plain decoding's tokens and logprobs for the same prompt (the oracle)."
    res = generate(model, ids, max_tokens=n, logprobs=k)
    return res.tokens, res.logprobs

def test_logprobs_equal_plain_decoding(client, loaded):
    "Greedy chat with `logprobs`/`top_logprobs=5`, whole and streamed: each token's logprob and alternatives equal plain decoding's within 1e-5."
    model, tok = loaded
    ids = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, enable_thinking=False), add_special_tokens=False)
    toks, ref = _plain_logprobs(model, ids, 24)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, logprobs=True, top_logprobs=5, extra_body=NO_THINK)
    got = r.choices[0].logprobs.content
    assert r.usage.speculation["drafted"] > 0 and len(got) == len(toks)
    for g, (lp, top) in zip(got, ref):
        assert abs(g.logprob - lp) < 1e-5
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([l for _, l in top], abs=1e-5)
    streamed = [e for ch in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, logprobs=True, top_logprobs=5,
                                                           extra_body=NO_THINK, stream=True)
                for e in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in got]

def test_echo_with_logprobs_scores_the_prompt(client, loaded):
    "lm-evaluation-harness's loglikelihood request: `echo` + `logprobs` + `max_tokens: 1` — the prompt's tokens scored by one full forward (first: null)."
    model, tok = loaded
    text = "def add(a, b):\n    return a + b\n"
    ids = tok.encode(text)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    logits = model(mx.array([ids]))[0]
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[mx.arange(len(ids) - 1), mx.array(ids[1:])].tolist()
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) >= len(ids)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-5)
    assert r.choices[0].text.startswith(text) and lp.text_offset[:2] == [0, len(lp.tokens[0])]

def test_what_cannot_be_done_is_refused_by_name(client):
    bad = [dict(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS),
           dict(tool_choice="required"), dict(n=17), dict(tools=TOOLS, response_format={"type": "json_object"})]
    for kw, param in zip(bad, ["tool_choice", "tool_choice", "n", "response_format"]):
        with pytest.raises(openai.BadRequestError) as e: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)

def test_a_gemma_style_model_calls_freely_and_refuses_a_forced_call_by_name(tmp_path):
    """Gemma 4's format: `tool_choice: auto` is served (mlx-lm's gemma4 parser reads what the model writes), but a required call is refused
    naming the reason — xgrammar's grammar of that format lets whitespace stand where mlx-lm's parser cannot read it (08ca)."""
    from specnb.serve.answer import chat_style_folder
    folder = chat_style_folder(tmp_path / "gemma-style", "gemma")
    with running_server("--model", str(folder), "--draft-kind", "ngram", "--served-model-name", "gemma-style") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="gemma-style", messages=ASK, tools=TOOLS, max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="gemma-style", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8)
        assert e.value.body["param"] == "tool_choice" and "gemma4" in e.value.body["message"], e.value.body
