"""OpenAI's Responses API (issue #46) through a real `specnb serve` and the official `openai` client: text with
instructions, reasoning as a reasoning item, a forced function call whose arguments validate and its output sent back,
`previous_response_id` continuing a conversation, `store: false`, `GET /v1/responses/{id}`, a json_schema format, the
exact order of the streamed events, refusals by name, and requests as the OpenAI Agents SDK sends them (replayed
verbatim, and the SDK itself running an agent) — each answer the chat route's answer to the same conversation (the same
tokens at temperature 0), since the route is a translation onto it.

One server for the module: the bundled pair with a Qwen3-style chat template (tool calls and thinking, 08ca)."""

import json, re
import httpx, jsonschema, openai, pytest
from specnb.serve.answer import qwen_style_folder
from specnb.serve.harness import running_server
from conftest import sse_events

pytestmark = pytest.mark.xdist_group("test_responses")  # the tests share one module-scoped server: one worker, in order

MODEL = "qwen-style"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
OFF = {"effort": "none"}  # reasoning off: the template closes the think block
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-style")
    target, draft = qwen_style_folder(d / "target"), qwen_style_folder(d / "draft", "draft")
    with running_server("--model", str(target), "--draft-model", str(draft), "--served-model-name", MODEL) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def chat_answer(client, messages, max_tokens, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=NO_THINK, **kw
    )


def raw_events(url, body) -> list:
    "`(event name, data)` of a streamed answer, read as raw server-sent events."
    return sse_events(url, "/v1/responses", body)


# the Responses events in order: created, in_progress, items (each: added, its part or arguments, done), the end
ITEM = (
    r"response\.output_item\.added (response\.content_part\.added (response\.(output|reasoning)_text\.delta )*"
    r"response\.(output|reasoning)_text\.done response\.content_part\.done |response\.function_call_arguments\.delta "
    r"response\.function_call_arguments\.done )response\.output_item\.done "
)
ORDER = re.compile(rf"response\.created response\.in_progress ({ITEM})+response\.(completed|incomplete)")


def test_text_with_instructions_is_the_chat_answer(client, url):
    """Instructions and a user turn, reasoning off: one message item whose text is the chat route's for the same
    messages at temperature 0; status incomplete at max_output_tokens; streamed, the same text through the Responses
    events, in order, numbered."""
    kw = dict(model=MODEL, instructions="You write Python.", max_output_tokens=24, temperature=0, reasoning=OFF)
    r = client.responses.create(input="Write a for loop.", **kw)
    ref = chat_answer(
        client,
        [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Write a for loop."}],
        24,
    )
    assert [it.type for it in r.output] == ["message"] and r.output_text == ref.choices[0].message.content
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, 24)
    assert r.usage.total_tokens == r.usage.input_tokens + 24 and r.id.startswith("resp_") and r.model == MODEL
    evs = list(client.responses.create(input="Write a for loop.", stream=True, **kw))
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[-1].type == "response.incomplete" and evs[-1].response.output_text == r.output_text
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == r.output_text
    names = [n for n, _ in raw_events(url, {**kw, "input": "Write a for loop."})]
    assert ORDER.fullmatch(" ".join(names)), names


def test_reasoning_is_a_reasoning_item(client):
    "Reasoning on (the template opens `<think>`): the chat route's reasoning is a reasoning item, its content a message"
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=ask, max_output_tokens=30, temperature=0)
    ref = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=30, temperature=0).choices[0].message
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == ref.model_extra["reasoning_content"]
    assert r.output_text == (ref.content or "")
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_previous_response_id_continues_the_conversation(client):
    """A second turn by `previous_response_id` is the chat answer to the whole conversation (the first turn's
    instructions not carried on, as OpenAI does); `GET /v1/responses/{id}` reads a response back."""
    kw = dict(model=MODEL, max_output_tokens=16, temperature=0, reasoning=OFF)
    first = client.responses.create(instructions="Be brief.", input="Write a for loop.", **kw)
    second = client.responses.create(previous_response_id=first.id, input="Now a while loop.", **kw)
    turns = [
        {"role": "user", "content": "Write a for loop."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Now a while loop."},
    ]
    assert second.output_text == chat_answer(client, turns, 16).choices[0].message.content
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()


def test_store_false_is_not_kept(client):
    "A response made with `store: false` is not kept: reading it is a 404, continuing it a 400 naming the field."
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False, reasoning=OFF)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id" and f"no response '{r.id}' is kept" in e.value.message


