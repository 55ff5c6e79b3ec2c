"""Structured output on the chat route: ``response_format`` and ``tools`` as a grammar, the
tools' description in the prompt, and the tool calls read back from the constrained text.

The grammar (xgrammar EBNF) rides in SamplingParams.grammar to both services, which mask every
position with it (specdec.serving.grammar); this module only builds it and reads the output.

- ``response_format``: ``text`` (none); ``json_object`` (any JSON object); ``json_schema``
  (``strict`` true: no properties beyond the schema's unless it allows them).
- ``tools`` with ``tool_choice``: ``none`` (no tools: plain text); ``auto`` (free text, or a
  call written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the grammar
  taking over at the opening tag); ``required`` (one call to one of the tools, as that JSON
  object alone); a named function (one call to it). At most one call per response.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from orchestrator.http.errors import invalid

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")

# JSON Schema keywords xgrammar compiles without enforcing them: the output could then fail
# to validate, so a schema using one gets a 400 (measured on xgrammar 0.2.9: the grammar of a
# schema with each of these is the grammar without it).
IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                    "propertyNames", "contains", "minContains", "maxContains")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("additionalProperties", "items", "unevaluatedProperties")


@dataclasses.dataclass
class Structure:
    """What a chat body asks of the output's form."""

    grammar: str = ""  # xgrammar EBNF for SamplingParams.grammar; "" = free text
    tool_mode: str = "none"  # none | auto | required | named
    tools: list[dict] = dataclasses.field(default_factory=list)  # the functions offered
    # what the system turn tells the model of the form (the grammar alone does not say when
    # a string should end: a small model told nothing wrote strings to max_tokens)
    instruction: str = ""

    @property
    def calls_tools(self) -> bool:
        return self.tool_mode != "none"


def unsupported_keyword(schema, path: str) -> str | None:
    """``path.keyword`` of the first keyword in the schema that the grammar would not enforce,
    or None."""
    stack = [(path, schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in IGNORED_KEYWORDS:
            if key in node:
                return f"{where}.{key}"
        if node.get("uniqueItems"):
            return f"{where}.uniqueItems"
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(f"{where}.{key}.{name}", sub) for name, sub in node[key].items()]
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(f"{where}.{key}[{i}]", sub) for i, sub in enumerate(node[key])]
        for key in _SUBSCHEMAS:
            sub = node.get(key)
            if isinstance(sub, list):
                stack += [(f"{where}.{key}[{i}]", s) for i, s in enumerate(sub)]
            elif isinstance(sub, dict):
                stack.append((f"{where}.{key}", sub))
    return None


def schema_grammar(schema, param: str, strict: bool) -> str:
    """The EBNF of a JSON schema (compact JSON: one space after ':' and ','); 400 naming what
    is not supported."""
    import xgrammar as xgr

    if not isinstance(schema, dict):
        raise invalid(f"{param}: a JSON schema must be an object", param.split(".")[0])
    bad = unsupported_keyword(schema, param)
    if bad:
        raise invalid(f"{bad}: this JSON Schema keyword is not supported (it would not be "
                      "enforced on the output)", param.split(".")[0])
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                               strict_mode=strict)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise invalid(f"{param}: not supported: {_why(exc)}", param.split(".")[0]) from None
    return str(grammar)


def _why(exc: Exception) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    # xgrammar's messages start "[time] source.cc:line: "; the rest is the reason
    return text.rsplit(": ", 1)[-1] if text.startswith("[") else text


