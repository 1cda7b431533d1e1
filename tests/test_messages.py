"""Anthropic's Messages API (issue #46) through a real `specnb serve` and the official `anthropic` client: text with a
system prompt, thinking, a tool_use / tool_result round trip, a forced call whose input is valid JSON, stop sequences,
the max_tokens stop, count_tokens, errors in Anthropic's shape raised as the SDK's own, the API key as `x-api-key`,
Anthropic's exact event order, and a body as Claude Code sends it — each answer the chat route's answer to the same
conversation (the same tokens at temperature 0), since the route is a translation onto it.

One server for the module: the bundled pair with a Qwen3-style chat template (tool calls and thinking, 08ca), an API key
on."""

import json, re
import anthropic, httpx, jsonschema, openai, pytest
from specnb.serve.answer import qwen_style_folder
from specnb.serve.harness import running_server
from conftest import sse_events

pytestmark = pytest.mark.xdist_group("test_messages")  # the tests share one module-scoped server: one worker, in order

MODEL, KEY = "qwen-style", "sk-test-messages"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
OFF = {"type": "disabled"}  # thinking off: the template closes the think block
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
T0 = {"temperature": 0}  # (the SDK no longer names temperature: the server still reads it, as Claude Code sends it)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-style")
    target, draft = qwen_style_folder(d / "target"), qwen_style_folder(d / "draft", "draft")
    args = ("--model", str(target), "--draft-model", str(draft), "--served-model-name", MODEL, "--api-key", KEY)
    with running_server(*args) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120).chat.completions


def blocks(message) -> list:
    return [b.model_dump(exclude_none=True) for b in message.content]


def events(url, body) -> list:
    "`(event name, data)` of a streamed answer, read as raw server-sent events."
    return sse_events(url, "/v1/messages", body, {"x-api-key": KEY, "anthropic-version": "2023-06-01"})


# Anthropic's order: start, then blocks (each start, deltas, stop; a ping after the first start), then delta and stop
ORDER = re.compile(
    r"message_start (content_block_start (ping )?(content_block_delta )*content_block_stop )*"
    r"(ping )?message_delta message_stop"
)


def test_text_with_a_system_prompt_is_the_chat_answer(client, chat, url):
    """A system prompt and a user turn, thinking off: the text, the stop reason and the token counts are the chat
    route's for the same messages at temperature 0; streamed, the SDK assembles the same message from Anthropic's
    events, in Anthropic's order."""
    system, ask = "You write Python.", "Write a for loop."
    kw = dict(model=MODEL, max_tokens=24, thinking=OFF)
    m = client.messages.create(system=system, messages=[{"role": "user", "content": ask}], extra_body=T0, **kw)
    ref = chat.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": ask}],
        max_tokens=24,
        temperature=0,
        extra_body=NO_THINK,
    )
    assert blocks(m) == [{"type": "text", "text": ref.choices[0].message.content}]
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", ref.usage.completion_tokens) == ("max_tokens", 24)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    system_blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    with client.messages.stream(
        system=system_blocks, messages=[{"role": "user", "content": ask}], extra_body=T0, **kw
    ) as s:
        streamed = s.get_final_message()
    assert (blocks(streamed), streamed.stop_reason) == (blocks(m), "max_tokens")
    evs = events(url, {**kw, **T0, "system": system, "messages": [{"role": "user", "content": ask}]})
    assert ORDER.fullmatch(" ".join(n for n, _ in evs)), [n for n, _ in evs]
    assert [n for n, _ in evs][:3] == ["message_start", "content_block_start", "ping"]
    assert all(d["type"] == n for n, d in evs)
    text = "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")
    assert text == m.content[0].text
    assert evs[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert evs[-2][1]["usage"]["output_tokens"] == 24


def test_thinking_is_a_thinking_block(client, chat):
    "Thinking on (the template opens `<think>`): the chat route's reasoning is the thinking block, its content the text"
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = client.messages.create(
        model=MODEL, max_tokens=30, extra_body=T0, messages=ask, thinking={"type": "enabled", "budget_tokens": 20}
    )
    ref = chat.create(model=MODEL, messages=ask, max_tokens=30, temperature=0).choices[0].message
    want = [{"type": "thinking", "thinking": ref.model_extra["reasoning_content"], "signature": ""}]
    want += [{"type": "text", "text": ref.content}] if ref.content else []
    assert blocks(m) == want


def test_forced_tool_round_trip(client, chat, url):
    """A forced call (tool_choice tool, under the grammar): a tool_use block whose input validates, stop reason
    tool_use, the same streamed (input_json_delta); then the result goes back as a tool_result and the answer is the
    chat route's to the same conversation with the same call id."""
    ask = {"role": "user", "content": "Weather in Paris for three days?"}
    kw = dict(model=MODEL, max_tokens=60, tools=TOOLS, thinking=OFF)
    m = client.messages.create(messages=[ask], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=T0, **kw)
    assert m.stop_reason == "tool_use", m
    call = m.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    evs = events(url, {**kw, **T0, "messages": [ask], "tool_choice": {"type": "tool", "name": "get_weather"}})
    starts = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    partial = "".join(
        d["delta"]["partial_json"] for n, d in evs if d.get("delta", {}).get("type") == "input_json_delta"
    )
    assert json.loads(partial) == call.input and evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    # the round trip
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 21°C"}]}
    turns = [ask, {"role": "assistant", "content": blocks(m)}, {"role": "user", "content": [result]}]
    back = client.messages.create(messages=turns, extra_body=T0, **kw)
    args = json.dumps(call.input, ensure_ascii=False)
    text = m.content[0].text if m.content[0].type == "text" else None
    ref = chat.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": ask["content"]},
            {"role": "assistant", "content": text, "tool_calls": [_call(call.id, "get_weather", args)]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21°C"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": t["name"], "description": t["description"], "parameters": WEATHER},
            }
            for t in TOOLS
        ],
        max_tokens=60,
        temperature=0,
        extra_body=NO_THINK,
    )
    assert _same(back, ref), (blocks(back), ref.choices[0])


