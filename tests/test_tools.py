"""Tool calling and reasoning output (exl_backends/engine/tools.py) on a tiny random chat model: forced calls always parse
and validate, the choices (auto, none, required, named) hold, streamed pieces reassemble to the whole reply, tool
results go back through the template, reasoning never leaks into content, bad input is refused by name, and
constrained output closes itself before max_new_tokens."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from exl_backends import ExlForCausalLM, Generator, SamplingParams
from exl_backends.engine.generator import template_stop_ids
from exl_backends.engine.tools import ChatFormat, Reply, ToolError, parse_tools, prepare

from conftest import needs_fixtures
from serving import THINKING_TEMPLATE, save_chat_model

pytestmark = needs_fixtures()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("tools_tiny"))


@pytest.fixture(scope="module")
def gen(model_dir):
    return Generator(ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=2048), page_size=16,
                     cache_tokens=96 * 1024)


@pytest.fixture(scope="module")
def thinking_gen(model_dir, tmp_path_factory):
    model = ExlForCausalLM.from_pretrained(model_dir, device="cpu", max_seq_len=1024)
    model.tokenizer.chat_template = THINKING_TEMPLATE
    return Generator(model, page_size=16, cache_tokens=8 * 1024)


def run(gen, req, max_new_tokens=96, seed=0, sampling=None):
    stops = gen.eos_ids | template_stop_ids(gen.tokenizer)
    return gen.generate(req.ids(), max_new_tokens=max_new_tokens, grammar=req.grammar, stop_token_ids=stops,
                        sampling=sampling or SamplingParams(temperature=1.0, seed=seed))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 fields: strings (free, enum, bounded), integers (ranged), numbers, booleans,
    arrays (bounded or not) and, two levels deep, nested objects; a random subset required."""
    kinds = ["string", "enum", "integer", "number", "boolean", "array"] + (["object"] if depth < 2 else [])
    props = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            props[f"s{i}"] = {"type": "string", **({"maxLength": rng.randint(1, 12)} if rng.random() < 0.5 else {})}
        elif kind == "enum":
            props[f"e{i}"] = {"type": "string", "enum": rng.sample(["red", "green", "blue", "x y"], 2)}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            props[f"i{i}"] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        elif kind == "number":
            props[f"n{i}"] = {"type": "number"}
        elif kind == "boolean":
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == "array":
            items = rng.choice([{"type": "integer"}, {"type": "string", "maxLength": 5}])
            bounds = {"minItems": 1, "maxItems": 3} if rng.random() < 0.5 else {}
            props[f"a{i}"] = {"type": "array", "items": items, **bounds}
        else:
            props[f"o{i}"] = random_schema(rng, depth + 1)
    required = [k for k in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required}


# ---- calls that parse and validate -------------------------------------------------------------------------------

def test_forced_calls_of_50_random_schemas_parse_and_validate(gen):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(50)]
    requests = []
    for i, schema in enumerate(schemas):
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}}, ADD]
        requests.append((schema, prepare(gen.tokenizer, ASK, tools, "required")))
    stops = gen.eos_ids | template_stop_ids(gen.tokenizer)
    # the grammar is what guarantees the calls: a short prompt (no tool descriptions) keeps 50 prefills cheap
    jobs = [gen.submit(ASK, max_new_tokens=256, grammar=req.grammar, stop_token_ids=stops,
                       sampling=SamplingParams(temperature=1.0, seed=i)) for i, (_, req) in enumerate(requests)]
    for i, ((schema, req), job) in enumerate(zip(requests, jobs)):
        done = job.result()
        reply = req.parse(done.text)
        # a parallel call begun too late is cut by the budget ("length") and left out; the others are whole
        assert done.finish_reason in ("stop", "length") and reply.calls and not reply.content, (i, done.text)
        for call in reply.calls:
            assert call.name in (f"tool_{i}", "add")
            jsonschema.validate(json.loads(call.arguments), schema if call.name != "add" else
                                ADD["function"]["parameters"])


