"""Grammar × speculation on the bundled pair: 22 JSON schemas give valid JSON, and speculation (two-model and prompt
lookup) gives grammar-only plain decoding's tokens. Patterns are bounded ({1,8}): under greedy decoding the 5M bundled
target loops inside an unbounded `[a-z]+` until max_tokens, which says nothing about the grammar walk."""

import json, re
import jsonschema, pytest
from specnb import spec_generate, generate, TwoModelProvider, NgramProvider
from specnb.grammar import from_json_schema, from_regex, from_choices
from specnb.models import load_pair

pytestmark = pytest.mark.xdist_group("test_grammar")  # the tests share module-scoped servers: one worker, in order

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props, required=None, **kw):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **kw}


SCHEMAS = [
    obj({"name": S}),
    obj({"id": I, "ok": B}),
    obj({"x": N, "y": N}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 4}}),
    obj({"mode": {"enum": ["r", "w", "a"]}}),
    obj({"user": obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}})}),
    obj({"path": {"type": "string", "pattern": "^/[a-z]{1,8}(/[a-z]{1,8}){0,3}$"}}),
    obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}}),
    obj({"a": I, "b": S}, required=["a"]),
    obj({"items": {"type": "array", "items": obj({"k": S, "v": I}), "minItems": 1, "maxItems": 3}}),
    obj({"level": {"enum": ["debug", "info", "warning", "error"]}, "count": I}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 3}, "maxItems": 3}}),
    obj({"flag": B, "ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj(
        {
            "name": {"type": "string", "maxLength": 12},
            "aliases": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        }
    ),
    obj({"point": obj({"x": I, "y": I}), "label": S}),
    obj({"nullable": {"type": ["string", "null"]}}),
    obj({"kind": {"const": "module"}, "name": S}),
    obj({"ids": {"type": "array", "items": I, "uniqueItems": False, "maxItems": 5}}),
    obj(
        {
            "config": obj(
                {"debug": B, "workers": {"type": "integer", "minimum": 1, "maximum": 64}, "host": S}, required=["debug"]
            )
        }
    ),
    {"type": "array", "items": obj({"name": S, "value": N}), "maxItems": 3},
    obj({"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"}}),
    obj({"depth": obj({"one": obj({"two": obj({"three": I})})})}),
]
PROMPTS = ["config = ", "data = ", "    return "]


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_schema_outputs_validate_and_match_plain(pair, i):
    tok, schema = pair.tokenizer, SCHEMAS[i]
    prompt = tok.encode(PROMPTS[i % len(PROMPTS)])
    kw = dict(max_tokens=300, eos_token_ids=tok.eos_token_ids)
    plain = generate(pair.target, prompt, grammar=from_json_schema(tok, schema), **kw)
    for provider in (TwoModelProvider(pair.draft), NgramProvider()):
        r = spec_generate(
            pair.target, provider, prompt, num_draft_tokens=3, grammar=from_json_schema(tok, schema), **kw
        )
        assert r.finish_reason == "stop", (schema, tok.decode(r.tokens))
        jsonschema.validate(json.loads(tok.decode(r.tokens)), schema)
        assert r.tokens == plain.tokens, (schema, tok.decode(r.tokens), tok.decode(plain.tokens))


def test_choices_and_regex(pair):
    tok = pair.tokenizer
    for prompt in ("answer = ", "mode = ", "x = "):
        r = spec_generate(
            pair.target,
            TwoModelProvider(pair.draft),
            tok.encode(prompt),
            max_tokens=40,
            grammar=from_choices(tok, ["read", "write", "append"]),
        )
        assert tok.decode(r.tokens) in ("read", "write", "append") and r.finish_reason == "stop"
    pat = r"[a-z]+(_[a-z]+)*\.py"
    r = spec_generate(
        pair.target,
        TwoModelProvider(pair.draft),
        tok.encode("filename = '"),
        max_tokens=40,
        grammar=from_regex(tok, pat),
    )
    assert re.fullmatch(pat, tok.decode(r.tokens)), tok.decode(r.tokens)


def test_every_source_with_a_grammar(pair):
    from specnb import EarlyExitProvider, AdaptiveProvider, HeadProvider

    tok = pair.tokenizer
    for schema in SCHEMAS[:6]:
        prompt = tok.encode("config = ")
        kw = dict(max_tokens=300, eos_token_ids=tok.eos_token_ids)
        plain = generate(pair.target, prompt, grammar=from_json_schema(tok, schema), **kw)
        for provider in (
            EarlyExitProvider(3),
            AdaptiveProvider(TwoModelProvider(pair.draft)),
            TwoModelProvider(pair.draft, p_min=0.3),
            HeadProvider(),
        ):
            r = spec_generate(
                pair.target, provider, prompt, num_draft_tokens=4, grammar=from_json_schema(tok, schema), **kw
            )
            assert r.tokens == plain.tokens and r.finish_reason == "stop", (schema, type(provider).__name__)
            jsonschema.validate(json.loads(tok.decode(r.tokens)), schema)
