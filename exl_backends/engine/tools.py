"""Tool calling and reasoning output: the one core behind every front door (server, LangChain, LlamaIndex).

A request's tools (OpenAI function specs) and tool choice become
  1. a prompt: the messages and tools rendered with the model's own chat template (`tools=`), or, for a template
     with no tool support, with the generic fallback below;
  2. a grammar (Lark for llguidance, constraints.py) that allows plain text or the family's call syntax, each call
     naming a given tool with arguments that match its JSON schema; `required` or a named tool forces a call;
  3. a parser that splits the output, streamed or whole, into reasoning, content and calls.
Because the grammar builds every call, every call parses and validates; the constraint closes an open call before
max_tokens runs out where it can, and a call left incomplete is dropped (the job says finish_reason "length").
A reply ends at a call that repeats one it made (ToolRequest.stop_check): small models loop on their calls.

Families differ by data (CALL_FORMATS), found by the markers their templates contain; a template with tools but
no known marker, and the generic fallback, use the Hermes/Qwen form:
  <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
The generic fallback (tool_prompt="auto" for a template without tools, or "generic"): the tools are described in a
system message (GENERIC_PREAMBLE), earlier calls are written into the assistant's text in that form, and tool
results go back as user messages in <tool_response> tags. tool_prompt="template" refuses such a template instead.

Reasoning: for a template that thinks in tags (REASONING_TAGS: Qwen3, R1 distills), the text between the tags is
split out as reasoning (never content), whether the prompt opens the block or the model does; `enable_thinking`
goes to templates that take it (Qwen3). With a grammar, the reasoning block comes first and calls after it."""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import jinja2

from ..errors import ExlError


class ToolError(ExlError, ValueError):
    """Bad tools, tool choice or tool messages (a server answers it with a 400)."""


@dataclass(frozen=True)
class CallFormat:
    """How a family writes tool calls: begin, then calls joined by separator, then end. Each call is
    {"name": "<tool>", "<args_key>": <arguments>} (JSON with ", " and ": " separators, as json.dumps writes)."""
    name: str
    markers: tuple[str, ...]    # text in a chat template that shows the family
    trigger: str                # the text (or special token) that starts the calls
    begin: str                  # starts with trigger
    separator: str
    end: str
    args_key: str
    after_text: bool            # calls may follow text; else a reply is either text or calls
    id_length: int | None = None    # the call ids the template demands (Mistral: 9 letters and digits)


HERMES = CallFormat("hermes", ("<tool_call>",), "<tool_call>", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n",
                    "\n</tool_call>", "arguments", after_text=True)
CALL_FORMATS = (
    CallFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", "[TOOL_CALLS][", ", ", "]", "arguments",
               after_text=False, id_length=9),
    HERMES,
    CallFormat("llama3", ("<|python_tag|>",), "{", "", "; ", "", "parameters", after_text=False),
)
REASONING_TAGS = (("<think>", "</think>"),)