def test_named_choice_calls_that_tool_once(gen):
    req = prepare(gen.tokenizer, ASK, [WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    for seed in range(3):
        reply = req.parse(run(gen, req, seed=seed).text)
        assert [c.name for c in reply.calls] == ["add"]
        jsonschema.validate(json.loads(reply.calls[0].arguments), ADD["function"]["parameters"])


def boosted(gen, text: str, bias: float) -> SamplingParams:
    """Seeded sampling pushed towards the tokens of text."""
    ids = gen.tokenizer.encode(text, add_special_tokens=False)
    return SamplingParams(temperature=1.0, seed=0, logit_bias={t: bias for t in ids})


def accepts(gen, grammar: str, text: str) -> bool:
    from exl_backends.engine.constraints import Constraint, GrammarTokenizer
    matcher = Constraint(GrammarTokenizer(gen.tokenizer), grammar=grammar)._matcher
    ids = matcher_ids = GrammarTokenizer(gen.tokenizer).ll.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(matcher_ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_none_never_calls(gen):
    req = prepare(gen.tokenizer, ASK, [WEATHER], "none")
    assert accepts(gen, req.grammar, "It is sunny.") and not accepts(gen, req.grammar, "Sure." + CALL)
    # pushed towards the trigger's pieces, the reply still holds no trigger and parses to content only
    done = run(gen, req, max_new_tokens=60, sampling=boosted(gen, "<tool_call>", 6.0))
    reply = req.parse(done.text)
    assert reply.calls == [] and "<tool_call>" not in done.text and reply.content == done.text


def test_auto_without_a_call_returns_text(gen):
    req = prepare(gen.tokenizer, ASK, [WEATHER], "auto")
    done = run(gen, req, max_new_tokens=24)
    reply = req.parse(done.text)
    assert reply.calls == [] and reply.content == done.text and done.text


def test_auto_allows_text_then_a_valid_call_only(gen):
    req = prepare(gen.tokenizer, ASK, [WEATHER], "auto")
    assert accepts(gen, req.grammar, "Let me look." + CALL) and accepts(gen, req.grammar, CALL)
    assert not accepts(gen, req.grammar, CALL.replace('"city"', '"town"'))      # arguments off the schema
    assert not accepts(gen, req.grammar, CALL.replace("get_weather", "get_time"))
    reply = req.parse("Let me look." + CALL)
    assert reply.content == "Let me look." and [c.arguments for c in reply.calls] == ['{"city": "Oslo"}']


def test_parallel_calls_only_when_allowed(gen):
    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    for parallel in (True, False):
        req = prepare(gen.tokenizer, ASK, [WEATHER, ADD], "required", parallel_tool_calls=parallel)
        assert accepts(gen, req.grammar, two) == parallel
    reply = req.parse(two)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("add", {"a": 1, "b": 2}),
                                                                          ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in reply.calls}) == 2


def test_streamed_pieces_reassemble_to_the_whole_reply(gen):
    req = prepare(gen.tokenizer, ASK, [WEATHER, ADD], "required")
    stops = gen.eos_ids | template_stop_ids(gen.tokenizer)
    chunks = list(gen.stream(req.ids(), max_new_tokens=96, grammar=req.grammar, stop_token_ids=stops,
                             sampling=SamplingParams(temperature=1.0, seed=3)))
    parser = req.parser()
    deltas = [d for c in chunks for d in parser.feed(c.text)] + parser.close()
    whole = req.parse("".join(c.text for c in chunks))
    streamed = Reply.of(deltas)
    assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]
    assert whole.calls and streamed.content == whole.content
    assert sum(d.kind == "arguments" for d in deltas) > 1      # the arguments came in pieces


def test_every_split_of_a_reply_parses_the_same(gen):
    chat = ChatFormat(gen.tokenizer)
    text = ('Let me see.<tool_call>\n{"name": "add", "arguments": {"a": {"x": "}"}, "b": [1, 2]}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "O\\"slo"}}\n</tool_call>')
    whole = chat.parse("", text)
    assert [c.arguments for c in whole.calls] == ['{"a": {"x": "}"}, "b": [1, 2]}', '{"city": "O\\"slo"}']
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            p = chat.parser("")
            r = Reply.of(p.feed(text[:i]) + p.feed(text[i:j]) + p.feed(text[j:]) + p.close())
            assert (r.content, [(c.name, c.arguments) for c in r.calls]) == \
                   (whole.content, [(c.name, c.arguments) for c in whole.calls])


# ---- the template ------------------------------------------------------------------------------------------------