def test_json_schema_format(client):
    "A json_schema `text.format`: the answer parses and validates (the chat route's grammar)."
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}
    r = client.responses.create(
        model=MODEL, input="Weather in Paris?", max_output_tokens=80, temperature=0, reasoning=OFF, text={"format": fmt}
    )
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_forced_function_call_round_trip(client, url):
    """A named function (under the grammar): a function_call item whose arguments validate, streamed as
    function_call_arguments events; its output sent back — the earlier items as input, as the Agents SDK does, or by
    `previous_response_id` — is the chat route's answer to the same conversation."""
    kw = dict(model=MODEL, max_output_tokens=60, temperature=0, reasoning=OFF, tools=[TOOL])
    ask = {"role": "user", "content": "Weather in Paris for three days?"}
    r = client.responses.create(input=[ask], tool_choice={"type": "function", "name": "get_weather"}, **kw)
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed", r
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    evs = raw_events(url, {**kw, "input": [ask], "tool_choice": {"type": "function", "name": "get_weather"}})
    done = [d for n, d in evs if n == "response.function_call_arguments.done"]
    assert [json.loads(d["arguments"]) for d in done] == [json.loads(call.arguments)]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21°C"}
    again = client.responses.create(input=[ask, *[it.model_dump(exclude_none=True) for it in r.output], result], **kw)
    chained = client.responses.create(previous_response_id=r.id, input=[result], **kw)
    text = "".join(c.text for it in r.output if it.type == "message" for c in it.content) or None
    calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
    ref = chat_answer(
        client,
        [
            {"role": "user", "content": ask["content"]},
            {"role": "assistant", "content": text, "tool_calls": calls},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21°C"},
        ],
        60,
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
    )
    want = (ref.choices[0].message.content or "", ref.usage.completion_tokens)
    assert (again.output_text, again.usage.output_tokens) == want
    assert (chained.output_text, chained.usage.output_tokens) == want


@pytest.mark.parametrize(
    "extra,says",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]: built-in tool type 'web_search' is not supported"),
        ({"background": True}, "background: true is not supported"),
        ({"include": ["reasoning.encrypted_content"]}, "include is not supported"),
        ({"truncation": "auto"}, "truncation 'auto' is not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input[0].content[0]: input_image parts are not supported",
        ),
        ({"conversation": "conv_1"}, "conversation: unknown field"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"}},
            "function 'get_time' is not among",
        ),
    ],
    ids=["web search", "background", "include", "truncation", "image", "conversation", "unknown function"],
)
def test_what_cannot_be_done_is_refused_by_name(client, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body={"model": MODEL, "input": "hi", **extra}, cast_to=object)
    assert says in e.value.message and e.value.body["type"] == "invalid_request_error", e.value.body


# The body the OpenAI Agents SDK (openai-agents 0.24, agents/models/openai_responses.py `_build_response_create_kwargs`)
# sends for an agent with instructions and one strict function tool, streamed: its input items as
# `ItemHelpers.input_to_new_input_list` makes them, `include` always sent (empty), unset settings left out.
AGENTS_SDK = {
    "include": [],
    "input": [{"content": "Weather in Paris for three days?", "role": "user"}],
    "instructions": "You are a helpful weather agent.",
    "model": MODEL,
    "tools": [
        {
            "name": "get_weather",
            "parameters": {**WEATHER, "title": "get_weather_args"},
            "strict": True,
            "type": "function",
            "description": "The weather in a city",
        }
    ],
    "max_output_tokens": 60,
    "reasoning": {"effort": "none"},
    "stream": True,
}


def test_an_agents_sdk_request(url):
    "The Agents SDK's body, sent verbatim, is answered with the Responses events in order, ending with the response."
    evs = raw_events(url, AGENTS_SDK)
    assert ORDER.fullmatch(" ".join(n for n, _ in evs)), [n for n, _ in evs]
    assert evs[-1][1]["response"]["tools"][0]["strict"] is True


def test_the_agents_sdk_runs_an_agent(url, client):
    """The Agents SDK itself runs an agent with a structured output against the server (its own request, its own
    schema): the final output is the chat route's answer under the same schema, parsed into the agent's type."""
    from agents import Agent, AgentOutputSchema, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai.types.shared import Reasoning
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)

    set_tracing_disabled(True)  # nothing leaves the machine
    model = OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    )
    settings = ModelSettings(temperature=0, max_tokens=60, reasoning=Reasoning(effort="none"))
    agent = Agent(name="weather", instructions="Forecast.", model=model, model_settings=settings, output_type=Forecast)
    out = Runner.run_sync(agent, "Weather in Paris?").final_output
    schema = AgentOutputSchema(Forecast).json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "final_output", "schema": schema, "strict": True}}
    turns = [{"role": "system", "content": "Forecast."}, {"role": "user", "content": "Weather in Paris?"}]
    ref = chat_answer(client, turns, 60, response_format=fmt)
    assert isinstance(out, Forecast) and out == Forecast.model_validate_json(ref.choices[0].message.content)