GENERIC_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
TOOL_CHOICES = ("auto", "none", "required")
SCHEMA_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")        # OpenAI's rule for function names
# arguments as json.dumps writes them: what templates render and small models saw in training
ARGS_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# ---- tools and tool choice -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def spec(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str              # JSON text of an object, exactly as generated

    def spec(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(tools: list | None) -> list[Tool]:
    """OpenAI tool specs ({"type": "function", "function": {name, description, parameters}}, or the function
    object alone) -> Tools; each schema is checked by compiling it (ToolError names the tool and the fault)."""
    out: list[Tool] = []
    for i, spec in enumerate(tools or []):
        f = spec.get("function") if isinstance(spec, dict) and spec.get("type") == "function" else spec
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolError(f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": <JSON schema>}}}}, got {json.dumps(spec)[:200]}")
        name = f["name"]
        if not NAME.fullmatch(name):
            raise ToolError(f"tools[{i}]: function name {name!r} must be 1-64 letters, digits, '_' or '-'")
        if any(t.name == name for t in out):
            raise ToolError(f"tools[{i}]: two tools are named {name!r}; names must be unique")
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(f"tools[{i}] ({name}): parameters must be a JSON schema of type object, got "
                            f"{json.dumps(params)[:200]}")
        check_schema(params, f"tools[{i}] ({name}).parameters")
        out.append(Tool(name, f.get("description") or "", params))
    return out


def check_schema(schema: dict, where: str) -> None:
    """ToolError unless schema is a JSON schema (its keywords' shapes) that llguidance can enforce."""
    import llguidance
    fault = schema_fault(schema, where)
    if fault:
        raise ToolError(f"{fault}: the parameters are not a valid JSON schema")
    try:
        llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        raise ToolError(f"{where} is not a JSON schema we can enforce: {e}") from None


def schema_fault(schema, where: str) -> str | None:
    """The first keyword of the schema whose value has the wrong shape (the common keywords), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} is {json.dumps(schema)[:80]}, not a schema (an object or a boolean)"
    types = schema.get("type", [])
    for t in types if isinstance(types, list) else [types]:
        if t not in SCHEMA_TYPES:
            return f"{where}.type {t!r} is not one of {sorted(SCHEMA_TYPES)}"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{where}.required must be a list of property names"
    if not isinstance(schema.get("enum", []), list):
        return f"{where}.enum must be a list"
    subs = []
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        value = schema.get(key, {})
        if not isinstance(value, dict):
            return f"{where}.{key} must be an object of schemas"
        subs += [(f"{where}.{key}.{k}", v) for k, v in value.items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        value = schema.get(key, [])
        if not isinstance(value, list):
            return f"{where}.{key} must be a list of schemas"
        subs += [(f"{where}.{key}[{i}]", v) for i, v in enumerate(value)]
    for key in ("items", "additionalProperties", "not"):
        if key in schema:
            subs.append((f"{where}.{key}", schema[key]))
    return next((f for f in (schema_fault(v, w) for w, v in subs) if f), None)


def parse_tool_choice(choice, tools: list[Tool]) -> str | Tool:
    """"auto", "none", "required", or the Tool named by {"type": "function", "function": {"name": ...}} (or by
    {"name": ...}). None: "auto" with tools, else "none"."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ToolError(f"tool_choice {choice!r}: use one of {list(TOOL_CHOICES)} or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if choice == "required" and not tools:
            raise ToolError("tool_choice 'required' needs tools")
        return choice
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) and "function" in choice \
        else choice.get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ToolError(f"tool_choice {json.dumps(choice)[:200]}: name a function as "
                        f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    for t in tools:
        if t.name == name:
            return t
    raise ToolError(f"tool_choice names function {name!r}, which is not among the tools "
                    f"({[t.name for t in tools]})")


# ---- the chat template -----------------------------------------------------------------------------------------------

def template_source(tokenizer) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):          # named templates ("default", "tool_use")
        return "\n".join(map(str, template.values()))
    return str(template or "")