def _call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def _functions(tools: list) -> list[dict]:
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise invalid(f"{where}: only {{\"type\": \"function\", \"function\": {{...}}}} "
                          "tools are supported", "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or \
                not all(c.isalnum() or c in "_-" for c in name):
            raise invalid(f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        functions.append({"name": name, "description": fn.get("description", ""),
                          "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid("tools: function names must be unique", "tools")
    return functions


def structure_of(response_format: dict | None, tools: list | None, tool_choice) -> Structure:
    """The Structure of a chat body's response_format, tools and tool_choice (400 when one is
    malformed or not supported)."""
    fmt = response_format or {"type": "text"}
    kind = fmt.get("type")
    functions = _functions(tools or [])
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if not isinstance(name, str):
            raise invalid('tool_choice: expected {"type": "function", "function": {"name": '
                          '...}}', "tool_choice")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise invalid(f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        mode = "named"
    elif choice in TOOL_CHOICES:
        mode, chosen = choice, functions
        if mode != "none" and not functions:
            raise invalid(f"tool_choice {choice!r} needs tools", "tool_choice")
    else:
        raise invalid(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named "
                      f"function, got {choice!r}", "tool_choice")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(f"response_format.type must be text, json_object or json_schema, got "
                      f"{kind!r}", "response_format")
    if kind != "text" and mode != "none":
        raise invalid("response_format and tools (unless tool_choice is none) cannot be "
                      "combined: a tool call has its own form", "response_format")
    if kind == "json_object":
        return Structure(schema_grammar({"type": "object"}, "response_format", strict=False),
                         instruction="Reply with a short JSON object only.")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("response_format.json_schema must be an object with a schema",
                          "response_format")
        return Structure(schema_grammar(spec["schema"], "response_format.json_schema.schema",
                                        strict=bool(spec.get("strict", False))),
                         instruction="Reply with a short JSON object only, matching this JSON "
                                     f"schema: {json.dumps(spec['schema'])}")
    if mode == "none":
        return Structure()
    for f in chosen:  # 400 on a tool's schema before its call's
        schema_grammar(f["parameters"], f"tools.{f['name']}.parameters", strict=True)
    calls = [_call_schema(f) for f in chosen]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if mode == "auto":
        grammar = _tagged_grammar(call)
    else:
        grammar = schema_grammar(call, "tools", strict=True)
    structure = Structure(grammar, mode, functions)
    structure.instruction = tools_prompt(structure)
    return structure


def _tagged_grammar(call: dict) -> str:
    """Free text, then at ``<tool_call>`` one call, closed by ``</tool_call>``."""
    import xgrammar as xgr

    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [TOOL_CALL_OPEN],
        "tags": [{"begin": TOOL_CALL_OPEN, "content": {"type": "json_schema",
                                                       "json_schema": call},
                  "end": TOOL_CALL_CLOSE}]}}
    try:
        return str(xgr.Grammar.from_structural_tag(json.dumps(tag)))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise invalid(f"tools: not supported: {_why(exc)}", "tools") from None


def tools_prompt(structure: Structure) -> str:
    """The system text that offers the tools to the model (and says how to call them)."""
    listed = json.dumps([{"name": f["name"], "description": f["description"],
                          "parameters": f["parameters"]} for f in structure.tools])
    how = ('Call one by replying with only a JSON object {"name": <function name>, '
           '"arguments": <its arguments>}.') if structure.tool_mode != "auto" else (
        f'To call one, write {TOOL_CALL_OPEN}{{"name": <function name>, "arguments": <its '
        f'arguments>}}{TOOL_CALL_CLOSE}; otherwise answer in plain text.')
    return f"You can call these functions:\n{listed}\n{how}"


def tool_call_text(call: dict) -> str:
    """An assistant message's earlier tool call, written as the model writes one."""
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': fn.get('name'), 'arguments': args})}" \
           f"{TOOL_CALL_CLOSE}"


def _tool_call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": json.dumps(obj.get("arguments", {}))}}


def split_tool_calls(text: str, structure: Structure) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a constrained output. A call cut short (max_tokens) is no
    call: its text stays the content."""
    if structure.tool_mode in ("required", "named"):
        try:
            call = _tool_call(json.loads(text))
        except ValueError:
            call = None
        return (None, [call]) if call else (text, [])
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    end = text.find(TOOL_CALL_CLOSE, start)
    try:
        call = _tool_call(json.loads(text[start + len(TOOL_CALL_OPEN):end])) if end > 0 \
            else None
    except ValueError:
        call = None
    if call is None:
        return text, []
    content = text[:start].strip()
    return content or None, [call]


class ToolStream:
    """What of a tool-calling choice's text may stream as content: under ``auto`` the text
    before a tool call, held back while its end could still open one; nothing under
    ``required`` or a named function (the call comes whole at the end)."""

    def __init__(self, structure: Structure):
        self.structure = structure
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.structure.tool_mode != "auto":
            return ""
        start = self.text.find(TOOL_CALL_OPEN)
        safe = start if start >= 0 else len(self.text) - _open_prefix(self.text)
        out = self.text[self.sent:max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, tool calls) once the text is complete."""
        _, calls = split_tool_calls(self.text, self.structure)
        if not calls:
            return self.text[self.sent:], []
        if self.structure.tool_mode == "auto":  # the text before the call
            return self.text[self.sent:max(self.text.find(TOOL_CALL_OPEN), self.sent)], calls
        return "", calls


def _open_prefix(text: str) -> int:
    """Length of the longest end of text that begins ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