def _call(id, name, args) -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": args}}


def _same(m, ref) -> bool:
    "Is Message `m` the chat answer `ref`: its text, its calls (name and input), its token count?"
    msg = ref.choices[0].message
    text = "".join(b.text for b in m.content if b.type == "text")
    calls = [(b.name, b.input) for b in m.content if b.type == "tool_use"]
    ref_calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    return (text, calls, m.usage.output_tokens) == (msg.content or "", ref_calls, ref.usage.completion_tokens)


def test_any_tool_is_a_required_call(client):
    "tool_choice any: a call is required, so the answer holds one, with an input that validates."
    m = client.messages.create(
        model=MODEL,
        max_tokens=80,
        extra_body=T0,
        thinking=OFF,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and m.stop_reason in ("tool_use", "max_tokens"), m
    if m.stop_reason == "tool_use":
        jsonschema.validate(calls[0].input, WEATHER)


def test_stop_sequences_and_max_tokens(client):
    """A stop sequence taken from the free answer ends it there: stop_reason stop_sequence, `stop_sequence` the one that
    matched (of two), the text before it; streamed alike. A short max_tokens is stop_reason max_tokens."""
    kw = dict(model=MODEL, extra_body=T0, thinking=OFF, messages=[{"role": "user", "content": "Write a for loop."}])
    free = client.messages.create(max_tokens=30, **kw).content[0].text
    stop = free.strip()[4:7]
    assert len(stop) == 3 and stop in free
    m = client.messages.create(max_tokens=30, stop_sequences=["never-there", stop], **kw)
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", stop, free[: free.index(stop)])
    with client.messages.stream(max_tokens=30, stop_sequences=["never-there", stop], **kw) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.content[0].text) == (
        "stop_sequence",
        stop,
        m.content[0].text,
    )
    short = client.messages.create(max_tokens=3, **kw)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)


def test_count_tokens_is_what_a_call_reads(client):
    "count_tokens says how many tokens the prompt is: a real call's input_tokens plus those the prompt cache held."
    body = dict(
        model=MODEL,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Weather in Rome for two days?"}],
        tools=TOOLS,
        thinking=OFF,
    )
    n = client.messages.count_tokens(**body).input_tokens
    u = client.messages.create(max_tokens=2, **body).usage
    assert n == u.input_tokens + u.cache_read_input_tokens and n > 20, (n, u)