class ChatFormat:
    """What a tokenizer's chat template does with tools and reasoning; renders prompts, builds grammars and
    parsers. tool_prompt: "auto" (the template's own tool support, else the generic fallback), "template"
    (ToolError for a template without tool support) or "generic"."""

    def __init__(self, tokenizer, tool_prompt: str = "auto"):
        if tool_prompt not in ("auto", "template", "generic"):
            raise ToolError(f"tool_prompt {tool_prompt!r}: use 'auto', 'template' or 'generic'")
        self.tokenizer = tokenizer
        source = template_source(tokenizer)
        if not source:
            raise ToolError("this model has no chat template (chat_template in tokenizer_config.json, or "
                            "chat_template.jinja)")
        has_tools = re.search(r"\btools\b", source) is not None
        if tool_prompt == "template" and not has_tools:
            raise ToolError(f"the chat template of {tokenizer.name_or_path or 'this model'} has no tool support "
                            f"(it never reads `tools`); use tool_prompt='generic' (or 'auto') for the generic "
                            f"fallback, which describes the tools in a system message")
        self.native = has_tools and tool_prompt != "generic"
        self.calls = next((f for f in CALL_FORMATS if any(m in source for m in f.markers)), HERMES) \
            if self.native else HERMES
        self.reasoning = next((tags for tags in REASONING_TAGS if tags[0] in source), None)
        self.thinking_switch = "enable_thinking" in source

    # ---- prompts ----

    def render(self, messages: list[dict], tools: list[Tool], enable_thinking: bool | None = None) -> str:
        """The prompt (text, BOS included as the template writes it) for the assistant's next reply. messages
        are OpenAI-style dicts: assistant messages may carry tool_calls, tool messages tool_call_id."""
        check_tool_messages(messages)
        kwargs = {}
        if enable_thinking is not None and self.thinking_switch:
            kwargs["enable_thinking"] = enable_thinking
        if self.native:
            messages, specs = [native_message(m) for m in messages], [t.spec() for t in tools] or None
        else:
            messages, specs = generic_messages(messages, tools), None
        try:
            return self.tokenizer.apply_chat_template(messages, tools=specs, tokenize=False,
                                                      add_generation_prompt=True, **kwargs)
        except (jinja2.TemplateError, ValueError) as e:     # what a template refuses (roles out of order, ...)
            raise ToolError(f"the chat template of {self.tokenizer.name_or_path or 'this model'} refused these "
                            f"messages: {e}") from None

    def new_id(self) -> str:
        if self.calls.id_length:
            return uuid.uuid4().hex[:self.calls.id_length]
        return f"call_{uuid.uuid4().hex[:24]}"

    # ---- grammar ----

    def opens_reasoning(self, prompt: str) -> bool:
        """The prompt ends inside an open reasoning block (R1 distills' generation prompt opens it)."""
        if self.reasoning is None:
            return False
        open_tag, close_tag = self.reasoning
        return prompt.rfind(open_tag) > prompt.rfind(close_tag)

    def grammar(self, tools: list[Tool], choice: str | Tool, parallel: bool, prompt: str,
                enable_thinking: bool | None = None) -> str | None:
        """A Lark grammar for the reply (None: no constraint, a reply without tools)."""
        if not tools:
            return None
        fmt = self.calls
        rules = ["%llguidance {}"]
        head = self.reasoning_rule(prompt, enable_thinking, rules)
        chosen = [choice] if isinstance(choice, Tool) else tools
        many = parallel and not isinstance(choice, Tool)
        begin = self.begin_lark()
        if choice == "none":
            rules.append(f"start: {head}TEXT")
        elif choice == "auto" and fmt.after_text:       # the lazy `pre` ends at the first trigger
            rules.append(f"start: {head}TEXT | {head}pre {lark_str(fmt.begin[len(fmt.trigger):])} calls")
            rules.append(f"pre[lazy]: /(?s:.*){lark_re(fmt.trigger)}/")
        elif choice == "auto":
            rules.append(f"start: {head}TEXT | {head}{begin} calls")
        else:
            rules.append(f"start: {head}{begin} calls")
        more = f" ({lark_str(fmt.separator)} call)*" if many else ""
        rules.append(f"calls: call{more} {lark_str(fmt.end)}")
        rules.append(self.text_rule())
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
        for i, tool in enumerate(chosen):
            head_text = json.dumps(f'{{"name": "{tool.name}", "{fmt.args_key}": ')
            schema = {**closed_objects(tool.parameters), "x-guidance": ARGS_JSON}
            rules.append(f"call_{i}: {head_text} args_{i} \"}}\"")
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
        return "\n".join(rules) + "\n"

    def begin_lark(self) -> str:
        """The calls' begin as grammar items: a trigger that is a special token by its id, else all as text."""
        fmt = self.calls
        token = self.special_id(fmt.trigger)
        if token is None or not fmt.begin.startswith(fmt.trigger):
            return lark_str(fmt.begin)
        return f"<[{token}]> {lark_str(fmt.begin[len(fmt.trigger):])}"

    def special_id(self, text: str) -> int | None:
        for i, t in self.tokenizer.added_tokens_decoder.items():
            if t.content == text and t.special:
                return i
        return None

    def text_rule(self) -> str:
        """Plain text that cannot be taken for a call: it never contains the trigger (families whose calls follow
        text) or never starts like a call (families whose calls are the whole reply)."""
        fmt = self.calls
        if fmt.after_text:
            return f"TEXT: /(?s:.*)/ & ~/(?s:.*){lark_re(fmt.trigger)}(?s:.*)/"
        return f"TEXT: /([^{lark_re(self.call_lead())}](?s:.*))?/"

    def call_lead(self) -> str:
        """The first character the calls show in the text (special tokens do not show)."""
        begin = self.calls.begin
        if self.special_id(self.calls.trigger) is not None:
            begin = begin[len(self.calls.trigger):]
        return begin[:1] or "{"

    def reasoning_rule(self, prompt: str, enable_thinking: bool | None, rules: list[str]) -> str:
        """The grammar's reasoning part before the reply proper ("" when there is none): the rest of a block the
        prompt opened, or a whole block where the template thinks and thinking is on."""
        if self.reasoning is None:
            return ""
        open_tag, close_tag = self.reasoning
        if self.opens_reasoning(prompt):
            rules.append(f"think[lazy]: /(?s:.*){lark_re(close_tag)}/")
        elif enable_thinking is not False and not prompt.rstrip().endswith(close_tag):
            rules.append(f"think[lazy]: /{lark_re(open_tag)}(?s:.*){lark_re(close_tag)}/")
        else:
            return ""
        rules.append("WS: /[ \\n]*/")
        return "think WS "

    # ---- output ----

    def parser(self, prompt: str, parse_calls: bool = True) -> ReplyParser:
        return ReplyParser(self, self.opens_reasoning(prompt), parse_calls)

    def parse(self, prompt: str, text: str, parse_calls: bool = True) -> Reply:
        """A whole reply, split (an incomplete last call is dropped)."""
        p = self.parser(prompt, parse_calls)
        return Reply.of(p.feed(text) + p.close())