def history(result: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": result}]


def test_tool_result_round_trips_through_the_generic_fallback(gen):
    req = prepare(gen.tokenizer, history("18 C and sunny"), [WEATHER])
    assert not req.chat.native
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in req.prompt
            and "<tool_response>\n18 C and sunny\n</tool_response>" in req.prompt and '"name": "get_weather"' in
            req.prompt.split("What is the weather")[0])
    assert run(gen, req, max_new_tokens=8).finish_reason in ("stop", "length")


def test_tool_result_round_trips_through_a_template_with_tools(thinking_gen):
    req = prepare(thinking_gen.tokenizer, history("18 C and sunny"), [WEATHER])
    assert req.chat.native and req.chat.calls.name == "hermes"
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in req.prompt
            and "<tool_response>\n18 C and sunny\n</tool_response>" in req.prompt)
    # ... and parsing a reply in the template's form gives the call back
    again = req.parse('</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in again.calls] == [("get_weather", {"city": "Paris"})]


def test_template_without_tools_is_refused_by_name_when_asked_for(gen):
    with pytest.raises(ToolError, match="has no tool support.*generic"):
        prepare(gen.tokenizer, ASK, [WEATHER], tool_prompt="template")


# ---- reasoning ---------------------------------------------------------------------------------------------------

def test_reasoning_is_split_out_of_every_split_of_a_reply():
    class Tok:
        chat_template = "{{ '<think>' }}"
        added_tokens_decoder = {}
    chat = ChatFormat(Tok())
    text = "<think>\nThe user wants </thin k> a sum.\n</think>\n\nThe answer is 3."
    for i in range(len(text) + 1):
        p = chat.parser("<|im_start|>assistant\n", parse_calls=False)
        deltas = p.feed(text[:i]) + p.feed(text[i:]) + p.close()
        r = Reply.of(deltas)
        assert (r.reasoning, r.content) == ("\nThe user wants </thin k> a sum.\n", "The answer is 3."), i
        assert all("<think>" not in d.text and "</think>" not in d.text for d in deltas)


def test_reasoning_then_a_forced_call(thinking_gen):
    """The prompt opens <think>: the reply reasons, closes the block, then calls; streamed and whole agree, and no
    tag reaches the content."""
    req = prepare(thinking_gen.tokenizer, ASK, [WEATHER], "required")
    assert req.prompt.endswith("<think>\n")
    stops = thinking_gen.eos_ids | template_stop_ids(thinking_gen.tokenizer)
    chunks = list(thinking_gen.stream(req.ids(), max_new_tokens=120, grammar=req.grammar, stop_token_ids=stops,
                                      sampling=SamplingParams(temperature=1.0, seed=0)))
    text = "".join(c.text for c in chunks)
    whole = req.parse(text)
    parser = req.parser()
    streamed = Reply.of([d for c in chunks for d in parser.feed(c.text)] + parser.close())
    assert whole.reasoning and "</think>" in text and whole.calls, text
    assert "think>" not in whole.content and "think>" not in streamed.content
    assert (streamed.reasoning, streamed.content, [c.arguments for c in streamed.calls]) == \
           (whole.reasoning, whole.content, [c.arguments for c in whole.calls])
    jsonschema.validate(json.loads(whole.calls[0].arguments), WEATHER["function"]["parameters"])


# ---- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tools, choice, messages, match", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strin"}}}}}], "auto", ASK, r"tools\[0\] \(f\).parameters.properties.x.type 'strin'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto", ASK,
     "must be a JSON schema of type object"),
    ([WEATHER, WEATHER], "auto", ASK, "two tools are named 'get_weather'"),
    ([{"type": "function", "function": {"name": "no spaces"}}], "auto", ASK, "1-64 letters"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, ASK, "'nope', which is not among the tools"),
    ([WEATHER], "sometimes", ASK, "tool_choice 'sometimes'"),
    ([WEATHER], "auto", ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}],
     "tool_call_id 'call_9', but no earlier assistant message made a call with that id"),
])
def test_bad_input_is_refused_by_name(gen, tools, choice, messages, match):
    with pytest.raises(ToolError, match=match):
        prepare(gen.tokenizer, messages, tools, choice)


# ---- output that closes itself -----------------------------------------------------------------------------------