@pytest.mark.parametrize(
    "body,says",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens: field required"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
                        ],
                    }
                ],
            },
            "messages[0].content[0]: image blocks are not supported",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "get_time"},
            },
            "tool_choice.name: 'get_time' is not among the tools (get_weather)",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0]: server tool type 'web_search_20250305' is not supported",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "container": "c"},
            "container: unknown field",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 9},
            },
            "thinking.budget_tokens 9 must be less than max_tokens 5",
        ),
    ],
    ids=["no max_tokens", "bad role", "image", "unknown tool", "server tool", "unknown field", "budget"],
)
def test_errors_are_anthropics(client, body, says):
    """Each refusal is the SDK's BadRequestError with Anthropic's error object, whose message names the field (sent with
    the SDK's `post`, which checks nothing first)."""
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": MODEL, **body}, cast_to=object)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert says in e.value.body["error"]["message"], e.value.body


def test_keys_and_unknown_models(url, client):
    """The key is read from `x-api-key` (Anthropic's clients) or a Bearer token; a wrong one is the SDK's
    AuthenticationError, an unknown model its NotFoundError — Anthropic's shape both."""
    ask = dict(max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, **ask).stop_reason
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(model=MODEL, **ask)
    assert e.value.body["error"]["type"] == "authentication_error"
    bare = httpx.post(f"{url}/v1/messages", json={"model": MODEL, **ask}, timeout=30)  # no key: where one goes
    assert bare.status_code == 401 and "x-api-key header" in bare.json()["error"]["message"], bare.text
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", **ask)
    assert e.value.body["error"]["type"] == "not_found_error" and "'claude-sonnet-4-5' is not served" in str(e.value)


# A request as Claude Code 2.0.76 (@anthropic-ai/claude-code, cli.js) builds it for its main loop: system as text blocks
# with cache_control, tools with JSON-schema inputs, metadata.user_id, thinking enabled with a budget, stream true, the
# last user block marked for caching; its `betas` travel as the anthropic-beta header. Cut to fit the bundled model's
# 1,024-token context.
CLAUDE_CODE = {
    "model": MODEL,
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>\nThe date is 2025-12-05.\n</system-reminder>"},
                {"type": "text", "text": "List the Python files here.", "cache_control": {"type": "ephemeral"}},
            ],
        }
    ],
    "system": [
        {
            "type": "text",
            "text": "You are Claude Code, Anthropic's official CLI for Claude.",
            "cache_control": {"type": "ephemeral"},
        },
        {
            "type": "text",
            "text": "You help with software engineering tasks. Be concise.",
            "cache_control": {"type": "ephemeral"},
        },
    ],
    "tools": [
        {
            "name": "Bash",
            "description": "Executes a given bash command",
            "input_schema": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command to execute"},
                    "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
                },
                "required": ["command"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        },
        {
            "name": "Glob",
            "description": "Fast file pattern matching",
            "input_schema": {
                "type": "object",
                "properties": {"pattern": {"type": "string", "description": "The glob pattern"}},
                "required": ["pattern"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
            "cache_control": {"type": "ephemeral"},
        },
    ],
    "metadata": {"user_id": "user_6b8f0c1e2d_account__session_2f1e7a34-9d0b-4c1a-8e52-0c7d3a9b1f60"},
    "max_tokens": 64,
    "thinking": {"type": "enabled", "budget_tokens": 48},
    "stream": True,
}


def test_a_claude_code_request(url):
    "Claude Code's body, sent as it sends it (its headers too), is answered with Anthropic's events in their order."
    headers = {
        "x-api-key": KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
        "x-app": "cli",
        "user-agent": "claude-cli/2.0.76 (external, cli)",
    }
    with httpx.stream("POST", url + "/v1/messages", json=CLAUDE_CODE, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        text = r.read().decode()
    names = re.findall(r"^event: (\S+)$", text, re.M)
    assert ORDER.fullmatch(" ".join(names)), names
    last = json.loads(text.strip().split("\n\n")[-2].split("data: ", 1)[1])
    assert last["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use") and last["usage"]["output_tokens"] > 0