def lark_str(s: str) -> str:
    return json.dumps(s) if s else ""


def lark_re(s: str) -> str:
    """s as a literal inside a Lark /regex/ (whose delimiter needs escaping too)."""
    return re.escape(s).replace("/", "\\/")


def closed_objects(schema):
    """The schema with additionalProperties false on objects that do not say (arguments then name only declared
    fields, as OpenAI's strict mode has them; this also keeps a forced completion short: no free keys)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: closed_objects(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


# ---- messages --------------------------------------------------------------------------------------------------------

def check_tool_messages(messages: list[dict]) -> None:
    """Each tool message that names a call (tool_call_id) answers one an earlier assistant message made. One without
    an id is history the template renders as it is (templates without call ids; clients that send none)."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            made.add(call.get("id"))
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and call_id not in made:
                raise ToolError(f"messages[{i}]: a tool message answers tool_call_id {call_id!r}, but no earlier "
                                f"assistant message made a call with that id")


def call_arguments(call: dict) -> dict:
    """An OpenAI tool call's arguments (a JSON string) as the dict chat templates expect."""
    args = call["function"].get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ToolError(f"tool call {call.get('id')!r}: arguments are not JSON ({e})") from None
    return args


def native_message(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{"id": c.get("id"), "type": "function",
              "function": {"name": c["function"]["name"], "arguments": call_arguments(c)}} for c in m["tool_calls"]]
    return {**m, "content": m.get("content") or "", "tool_calls": calls}


def generic_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """Messages for a template without tool support: tools in a system message, calls in the assistant's text,
    results in user messages (consecutive results in one)."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': call_arguments(c)})}"
                              f"\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("is_tool_result"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "is_tool_result": True})
        else:
            out.append({"role": role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        preamble = GENERIC_PREAMBLE.format(tools="\n".join(json.dumps(t.spec()) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


# ---- output ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Delta:
    """A piece of a reply: kind "reasoning" or "content" (text), "call" (a call begins: index, id, name),
    "arguments" (text: the next piece of call index's arguments) or "incomplete" (call index never completed:
    the budget ran out inside it; a whole reply leaves it out)."""
    kind: str
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, deltas: list[Delta]) -> Reply:
        r, heads, args = cls(), {}, {}
        for d in deltas:
            if d.kind == "content":
                r.content += d.text
            elif d.kind == "reasoning":
                r.reasoning += d.text
            elif d.kind == "call":
                heads[d.index], args[d.index] = d, ""
            elif d.kind == "arguments":
                args[d.index] += d.text
            elif d.kind == "incomplete":
                del heads[d.index]
        r.calls = [ToolCall(heads[i].id, heads[i].name, args[i]) for i in sorted(heads)]
        return r

    def distinct(self) -> Reply:
        """The reply without calls that repeat an earlier one (same name and arguments): ToolRequest.stop_check ends
        a reply at such a repeat, which a stream has sent already but a whole reply need not hand to an agent that
        would run the tool twice."""
        seen, calls = set(), []
        for c in self.calls:
            if (c.name, c.arguments) not in seen:
                seen.add((c.name, c.arguments))
                calls.append(c)
        return Reply(self.content, self.reasoning, calls)


def finish_reason(deltas: list[Delta], engine_reason: str) -> str:
    """A reply's finish_reason: "length" when the budget cut a call (a whole reply leaves it out), "tool_calls"
    when calls came, else the engine's own."""
    if any(d.kind == "incomplete" for d in deltas):
        return "length"
    return "tool_calls" if any(d.kind == "call" for d in deltas) else engine_reason