def test_json_schema_output_closes_before_max_new_tokens(gen):
    """A random model never closes a free string by itself: the constraint closes it, and every open level,
    before the budget ends, so the output parses and validates."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}, "n": {"type": "integer"}}, "required": ["name", "tags", "n"]}
    for budget in (30, 45):
        done = gen.generate("Hello", max_new_tokens=budget, json_schema=schema,
                            sampling=SamplingParams(temperature=1.0, seed=1))
        assert done.finish_reason == "stop" and len(done.token_ids) <= budget
        jsonschema.validate(json.loads(done.text), schema)


def closing_after(tokenizer, grammar: str, text: str) -> str:
    """The text the budget's forced completion adds after text."""
    from exl_backends.engine.constraints import Constraint, GrammarTokenizer, shortest_closing
    grammar_tokenizer = GrammarTokenizer(tokenizer)
    matcher = Constraint(grammar_tokenizer, grammar=grammar)._matcher
    assert matcher.consume_tokens(grammar_tokenizer.ll.tokenize_str(text))
    closing = shortest_closing(matcher, grammar_tokenizer.char_tokens(), grammar_tokenizer.hint_tokens())
    return grammar_tokenizer.ll.decode_str(closing)


def test_the_budget_closes_an_open_string_as_it_is_and_a_reasoning_block_by_its_tag(gen, thinking_gen):
    """The reasoning block's closing tag is tried only where characters reach no completion (it fits in any
    string: tried first, it ended every argument the budget closed with "</think>")."""
    req = prepare(gen.tokenizer, ASK, [WEATHER], "required")
    assert closing_after(gen.tokenizer, req.grammar, CALL[:-20]) == '"}}\n</tool_call>'
    thinking = prepare(thinking_gen.tokenizer, ASK, [WEATHER], "required")
    assert closing_after(thinking_gen.tokenizer, thinking.grammar, "The user asks").startswith("</think>")


SAY = {"type": "function", "function": {"name": "say", "description": "Say yes", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "enum": ["yes"]}}, "required": ["word"]}}}


def test_a_call_that_repeats_one_ends_the_reply(gen):
    """SmolLM2-135M, forced to call with parallel calls allowed, copied its call until max_tokens (the whole context
    without one). Here every call is the same (one enum value; 57 tokens of the tiny tokenizer) and min_new_tokens
    keeps the reply from ending: without the stop check it loops, with it the reply ends at the first repeat."""
    req = prepare(gen.tokenizer, ASK, [SAY], "required")
    args = dict(max_new_tokens=240, min_new_tokens=200, grammar=req.grammar, sampling=SamplingParams(temperature=0),
                stop_token_ids=gen.eos_ids | template_stop_ids(gen.tokenizer))
    looped = gen.generate(req.ids(), **args)
    assert len(looped.token_ids) >= 200 and len(req.parse(looped.text).calls) > 2
    stopped = gen.generate(req.ids(), stop_check=req.stop_check(), **args)
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 120
    assert [(c.name, c.arguments) for c in req.parse(stopped.text).calls] == [("say", '{"word": "yes"}')] * 2
    assert [(c.name, c.arguments) for c in req.parse(stopped.text).distinct().calls] == [("say", '{"word": "yes"}')]
    # a call with other arguments, or one not yet complete, is no repeat; one call at most needs no check
    weather = prepare(gen.tokenizer, ASK, [WEATHER], "auto")
    assert weather.repeats_a_call(CALL + "\n" + CALL)
    assert not weather.repeats_a_call(CALL + "\n" + CALL.replace("Oslo", "Paris"))
    assert not weather.repeats_a_call(CALL + "\n" + CALL[:-20])
    for choice, parallel in (("required", False), ({"type": "function", "function": {"name": "say"}}, True),
                             ("none", True)):
        assert prepare(gen.tokenizer, ASK, [SAY], choice, parallel).stop_check() is None


def test_a_call_that_cannot_fit_is_left_out(gen):
    req = prepare(gen.tokenizer, ASK, [WEATHER], "required")
    done = run(gen, req, max_new_tokens=6)
    assert done.finish_reason == "length" and req.parse(done.text).calls == []


def test_parse_tools_accepts_bare_functions():
    tools = parse_tools([{"name": "f", "description": "d"}, ADD])
    assert [t.name for t in tools] == ["f", "add"] and tools[0].parameters == {"type": "object", "properties": {}}


def test_a_tool_message_without_an_id_is_rendered_as_it_is(gen):
    req = prepare(gen.tokenizer, ASK + [{"role": "tool", "content": "18 C"}], [WEATHER])
    assert "<tool_response>\n18 C\n</tool_response>" in req.prompt