class ReplyParser:
    """Splits a reply streamed as text pieces into Deltas: reasoning, content, calls. Text that may still turn
    into a tag or a call is held back until it is known. The calls' syntax is the one the grammar enforces; a
    call whose arguments never complete is left out of `close()` (its streamed pieces are already out)."""

    def __init__(self, chat: ChatFormat, in_reasoning: bool, parse_calls: bool):
        self.chat, self.fmt = chat, chat.calls
        self.state = "reasoning" if in_reasoning else "start"
        self.parse_calls = parse_calls
        self.buf = ""                   # text not yet given out (reasoning/content states)
        self.calls = ""                 # the calls' text, from their begin (calls state)
        self.pos = 0                    # how far self.calls is parsed
        self.n_calls = 0
        self.args_from: int | None = None   # where the open call's arguments start in self.calls
        self.head = re.compile(r'\{"name": "([^"]*)", "' + re.escape(self.fmt.args_key) + '": ')
        self.visible_begin = self.fmt.begin if chat.special_id(self.fmt.trigger) is None \
            else self.fmt.begin[len(self.fmt.trigger):]

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if self.state in ("calls", "between", "done"):
            self.calls += text
        else:
            self.buf += text
        while self._step(out, final=False):
            pass
        return out

    def close(self) -> list[Delta]:
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self.state in ("reasoning", "content", "start") and self.buf:
            out.append(Delta("reasoning" if self.state == "reasoning" else "content", self.buf))
            self.buf = ""
        if self.args_from is not None:
            # the last call never completed: take it back from the whole reply
            out.append(Delta("incomplete", index=self.n_calls))
        return out

    def _step(self, out: list[Delta], final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        return getattr(self, f"_{self.state}")(out, final)

    def _start(self, out: list[Delta], final: bool) -> bool:
        text = self.buf.lstrip()
        if self.chat.reasoning is not None:
            open_tag = self.chat.reasoning[0]
            if text.startswith(open_tag):
                self.buf, self.state = text[len(open_tag):], "reasoning"
                return True
            if open_tag.startswith(text) and not final:
                return False
        self.state = "content"
        return True

    def _reasoning(self, out: list[Delta], final: bool) -> bool:
        close_tag = self.chat.reasoning[1]
        at = self.buf.find(close_tag)
        if at < 0:
            keep = 0 if final else held_prefix(self.buf, close_tag)
            if len(self.buf) > keep:
                out.append(Delta("reasoning", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if at:
            out.append(Delta("reasoning", self.buf[:at]))
        self.buf, self.state = self.buf[at + len(close_tag):], "after_reasoning"
        return True

    def _after_reasoning(self, out: list[Delta], final: bool) -> bool:
        text = self.buf.lstrip()
        if not text and not final:
            self.buf = ""
            return False
        self.buf, self.state = text, "content"
        return True

    def _content(self, out: list[Delta], final: bool) -> bool:
        if not self.parse_calls:
            if self.buf:
                out.append(Delta("content", self.buf))
                self.buf = ""
            return False
        begin = self.visible_begin
        if self.fmt.after_text:
            at = self.buf.find(begin)
            keep = held_prefix(self.buf, begin) if at < 0 and not final else 0
        else:       # calls are the whole reply: they start it or never come
            stripped = self.buf.lstrip()
            lead = begin or self.chat.call_lead()
            if stripped.startswith(lead):
                at, keep = len(self.buf) - len(stripped), 0
            elif not final and lead.startswith(stripped):
                return False
            else:
                at, keep = -1, 0
                self.parse_calls = False
        end = at if at >= 0 else len(self.buf) - keep
        if end:
            out.append(Delta("content", self.buf[:end]))
        if at < 0:
            self.buf = self.buf[end:]
            return False
        self.calls, self.buf, self.state, self.pos = self.buf[at + len(begin):], "", "calls", 0
        return True

    def _calls(self, out: list[Delta], final: bool) -> bool:
        if self.args_from is None:
            m = self.head.match(self.calls, self.pos)
            if m is None:
                return False
            out.append(Delta("call", index=self.n_calls, id=self.chat.new_id(), name=m.group(1)))
            self.args_from = self.pos = m.end()
        try:
            _, end = json.JSONDecoder().raw_decode(self.calls, self.args_from)
        except json.JSONDecodeError:
            end = None
        if end is None:     # all that came is arguments so far
            if len(self.calls) > self.pos:
                out.append(Delta("arguments", self.calls[self.pos:], index=self.n_calls))
                self.pos = len(self.calls)
            return False
        if end > self.pos:
            out.append(Delta("arguments", self.calls[self.pos:end], index=self.n_calls))
        self.pos, self.args_from = end, None
        self.n_calls += 1
        self.state = "between"
        return True

    def _between(self, out: list[Delta], final: bool) -> bool:
        """After a call's arguments: its closing brace, then the separator (another call) or the end."""
        rest = self.calls[self.pos:]
        nxt, last = "}" + self.fmt.separator, "}" + self.fmt.end
        if rest.startswith(nxt):
            self.pos += len(nxt)
            self.state = "calls"
            return True
        if not final and nxt.startswith(rest):
            return False
        if rest.startswith(last):
            self.pos += len(last)
            self.state = "done"
            return True
        return False

    def _done(self, out: list[Delta], final: bool) -> bool:
        return False


def held_prefix(text: str, tag: str) -> int:
    """The length of text's longest suffix that is a proper prefix of tag (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- one request -----------------------------------------------------------------------------------------------------

@dataclass
class ToolRequest:
    """A chat request with its tools, ready for Generator.submit(ids, grammar=..., stop_check=...) and for parsing
    the reply."""
    chat: ChatFormat
    tools: list[Tool]
    choice: str | Tool
    prompt: str
    grammar: str | None
    parallel: bool = True

    def ids(self) -> list[int]:
        return self.chat.tokenizer.encode(self.prompt, add_special_tokens=False)

    def parser(self) -> ReplyParser:
        return self.chat.parser(self.prompt, parse_calls=self.choice != "none")

    def parse(self, text: str) -> Reply:
        p = self.parser()
        return Reply.of(p.feed(text) + p.close())

    def stop_check(self) -> Callable[[str], bool] | None:
        """For Generator.submit(stop_check=...): ends the reply at a call that repeats one it already made (None
        where the grammar allows one call at most). A small model copies its own calls: SmolLM2-135M, forced to
        call, wrote the same call over and over until max_tokens (the whole context when no max_tokens is given),
        which the grammar allows as parallel calls. A stream has sent the repeat; whole replies drop it (Reply.distinct)."""
        if self.grammar is None or self.choice == "none" or isinstance(self.choice, Tool) or not self.parallel:
            return None
        return self.repeats_a_call

    def repeats_a_call(self, text: str) -> bool:
        """The reply so far holds two complete calls with the same name and arguments."""
        if text.count('{"name": ') < 2:        # every family writes a call so; cheap on text without calls
            return False
        p = self.parser()
        deltas = p.feed(text)
        done = [(c.name, c.arguments) for c in Reply.of(deltas).calls[:p.n_calls]]
        return len(set(done)) < len(done)


def prepare(tokenizer, messages: list[dict], tools: list | None = None, tool_choice=None,
            parallel_tool_calls: bool = True, enable_thinking: bool | None = None,
            tool_prompt: str = "auto") -> ToolRequest:
    """messages (OpenAI-style dicts) and OpenAI tools -> the prompt and grammar of the reply (ToolError on bad
    tools, tool choice or tool messages)."""
    parsed = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, parsed)
    chat = ChatFormat(tokenizer, tool_prompt)
    prompt = chat.render(messages, parsed, enable_thinking)
    return ToolRequest(chat, parsed, choice, prompt,
                       chat.grammar(parsed, choice, parallel_tool_calls, prompt, enable_thinking), parallel_tool_calls)
