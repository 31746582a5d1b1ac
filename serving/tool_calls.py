"""M3's tool calls, parsed out of generated text into OpenAI `tool_calls`, whole or streaming.

The format. Every structural tag carries the `]<]minimax[>[` namespace marker (NS below; one special token,
id 200058, in M3's vocabulary). Parameters are elements named by the parameter itself, and nested values are
nested elements: objects as one element per key, arrays as `<item>` elements. Several invokes share one
`<tool_call>` block; M3's chat template writes assistant tool calls back exactly so (its `to_xml` macro; NS
is spelled out in the first line only, and each invoke is one line in the real text)::

    Let me check.]<]minimax[>[<tool_call>
    NS<invoke name="get_weather">NS<city>ParisNS</city>NS<days>3NS</days>NS</invoke>
    NS<invoke name="book">NS<guests>NS<item>NS<name>AdaNS</name>NS</item>NS</guests>NS</invoke>
    NS</tool_call>

-> content "Let me check.", tool_calls get_weather {"city": "Paris", "days": 3} and book {"guests": [{"name":
"Ada"}]} (with `days` declared an integer). Leaf values are raw text: no escaping, so a value may hold `<`, `&`
or newlines; the template writes numbers as text, booleans as `true`/`false`, and leaves out None values.
(m3-spec.md §6 says `<parameter name=...>`: that was M2's format, not M3's; M2-style parameter elements are still
accepted below.)

Tolerated deviations, all seen from real M3 deployments: inner tags without their NS (`</city>`, `<invoke ...>`,
a bare `<tool_call>` wrapper), `]<]minimax[>[invoke` without its `<`, an elided opening tag
(`NS value NS</city>`), a missing `</invoke>` or `</tool_call>`, and text after the block (more content; another
block gives more calls). An unprefixed closing tag inside a value only closes it when structure follows it: an
NS tag other than the value's own prefixed close, `</invoke>`, `</tool_call>`, the end of generation, or (for a
top-level parameter) the unprefixed opening tag of one of the function's parameters. So a value may contain its
own closing tag as text (`<html>...</html>` in a parameter named `html`). Unprefixed *opening* tags are
parameters only at the top level of an invoke; inside a value they are text.

Value typing, from the tool's JSON schema (`type`, type lists, `anyOf`/`oneOf`/`allOf`, `enum`, `properties`,
`items`, `prefixItems`, `additionalProperties`; `$ref` is not followed):

- string: the text verbatim (not stripped); integer/number/boolean/null: the stripped text read as such
  (`5.0` is a valid integer, `1e3` a number); object/array: nested elements, or JSON text, or empty text for
  {} / []. With a type union the first non-string type that reads the text wins, then string, then null.
- A value that fits none of its declared types stays its text, a JSON string, and a `bad_value` issue says so.
- Unknown parameters (not in the schema, or the function has no schema): a leaf stays a string unless its text
  is a JSON object or array; "5" stays "5" since the template renders the number 5 and the string "5" alike,
  and a string loses nothing. Nested elements become an object (a repeated key collects a list), or a list when
  every child is `<item>`. Mixed text beside child elements is kept under a `$text` key.

Malformed output never raises. It degrades to text content and each case is reported as a `ToolCallIssue`, so
the server can choose (return the calls anyway, fail the request, retry):

    unknown_function   an invoke naming a function not in `tools`: its raw text goes to content
    malformed_invoke   an invoke header without a name: its raw text goes to content
    unclosed_call      generation ended inside an invoke: the call keeps the parameters completed so far (its
                       arguments are closed into valid JSON); the unfinished rest goes to content
    bad_value          a value that does not fit its declared type: kept as its text
    empty_block        a <tool_call> block without any invoke: its raw text goes to content
    unclosed_block     text (or the end) after complete invokes without </tool_call>: the calls stand
    stray_text         text inside an invoke that is not a parameter: it goes to content
    unclosed_parameter a parameter closed by an enclosing closing tag (`</invoke>`): its text so far is kept
    duplicate_parameter, unknown_parameter, missing_parameter: as named (the first of duplicates is kept)

Streaming: `ToolCallParser.push(delta)` returns the content and OpenAI-style tool-call deltas that delta settles:
for each call first `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`, then one
`{"index", "function": {"arguments": fragment}}` per completed parameter (`{"city": "Paris"`, `, "days": 3`) and a
closing `}` (or `{}`) when the invoke ends. Text that may still become a marker is held back. Every decision
depends only on text already seen, never on where a delta ends, and `parse_tool_calls` is the same parser fed in
one piece, so for any split of the text the joined content, the joined arguments and the issues are identical.

Forced calls: `forced_call_prefix(name)` is the exact text a response to `tool_choice={"type": "function",
"function": {"name": ...}}` starts with (`forced_call_prefix()` for `tool_choice="required"`): the prefix a
constrained decoder must force (after the thinking block when thinking is on). A server that writes the prefix
into the prompt instead should push it into the parser before the generated text, so the call is announced.

Like reasoning, the markers are text only with special tokens kept: decode with `skip_special_tokens=False`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

NS = "]<]minimax[>["
TOOL_CALL_START = NS + "<tool_call>"
TOOL_CALL_END = NS + "</tool_call>"
INVOKE_END = NS + "</invoke>"

_BARE_BLOCK_START = "<tool_call>"
_BARE_BLOCK_END = "</tool_call>"
_BARE_INVOKE_END = "</invoke>"
# An invoke header: NS<invoke name="...">, also without NS or without the `<` (both seen from M3).
_INVOKE_OPENERS = (NS + "<invoke", NS + "invoke", "<invoke")
_INVOKE_HEADER = re.compile(
    r"""(?:\]<\]minimax\[>\[)?<?invoke\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>/]+))\s*/?>""")
# Closers that end an invoke (the invoke itself, or the whole block when `</invoke>` is missing).
_INVOKE_CLOSERS = (INVOKE_END, _BARE_INVOKE_END)
_BLOCK_CLOSERS = (TOOL_CALL_END, _BARE_BLOCK_END)
# Tags an element inside an invoke may be closed by implicitly (its own closing tag missing).
_OUTER_TAGS = ("invoke", "tool_call")
# M2-style parameter element, tolerated: <parameter name="city">Paris</parameter>.
_M2_PARAMETER = re.compile(r"""parameter\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")

_PLAIN_NAME = re.compile(r"[A-Za-z_$][\w$.:-]*")
_MAX_TAG_CHARS = 256  # an opening tag longer than this without its `>` is not a tag
_MAX_DEPTH = 64  # deeper nesting (of values, or of user-supplied schemas) is not followed

UNKNOWN_FUNCTION = "unknown_function"
MALFORMED_INVOKE = "malformed_invoke"
UNCLOSED_CALL = "unclosed_call"
BAD_VALUE = "bad_value"
EMPTY_BLOCK = "empty_block"
UNCLOSED_BLOCK = "unclosed_block"
STRAY_TEXT = "stray_text"
UNCLOSED_PARAMETER = "unclosed_parameter"
DUPLICATE_PARAMETER = "duplicate_parameter"
UNKNOWN_PARAMETER = "unknown_parameter"
MISSING_PARAMETER = "missing_parameter"


@dataclasses.dataclass(frozen=True)
class ToolCallIssue:
    """Something in the output that did not follow the format; see the module docstring for each `kind`."""

    kind: str
    message: str
    call_index: int | None = None  # the tool call it concerns, when it became one
    function: str | None = None
    parameter: str | None = None  # dotted path for nested values: "shipping.zip", "items.0.qty"
    text: str = ""  # the raw text involved (what went to content, or the value kept as text)


class ToolCallDelta(NamedTuple):
    """What one `push` (or `finish`) settles: content text and OpenAI-style tool-call deltas."""

    content: str
    tool_calls: list[dict[str, Any]]


@dataclasses.dataclass
class ToolCallResult:
    """The whole output: content (exact, "" when none), OpenAI `tool_calls`, and what went wrong."""

    content: str
    tool_calls: list[dict[str, Any]]
    issues: list[ToolCallIssue]


# ------------------------------------------------------------------------------------------------------------
# Tool schemas


def _function_schemas(tools: Iterable[Any] | None) -> dict[str, Mapping[str, Any]] | None:
    """Function name -> its parameters schema, from OpenAI tools (or bare function dicts). None = no tools given:
    every function name is accepted and nothing is typed."""
    if not tools:
        return None
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = fn.get("name")
        if isinstance(name, str):
            params = fn.get("parameters")
            out[name] = params if isinstance(params, Mapping) else {}
    return out


_JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
# The order a value's text is tried in against a union of types: specific readings first, string before null
# (the template never renders None, so the text "null" is more likely the string).
_TRY_ORDER = ("boolean", "integer", "number", "object", "array", "string", "null")


def _branches(schema: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out: list[Mapping[str, Any]] = []
    for key in ("anyOf", "oneOf", "allOf"):
        value = schema.get(key)
        if isinstance(value, list):
            out.extend(b for b in value if isinstance(b, Mapping))
    return out


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def _schema_types(schema: Any, depth: int = 0) -> list[str]:
    """The JSON types a schema allows, in its own order; [] when it does not say (or is not a schema)."""
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared] if declared in _JSON_TYPES else []
    if isinstance(declared, list):
        return [t for t in declared if t in _JSON_TYPES]
    types: list[str] = []
    for branch in _branches(schema):
        types.extend(t for t in _schema_types(branch, depth + 1) if t not in types)
    if types:
        return types
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values:
        return list(dict.fromkeys(_json_type_of(v) for v in values))
    if "properties" in schema or isinstance(schema.get("additionalProperties"), Mapping):
        return ["object"]
    if "items" in schema or "prefixItems" in schema:
        return ["array"]
    return []


def _property_schema(schema: Any, key: str, depth: int = 0) -> Mapping[str, Any] | None:
    """The schema of property `key` of an object schema (its branches searched too), else additionalProperties."""
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return None
    props = schema.get("properties")
    if isinstance(props, Mapping) and isinstance(props.get(key), Mapping):
        return props[key]
    for branch in _branches(schema):
        found = _property_schema(branch, key, depth + 1)
        if found is not None:
            return found
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def _declares_property(schema: Any, key: str, depth: int = 0) -> bool:
    """Whether an object schema names `key` or admits extra keys (a schema that lists no properties admits all)."""
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return True
    props = schema.get("properties")
    if not isinstance(props, Mapping) or not props:
        return True
    return key in props or schema.get("additionalProperties") not in (None, False) or any(
        _declares_property(b, key, depth + 1) for b in _branches(schema))


def _item_schema(schema: Any, index: int, depth: int = 0) -> Mapping[str, Any] | None:
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return None
    prefix = schema.get("prefixItems")
    if isinstance(prefix, list) and index < len(prefix) and isinstance(prefix[index], Mapping):
        return prefix[index]
    items = schema.get("items")
    if isinstance(items, Mapping):
        return items
    if isinstance(items, list) and index < len(items) and isinstance(items[index], Mapping):
        return items[index]
    for branch in _branches(schema):
        found = _item_schema(branch, index, depth + 1)
        if found is not None:
            return found
    return None


# ------------------------------------------------------------------------------------------------------------
# Values: element trees and their conversion


class _Element:
    """One parsed element: its key, text pieces between children, children, and the raw text inside it."""

    __slots__ = ("key", "texts", "children", "inner", "implicit")

    def __init__(self, key: str, texts: list[str] | None = None) -> None:
        self.key = key
        self.texts: list[str] = texts if texts is not None else []
        self.children: list[_Element] = []
        self.inner = "".join(self.texts)
        self.implicit = False  # closed by an enclosing tag, its own closing tag missing


_INTEGER = re.compile(r"[-+]?[0-9]+")
_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_NO = object()  # "the text does not read as this type"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads accepts NaN/Infinity, which json.dumps cannot take back


def _load_json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _NO


def _read_as(text: str, json_type: str) -> Any:
    """`text` read as `json_type`, or _NO."""
    if json_type == "string":
        return text
    s = text.strip()
    if json_type in ("integer", "number"):
        if _INTEGER.fullmatch(s):
            try:
                return int(s)
            except ValueError:  # longer than Python's int/str conversion limit (4300 digits)
                return _NO
        if _NUMBER.fullmatch(s):
            f = float(s)
            if math.isfinite(f):
                if json_type == "number":
                    return f
                if f.is_integer():
                    return int(f)
        return _NO
    if json_type == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _NO)
    if json_type == "null":
        return None if s in ("null", "None") else _NO
    if json_type in ("object", "array"):
        if not s:
            return {} if json_type == "object" else []  # the template renders {} and [] as nothing
        value = _load_json(s)
        return value if isinstance(value, dict if json_type == "object" else list) else _NO
    return _NO


class _Converter:
    """Element tree + schema -> JSON value, collecting issues for one call."""

    def __init__(self, report: Callable[[str, str, str, str], None]) -> None:
        self._report = report  # (kind, message, parameter path, text)

    def value(self, el: _Element, schema: Mapping[str, Any] | None, path: str) -> Any:
        if el.implicit:
            self._report(UNCLOSED_PARAMETER, f"parameter {path!r} was not closed; its text so far is kept",
                          path, el.inner)
        types = _schema_types(schema)
        if el.children:
            return self._tree(el, schema, types, path)
        text = "".join(el.texts)
        if not types:
            stripped = text.strip()
            if stripped[:1] in ("{", "["):
                loaded = _load_json(stripped)
                if isinstance(loaded, dict | list):
                    return loaded
            return text
        for json_type in _TRY_ORDER:
            if json_type in types:
                value = _read_as(text, json_type)
                if value is not _NO:
                    return value
        self._report(BAD_VALUE, f"parameter {path!r}: {text!r} is not {' or '.join(types)}; kept as text",
                     path, text)
        return text

    def _tree(self, el: _Element, schema: Mapping[str, Any] | None, types: list[str], path: str) -> Any:
        if types and "object" not in types and "array" not in types:
            self._report(BAD_VALUE, f"parameter {path!r}: nested elements where {' or '.join(types)} was "
                         "expected; kept as text", path, el.inner)
            return el.inner
        all_items = all(child.key == "item" for child in el.children)
        stray = "".join(el.texts)
        if ("array" in types and ("object" not in types or all_items)) or (not types and all_items):
            if stray.strip():
                self._report(BAD_VALUE, f"parameter {path!r}: text between array items ignored", path, stray)
            return [self.value(child, _item_schema(schema, i), f"{path}.{i}")
                    for i, child in enumerate(el.children)]
        obj: dict[str, Any] = {}
        collected: set[str] = set()  # keys whose value is a list built from repeats (vs a list value)
        for child in el.children:
            value = self.value(child, _property_schema(schema, child.key), f"{path}.{child.key}")
            if child.key not in obj:
                obj[child.key] = value
            elif child.key in collected:
                obj[child.key].append(value)
            else:
                obj[child.key] = [obj[child.key], value]
                collected.add(child.key)
        if stray.strip():
            key = "$text"
            while key in obj:
                key = "$" + key
            obj[key] = stray
        return obj


# ------------------------------------------------------------------------------------------------------------
# Element parsing: prefix-stable, i.e. a result other than _MORE never changes when more text is appended


class _Signal:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_MORE = _Signal("MORE")  # the text ends before this can be decided
_BAD = _Signal("BAD")  # not an element (or, at the end of generation, one that never closed)


def _could_become(text: str, markers: Iterable[str]) -> bool:
    """`text` is a proper prefix of one of `markers` (more text could make it that marker)."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)


def _tag_names(tag: str) -> tuple[str, str] | None:
    """(key, closing tag name) of an opening tag's text, or None if it is no parameter tag."""
    name = tag.strip()
    if not name or name[0] in "/!?" or "<" in name or "\n" in name or name.split()[0] in _OUTER_TAGS:
        return None
    m2 = _M2_PARAMETER.fullmatch(name)
    if m2:
        key = next(g for g in m2.groups() if g is not None).strip()
        return (key, "parameter") if key else None
    return name, name


def _find_tag_end(buf: str, start: int) -> int | _Signal:
    """Index of the `>` ending a tag whose name starts at `start`; _MORE if the text ends first; _BAD if there is
    none within _MAX_TAG_CHARS. The cap is counted from the tag, not the text's end, so the answer does not
    depend on how much text has arrived."""
    gt = buf.find(">", start, start + _MAX_TAG_CHARS)
    if gt >= 0:
        return gt
    return _BAD if len(buf) >= start + _MAX_TAG_CHARS else _MORE


def _skip_space(buf: str, k: int) -> int:
    n = len(buf)
    while k < n and buf[k].isspace():
        k += 1
    return k


def _parse_elided(buf: str, i: int, final: bool) -> tuple[str, str, int] | _Signal:
    """`NS value NS</name>` (an opening tag the model left out) at `i`: (name, value, end)."""
    start = i + len(NS)
    j = buf.find(NS, start)
    if j < 0:
        return _BAD if final else _MORE
    k = j + len(NS)
    if not buf.startswith("</", k):
        return _MORE if not final and _could_become(buf[k:], ("</",)) else _BAD
    gt = _find_tag_end(buf, k + 2)
    if gt is _MORE and final:
        return _BAD
    if isinstance(gt, _Signal):
        return gt
    name = buf[k + 2:gt].strip()
    if not name or name in _OUTER_TAGS:
        return _BAD
    return name, buf[start:j], gt + 1


def _accepts_bare_close(buf: str, after: int, close: str, final: bool,
                        is_parameter: Callable[[str], bool] | None) -> bool | _Signal:
    """Whether an unprefixed `</close>` ending at `after` closes its element: only if structure follows it (see
    the module docstring). `is_parameter` (top-level parameters only) also accepts an unprefixed opening tag of
    one of the function's parameters, for output that dropped the marker from every tag."""
    k = _skip_space(buf, after)
    if k == len(buf):
        return True if final else _MORE
    rest = buf[k:k + len(NS) + len(close) + 3]
    own = f"{NS}</{close}>"
    if rest.startswith(own):
        return False  # the prefixed close follows: the bare one was text of the value
    if not final and _could_become(rest, (own,)):
        return _MORE
    for marker in (NS, _BARE_INVOKE_END, _BARE_BLOCK_END, "<invoke"):
        if rest.startswith(marker):
            return True
        if not final and _could_become(rest, (marker,)):
            return _MORE
    if is_parameter is not None and buf.startswith("<", k):
        gt = _find_tag_end(buf, k + 1)
        if gt is _MORE:
            return False if final else _MORE
        names = _tag_names(buf[k + 1:gt]) if isinstance(gt, int) else None
        return names is not None and is_parameter(names[0])
    return False


@dataclasses.dataclass
class _Frame:
    """An element being scanned: everything before `q` in its body is settled."""

    key: str
    close: str  # its closing tag's name
    body: int  # where its body starts
    q: int  # where scanning resumes
    marker_end: int  # just past the NS that opened it (its text if it never closes)
    texts: list[str] = dataclasses.field(default_factory=list)
    children: list[_Element] = dataclasses.field(default_factory=list)


def _open_element(buf: str, pos: int, final: bool) -> _Frame | tuple[_Element, int] | _Signal:
    """The opening of an element at `pos` (`NS<key>`, `<key>`): a frame to scan its body in; or a whole element
    (`<key/>`, or an elided `NS value NS</key>`) and the index after it."""
    p = pos + len(NS) if buf.startswith(NS, pos) else pos
    if p >= len(buf):
        return _BAD if final else _MORE
    if buf[p] != "<":
        if p == pos:
            return _BAD
        elided = _parse_elided(buf, pos, final)
        if isinstance(elided, _Signal):
            return elided
        name, value, end = elided
        return _Element(name, [value]), end
    gt = _find_tag_end(buf, p + 1)
    if gt is _MORE and final:
        return _BAD
    if isinstance(gt, _Signal):
        return gt
    tag = buf[p + 1:gt]
    if tag.endswith("/") and _tag_names(tag[:-1]):  # <key/>: an empty value
        return _Element(_tag_names(tag[:-1])[0]), gt + 1
    names = _tag_names(tag)
    if names is None:
        return _BAD
    return _Frame(names[0], names[1], gt + 1, gt + 1, p)


class _ElementScan:
    """Incremental parse of one parameter element starting at `start` of a growing buffer.

    `step(buf, final)` returns (_Element, index after it), _MORE (the text ends first; call again with more text:
    scanning resumes where it stopped, so a long value costs linear time however it is split), or _BAD (not an
    element; at the end of generation also one that never closed). `outer` holds the closing-tag names of what
    encloses the element: meeting one closes it implicitly, its own closing tag missing. Every decision depends
    only on text before the point it is made at, so the result does not depend on how the text arrived.
    """

    def __init__(self, start: int, outer: tuple[str, ...], is_parameter: Callable[[str], bool] | None = None):
        self._start = start
        self._outer = outer
        self._is_parameter = is_parameter
        self._frames: list[_Frame] = []

    def step(self, buf: str, final: bool) -> tuple[_Element, int] | _Signal:
        if not self._frames:
            opened = _open_element(buf, self._start, final)
            if not isinstance(opened, _Frame):
                return opened
            self._frames.append(opened)
        while True:
            done = self._advance(buf, final)
            if done is not None:
                return done

    def _advance(self, buf: str, final: bool) -> tuple[_Element, int] | _Signal | None:
        """One step of the innermost open element; None = keep going."""
        frames = self._frames
        f = frames[-1]
        n = len(buf)
        bare = f"</{f.close}>"
        i, c = buf.find(NS, f.q), buf.find(bare, f.q)
        if c >= 0 and (i < 0 or c < i):
            accepted = _accepts_bare_close(buf, c + len(bare), f.close, final,
                                           self._is_parameter if len(frames) == 1 else None)
            if accepted is _MORE:
                return _MORE
            f.texts.append(buf[f.q:c] if accepted else buf[f.q:c + len(bare)])
            if accepted:
                return self._close(buf[f.body:c], c + len(bare), implicit=False)
            f.q = c + len(bare)  # the value's own text
            return None
        if i < 0:
            if final:
                return self._unclosed()
            settled = n - max(len(NS), len(bare)) + 1  # no marker can start before this
            if settled > f.q:
                f.texts.append(buf[f.q:settled])
                f.q = settled
            return _MORE
        if i > f.q:
            f.texts.append(buf[f.q:i])
            f.q = i
        r = i + len(NS)
        if r >= n or (buf[r] == "<" and r + 1 == n):  # `NS` or `NS<`: what follows is not known yet
            return self._unclosed() if final else _MORE
        if buf.startswith("</", r):
            gt = _find_tag_end(buf, r + 2)
            if gt is _MORE:
                return self._unclosed() if final else _MORE
            if gt is _BAD:  # no closing tag after all: the marker is text
                f.texts.append(NS)
                f.q = r
                return None
            name = buf[r + 2:gt].strip()
            if name == f.close:
                return self._close(buf[f.body:i], gt + 1, implicit=False)
            if name in self._outer or any(fr.close == name for fr in frames[:-1]):
                return self._close(buf[f.body:i], i, implicit=True)  # the enclosing tag is left for its owner
            f.texts.append(buf[i:gt + 1])  # a stray closing tag: text of the value
            f.q = gt + 1
            return None
        opened = _open_element(buf, i, final) if len(frames) <= _MAX_DEPTH else _BAD
        if opened is _MORE:
            return _MORE
        if opened is _BAD:  # not an element after all: the marker is text
            f.texts.append(NS)
            f.q = r
            return None
        if isinstance(opened, _Frame):
            frames.append(opened)
            return None
        child, end = opened
        if child.key == f.close and buf[r] != "<":  # `NS value NS</key>`: a stray marker inside this very value
            f.texts.extend(child.texts)
            return self._close(buf[f.body:buf.rfind(NS, 0, end)], end, implicit=False)
        f.children.append(child)
        f.q = end
        return None

    def _close(self, inner: str, end: int, implicit: bool) -> tuple[_Element, int] | None:
        f = self._frames.pop()
        el = _Element(f.key, f.texts)
        el.children, el.inner, el.implicit = f.children, inner, implicit
        if not self._frames:
            return el, end
        parent = self._frames[-1]
        parent.children.append(el)
        parent.q = end
        return None

    def _unclosed(self) -> _Signal | None:
        """End of generation inside an element: a nested one was no element after all (its marker is text of
        the enclosing value, as when an opening tag is malformed); the outermost one is _BAD."""
        f = self._frames.pop()
        if not self._frames:
            return _BAD
        parent = self._frames[-1]
        parent.texts.append(NS)
        parent.q = f.marker_end
        return None


# ------------------------------------------------------------------------------------------------------------
# The parser


def _random_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass
class _Call:
    index: int
    id: str
    name: str
    schema: Mapping[str, Any] | None
    parts: list[str] = dataclasses.field(default_factory=list)  # argument fragments emitted so far
    keys: set[str] = dataclasses.field(default_factory=set)


_TEXT, _BLOCK, _INVOKE, _RAW_INVOKE = "text", "block", "invoke", "raw_invoke"


class ToolCallParser:
    """Streaming M3 tool-call parser: `push(delta)` per text delta, `finish()` once at the end of generation.

    `tools`: the request's OpenAI tools (their `function.parameters` schemas type the arguments); None or empty
    accepts any function name, untyped. `id_factory` makes call ids (default `call_<24 hex>`).
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, *,
                 id_factory: Callable[[], str] | None = None) -> None:
        self._functions = _function_schemas(tools)
        self._new_id = id_factory or _random_call_id
        self._buf = ""
        self._mode = _TEXT
        self._finished = False
        self._call: _Call | None = None
        self._block_raw = ""  # raw text of the current block while it has no invoke yet
        self._block_invokes = 0
        self._scan: _ElementScan | None = None  # the parameter being parsed, resumable
        self._stray: bool = False  # the last thing done was stray text (its issue is extended, not repeated)
        self._out_content: list[str] = []
        self._out_calls: list[dict[str, Any]] = []
        self._content: list[str] = []  # all content so far, joined on demand
        self.tool_calls: list[dict[str, Any]] = []  # completed calls, OpenAI shape
        self.issues: list[ToolCallIssue] = []

    # -- public ------------------------------------------------------------------------------------------------

    def push(self, delta: str) -> ToolCallDelta:
        """Parse the next text delta; returns what it settles (held-back text comes with a later delta)."""
        if self._finished:
            raise RuntimeError("push after finish")
        self._buf += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> ToolCallDelta:
        """End of generation: settle everything held; an unfinished call or block is closed and reported."""
        if self._finished:
            return ToolCallDelta("", [])
        self._run(final=True)
        self._finished = True
        if self._mode == _INVOKE:
            rest = self._buf.strip()
            if rest:
                self._emit_content(rest)
            call = self._call
            assert call is not None
            self._issue(UNCLOSED_CALL, f"generation ended inside the call to {call.name!r}; it keeps the "
                        "parameters completed before the end" + ("; the unfinished rest went to content"
                                                                  if rest else ""), call=call, text=rest)
            self._close_call()
        elif self._mode == _BLOCK:
            self._end_block(closed=False)
        elif self._buf:
            self._emit_content(self._buf)
        self._buf = ""
        return self._take()

    @property
    def content(self) -> str:
        """All content so far."""
        if len(self._content) > 1:
            self._content = ["".join(self._content)]
        return self._content[0] if self._content else ""

    def result(self) -> ToolCallResult:
        """Everything so far: after `finish()`, the same as `extract_tool_calls` of the whole text."""
        return ToolCallResult(self.content, list(self.tool_calls), list(self.issues))

    # -- output ------------------------------------------------------------------------------------------------

    def _take(self) -> ToolCallDelta:
        out = ToolCallDelta("".join(self._out_content), self._out_calls)
        self._out_content, self._out_calls = [], []
        return out

    def _emit_content(self, text: str) -> None:
        if text:
            self._out_content.append(text)
            self._content.append(text)

    def _issue(self, kind: str, message: str, call: _Call | None = None, function: str | None = None,
               parameter: str | None = None, text: str = "") -> None:
        self._stray = False
        self.issues.append(ToolCallIssue(kind, message, call.index if call else None,
                                         call.name if call else function, parameter, text))

    # -- the state machine ---------------------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        steps = {_TEXT: self._step_text, _BLOCK: self._step_block, _INVOKE: self._step_invoke,
                 _RAW_INVOKE: self._step_raw_invoke}
        while self._buf and steps[self._mode](final):
            pass

    def _step_text(self, final: bool) -> bool:
        """Content until a block opens (`NS<tool_call>`, a bare `<tool_call>`, or an invoke without wrapper)."""
        buf = self._buf
        i, j = buf.find(NS), buf.find(_BARE_BLOCK_START)
        if j >= 0 and (i < 0 or j < i):
            self._emit_content(buf[:j])
            self._open_block(_BARE_BLOCK_START)
            self._buf = buf[j + len(_BARE_BLOCK_START):]
            return True
        if i < 0:
            keep = 0 if final else max(_partial_len(buf, NS), _partial_len(buf, _BARE_BLOCK_START))
            self._emit_content(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit_content(buf[:i])
        rest = buf[i:]
        if rest.startswith(TOOL_CALL_START):
            self._open_block(TOOL_CALL_START)
            self._buf = rest[len(TOOL_CALL_START):]
            return True
        if rest.startswith(_INVOKE_OPENERS[:2]):  # an invoke whose wrapper was left out
            self._open_block("")
            self._buf = rest
            return True
        if not final and _could_become(rest, (TOOL_CALL_START, *_INVOKE_OPENERS[:2])):
            self._buf = rest
            return False
        self._emit_content(NS)  # a stray marker: text
        self._buf = rest[len(NS):]
        return True

    def _open_block(self, raw: str) -> None:
        self._mode, self._block_raw, self._block_invokes, self._stray = _BLOCK, raw, 0, False

    def _end_block(self, closed: bool, closer: str = "") -> None:
        if self._block_invokes == 0:
            raw = self._block_raw + closer
            self._emit_content(raw)
            self._issue(EMPTY_BLOCK, "a tool-call block without any invoke; its text went to content", text=raw)
        elif not closed:
            self._issue(UNCLOSED_BLOCK, "the tool-call block was not closed; its calls stand")
        self._mode, self._block_raw = _TEXT, ""

    def _step_block(self, final: bool) -> bool:
        """Between invokes: whitespace, then an invoke, the block's end, or text (the block ended unclosed)."""
        buf = self._buf
        body = buf.lstrip()
        space = buf[:len(buf) - len(body)]
        if not body:
            return False  # whitespace only: wait (at the end, finish() closes the block)
        for closer in _BLOCK_CLOSERS:
            if body.startswith(closer):
                self._block_raw += space
                self._end_block(closed=True, closer=closer)
                self._buf = body[len(closer):]
                return True
        if body.startswith(_INVOKE_OPENERS):
            header = _parse_header(body, final)
            if header is _MORE:
                return False
            self._block_raw += space
            name, end = header
            if not name:  # a nameless header, or (end < 0) one cut off by the end of generation
                self._degrade_invoke(body[:end] if end >= 0 else body, complete=end >= 0)
                self._buf = body[end:] if end >= 0 else ""
                return True
            self._start_invoke(name, body[:end])
            self._buf = body[end:]
            return True
        if not final and _could_become(body, (*_BLOCK_CLOSERS, *_INVOKE_OPENERS)):
            return False
        # Anything else: the block is over without its closer; the text is content again.
        self._block_raw += space
        self._end_block(closed=False)
        self._buf = body
        return True

    def _degrade_invoke(self, raw: str, complete: bool) -> None:
        """An invoke header that is no call: its raw text (and, if complete, its body) goes to content."""
        if self._block_invokes == 0:
            self._block_raw = ""  # the block has an invoke: its wrapper is structure, not content
        self._block_invokes += 1
        self._emit_content(raw)
        if complete:
            self._issue(MALFORMED_INVOKE, "an invoke without a function name; its text went to content", text=raw)
            self._mode = _RAW_INVOKE
        else:  # the end of generation: no block left to close either
            self._issue(UNCLOSED_CALL, "generation ended inside an invoke header; its text went to content",
                        text=raw)
            self._mode = _TEXT

    def _start_invoke(self, name: str, raw: str) -> None:
        if self._block_invokes == 0:
            self._block_raw = ""
        self._block_invokes += 1
        if self._functions is not None and name not in self._functions:
            self._emit_content(raw)
            self._issue(UNKNOWN_FUNCTION, f"the model called {name!r}, which is not among the request's tools; "
                        "the invoke went to content", function=name, text=raw)
            self._mode = _RAW_INVOKE
            return
        schema = self._functions.get(name) if self._functions is not None else None
        call = _Call(len(self.tool_calls), self._new_id(), name, schema)
        self._call, self._mode, self._scan, self._stray = call, _INVOKE, None, False
        self._out_calls.append({"index": call.index, "id": call.id, "type": "function",
                                "function": {"name": name, "arguments": ""}})

    def _step_raw_invoke(self, final: bool) -> bool:
        """The body of an invoke that is no call: content, up to and including its closing tag."""
        buf = self._buf
        end = buf.find(_BARE_INVOKE_END)
        if end >= 0:
            self._emit_content(buf[:end + len(_BARE_INVOKE_END)])
            self._buf = buf[end + len(_BARE_INVOKE_END):]
            self._mode = _BLOCK
            return True
        keep = 0 if final else _partial_len(buf, _BARE_INVOKE_END)
        self._emit_content(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _step_invoke(self, final: bool) -> bool:
        """Inside a call, between parameters: a parameter element, the invoke's end, or stray text."""
        call = self._call
        assert call is not None
        if self._scan is not None:
            return self._scan_parameter(call, final)
        buf = self._buf
        k = _skip_space(buf, 0)  # indexes, not slices: a long parameter may be pending in the buffer
        if k == len(buf):
            return False
        if buf.startswith(_INVOKE_CLOSERS, k):
            self._close_call()
            self._buf = buf[k + len(INVOKE_END if buf.startswith(INVOKE_END, k) else _BARE_INVOKE_END):]
            self._mode = _BLOCK
            return True
        if buf.startswith(_BLOCK_CLOSERS, k) or buf.startswith(_INVOKE_OPENERS, k):
            self._close_call()  # </invoke> left out: the block's end or the next invoke closes the call too
            self._mode = _BLOCK
            self._buf = buf[k:]
            return True
        if not final and _could_become(buf[k:k + 32], (*_INVOKE_CLOSERS, *_BLOCK_CLOSERS, *_INVOKE_OPENERS)):
            return False
        if buf.startswith(NS, k) or (buf[k] == "<" and k + 1 < len(buf) and buf[k + 1] not in "/!?<"
                                     and not buf[k + 1].isspace()):
            self._scan = _ElementScan(k, _OUTER_TAGS, self._parameter_names(call))
            return self._scan_parameter(call, final)
        self._stray_text(call, buf, k)
        return True

    def _scan_parameter(self, call: _Call, final: bool) -> bool:
        scan = self._scan
        assert scan is not None
        parsed = scan.step(self._buf, final)
        if parsed is _MORE:
            return False
        self._scan = None
        if isinstance(parsed, tuple):
            el, end = parsed
            self._add_parameter(call, el)
            self._buf = self._buf[end:]
            return True
        k = _skip_space(self._buf, 0)
        if final and _ElementScan(k, _OUTER_TAGS, self._parameter_names(call)).step(self._buf, False) is _MORE:
            return False  # a parameter cut off by the end of generation: finish() reports it
        self._stray_text(call, self._buf, k)  # not a parameter after all
        return True

    @staticmethod
    def _parameter_names(call: _Call) -> Callable[[str], bool]:
        """Which unprefixed opening tags count as the next parameter (see _accepts_bare_close): the function's
        declared parameters, or, with no schema, any plain name."""
        props = call.schema.get("properties") if isinstance(call.schema, Mapping) else None
        if isinstance(props, Mapping) and props:
            return lambda name: _property_schema(call.schema, name) is not None
        return lambda name: _PLAIN_NAME.fullmatch(name) is not None

    def _stray_text(self, call: _Call, buf: str, k: int) -> None:
        """Text inside an invoke that is no parameter: content, up to where structure may start again.
        Whitespace before structure is formatting; whitespace between stray words is kept."""
        cut = [j for j in (buf.find("<", k + 1), buf.find("]", k + 1)) if j > 0]
        kept = buf[k:min(cut) if cut else len(buf)].rstrip()  # non-empty: buf[k] is not a space
        text = buf[:k] + kept
        self._emit_content(text)
        last = self.issues[-1] if self.issues else None
        if self._stray and last is not None and last.call_index == call.index:
            self.issues[-1] = dataclasses.replace(last, text=last.text + text)
        else:
            self._issue(STRAY_TEXT, f"text inside the call to {call.name!r} that is not a parameter; it went to "
                        "content", call=call, text=text)
        self._stray = True
        self._buf = buf[k + len(kept):]

    def _add_parameter(self, call: _Call, el: _Element) -> None:
        self._stray = False
        key = el.key
        if key in call.keys:
            self._issue(DUPLICATE_PARAMETER, f"parameter {key!r} given twice; the first is kept", call=call,
                        parameter=key, text=el.inner)
            return
        if call.schema is not None and not _declares_property(call.schema, key):
            self._issue(UNKNOWN_PARAMETER, f"{call.name!r} declares no parameter {key!r}; kept untyped", call=call,
                        parameter=key, text=el.inner)
        converter = _Converter(lambda kind, msg, path, text: self._issue(kind, msg, call=call, parameter=path,
                                                                          text=text))
        value = converter.value(el, _property_schema(call.schema, key), key)
        try:
            encoded = json.dumps(value, ensure_ascii=False)
        except (RecursionError, ValueError):  # JSON text nested deeper than json can write back
            self._issue(BAD_VALUE, f"parameter {key!r} is nested too deeply; kept as text", call=call,
                        parameter=key, text=el.inner)
            encoded = json.dumps(el.inner, ensure_ascii=False)
        fragment = ("{" if not call.parts else ", ") + json.dumps(key, ensure_ascii=False) + ": " + encoded
        call.parts.append(fragment)
        call.keys.add(key)
        self._out_calls.append({"index": call.index, "function": {"arguments": fragment}})

    def _close_call(self) -> None:
        call = self._call
        assert call is not None
        closing = "}" if call.parts else "{}"
        call.parts.append(closing)
        self._out_calls.append({"index": call.index, "function": {"arguments": closing}})
        self._stray = False
        self.tool_calls.append({"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": "".join(call.parts)}})
        required = call.schema.get("required") if isinstance(call.schema, Mapping) else None
        missing = [k for k in required if isinstance(k, str) and k not in call.keys] if isinstance(
            required, list) else []
        if missing:
            self._issue(MISSING_PARAMETER, f"the call to {call.name!r} lacks required parameter(s) {missing}",
                        call=call, parameter=",".join(missing))
        self._call = None


def _partial_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _parse_header(body: str, final: bool) -> tuple[str, int] | _Signal:
    """The invoke header at the start of `body`: (name, end); ("", end) for a header without a usable name;
    ("", -1) for one cut off by the end of generation; _MORE while it is not complete."""
    opener = len(NS) if body.startswith(NS) else 0  # NS itself contains a `>`
    gt = _find_tag_end(body, opener)
    if gt is _MORE:
        return ("", -1) if final else _MORE
    if gt is _BAD:
        return "", opener + _MAX_TAG_CHARS
    m = _INVOKE_HEADER.fullmatch(body, 0, gt + 1)
    name = next((g for g in m.groups() if g is not None), "").strip() if m else ""
    return name, gt + 1


# ------------------------------------------------------------------------------------------------------------
# Whole-text API, rendering, forced calls


def extract_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None, *,
                       id_factory: Callable[[], str] | None = None) -> ToolCallResult:
    """Content, OpenAI tool calls and issues of a whole generated text (content exact, "" when none)."""
    parser = ToolCallParser(tools, id_factory=id_factory)
    parser.push(text)
    parser.finish()
    return parser.result()


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, OpenAI tool_calls) of a whole generated text; `extract_tool_calls` also gives issues."""
    result = extract_tool_calls(text, tools)
    return result.content or None, result.tool_calls


def _to_xml(value: Any) -> str:
    """A value as M3's template writes it (its `to_xml` macro): mappings as key elements (None values left
    out), other iterables as <item> elements, booleans as true/false, None as nothing, the rest as text."""
    if isinstance(value, Mapping):
        return "".join(f"{NS}<{k}>{_to_xml(v)}{NS}</{k}>" for k, v in value.items() if v is not None)
    if isinstance(value, list | tuple):
        return "".join(f"{NS}<item>{_to_xml(v)}{NS}</item>" for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    return str(value)


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """OpenAI tool calls (arguments as a JSON string or a mapping) as M3's chat template renders them in an
    assistant turn: the block a model trained on that template emits. "" for no calls."""
    if not tool_calls:
        return ""
    parts = [TOOL_CALL_START, "\n"]
    for call in tool_calls:
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
        args = fn.get("arguments")
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        parts.append(f'{NS}<invoke name="{fn["name"]}">')
        parts.extend(f"{NS}<{k}>{_to_xml(v)}{NS}</{k}>" for k, v in (args or {}).items() if v is not None)
        parts.append(f"{INVOKE_END}\n")
    parts.append(TOOL_CALL_END)
    return "".join(parts)


def forced_call_prefix(name: str | None = None) -> str:
    """The text a response must start with to call `name` (tool_choice naming a function), up to and including
    the invoke header; with no name (tool_choice="required"), up to the opening quote of the name:

        forced_call_prefix("get_weather") == ']<]minimax[>[<tool_call>\\n]<]minimax[>[<invoke name="get_weather">'
        forced_call_prefix()              == ']<]minimax[>[<tool_call>\\n]<]minimax[>[<invoke name="'

    A constrained decoder forces this prefix (after the `<mm:think>` block when thinking is on), then lets the
    model write parameters, `]<]minimax[>[</invoke>` and `]<]minimax[>[</tool_call>`.
    """
    head = f'{TOOL_CALL_START}\n{NS}<invoke name="'
    if name is None:
        return head
    if not name or '"' in name or ">" in name:
        raise ValueError(f"not a function name that can be rendered in an invoke header: {name!r}")
    return f'{head}{name}">'


# ------------------------------------------------------------------------------------------------------------
# Constrained decoding: an llguidance Lark grammar of M3's tool-call format


def inline_refs(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """`schema` with its local `$ref`s (`#/$defs/...`, `#/definitions/...`) replaced by what they point to, so that
    both the grammar and the parser see the real types (the parser does not follow `$ref`). A reference that
    cannot be resolved, or one nested deeper than the parser follows (a recursive schema), becomes `{}` (any
    value)."""
    root = schema if root is None else root
    if depth > _GRAMMAR_MAX_DEPTH:
        return {}
    if isinstance(schema, Mapping):
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target: Any = root
            if ref.startswith("#/"):
                for part in ref[2:].split("/"):
                    part = part.replace("~1", "/").replace("~0", "~")
                    target = target.get(part) if isinstance(target, Mapping) else None
            else:
                target = None
            if not isinstance(target, Mapping):
                return {}
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return inline_refs({**target, **rest}, root, depth + 1)
        return {k: (v if k in ("$defs", "definitions", "enum", "const", "required", "default", "examples")
                    else inline_refs(v, root, depth + 1)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [inline_refs(v, root, depth + 1) for v in schema]
    return schema


def inline_tool_refs(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tools with each function's parameters schema `inline_refs`-ed (its refs resolved against itself)."""
    out = []
    for tool in tools:
        fn = tool.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("parameters"), Mapping):
            tool = {**tool, "function": {**fn, "parameters": inline_refs(fn["parameters"])}}
        out.append(dict(tool))
    return out


_GRAMMAR_MAX_DEPTH = 16  # deeper values are free text (untyped)
# JSON-schema keywords of a number that llguidance's %json enforces.
_NUMBER_KEYWORDS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# A string value: any text without `<` (M3's template writes values raw; a `<` could start a tag).
_STRING_REGEX = "[^<]"
# Numbers without bounds: JSON numbers of at most 18 digits (an exponent of at most two), so that every one reads
# back as a finite number (`9E1620` is valid JSON but not a float).
_INTEGER_REGEX = "/-?(0|[1-9][0-9]{0,17})/"
_NUMBER_REGEX = r"/-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][-+]?[0-9]{1,2})?/"


class _LarkBuilder:
    """Builds the Lark text of one grammar. Literal text is split at the tokenizer's special tokens, which a
    grammar must name as tokens (`<[id]>`): as text they would only match a spelling out of ordinary tokens."""

    def __init__(self, special_tokens: Mapping[str, int] | None):
        self._special = sorted(((s, i) for s, i in (special_tokens or {}).items() if s), key=lambda p: -len(p[0]))
        self.lines: list[str] = []
        self._count = 0

    def name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def pieces(self, text: str) -> list[tuple[str, int | None]]:
        """`text` cut into (text, None) and (special token, id) pieces."""
        out: list[tuple[str, int | None]] = []
        plain, i = [], 0
        while i < len(text):
            hit = next(((s, t) for s, t in self._special if text.startswith(s, i)), None)
            if hit is None:
                plain.append(text[i])
                i += 1
                continue
            if plain:
                out.append(("".join(plain), None))
                plain = []
            out.append(hit)
            i += len(hit[0])
        if plain:
            out.append(("".join(plain), None))
        return out

    @staticmethod
    def text_lit(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    def lit(self, text: str) -> str:
        """A Lark sequence matching exactly `text` (special tokens as tokens)."""
        parts = [f"<[{tid}]>" if tid is not None else self.text_lit(s) for s, tid in self.pieces(text)]
        return " ".join(parts) if parts else '""'

    def leaf(self, terminal: str, close: str) -> str:
        """A leaf value (a terminal expression) and then `close`. When `close` starts with text (the marker is
        text in this tokenizer, not a special token) the two become one terminal: llguidance's lexer is greedy,
        so a value that may contain the text's first character (`]`) would otherwise swallow it."""
        pieces = self.pieces(close)
        if pieces and pieces[0][1] is None:
            name = self.name("T")
            self.lines.append(f"{name}: ({terminal}) {self.text_lit(pieces[0][0])}")
            rest = [f"<[{t}]>" if t is not None else self.text_lit(s) for s, t in pieces[1:]]
            return " ".join([name, *rest])
        name = self.name("T")
        self.lines.append(f"{name}: {terminal}")
        return f"{name} {self.lit(close)}".strip()

    def rule(self, body: str) -> str:
        name = self.name("r")
        self.lines.append(f"{name}: {body}")
        return name


def _merge_all_of(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    branches = schema.get("allOf")
    if not isinstance(branches, list):
        return schema
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    props: dict[str, Any] = dict(merged.get("properties") or {})
    required: list[str] = list(merged.get("required") or [])
    for b in branches:
        if not isinstance(b, Mapping):
            continue
        b = _merge_all_of(b)
        for k, v in b.items():
            if k == "properties" and isinstance(v, Mapping):
                props.update(v)
            elif k == "required" and isinstance(v, list):
                required += [r for r in v if r not in required]
            else:
                merged.setdefault(k, v)
    if props:
        merged["properties"] = props
    if required:
        merged["required"] = required
    return merged


def _render_scalar(value: Any) -> str | None:
    """A JSON value as M3's template writes it (None: it cannot be written: the template leaves None out)."""
    if value is None or isinstance(value, Mapping | list):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _value(b: _LarkBuilder, schema: Any, close: str, depth: int) -> str:
    """A Lark expression for one value of `schema` followed by the text `close` (its element's closing tag)."""
    schema = _merge_all_of(schema) if isinstance(schema, Mapping) else {}
    if depth > _GRAMMAR_MAX_DEPTH:
        return b.leaf(f"/{_STRING_REGEX}*/", close)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values is not None:
        rendered = [r for r in (_render_scalar(v) for v in values) if r is not None and "<" not in r]
        if not rendered:
            raise ValueError(f"an enum {values!r} without a value M3's template can write (a scalar without `<`)")
        return b.leaf(" | ".join(b.text_lit(r) for r in dict.fromkeys(rendered)), close)
    branches = [br for key in ("anyOf", "oneOf") for br in (schema.get(key) or []) if isinstance(br, Mapping)]
    if branches:
        base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return b.rule(" | ".join(_value(b, {**base, **br}, close, depth + 1) for br in branches))
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared if isinstance(t, str)] if isinstance(
        declared, list) else _schema_types(schema)
    if len(types) > 1:
        return b.rule(" | ".join(_value(b, {**schema, "type": t}, close, depth + 1) for t in dict.fromkeys(types)))
    kind = types[0] if types else None
    if kind == "string" or kind is None:
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if kind == "string" and (isinstance(lo, int) or isinstance(hi, int)):
            reps = f"{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}"
            return b.leaf(f"/{_STRING_REGEX}{reps}/", close)
        return b.leaf(f"/{_STRING_REGEX}*/", close)
    if kind in ("integer", "number"):
        bounds = {k: schema[k] for k in _NUMBER_KEYWORDS if k in schema and k != "type"}
        if not bounds:
            return b.leaf(_INTEGER_REGEX if kind == "integer" else _NUMBER_REGEX, close)
        number = {"type": kind, **bounds, "x-guidance": {"whitespace_flexible": False}}
        return f"%json {json.dumps(number)} {b.lit(close)}"
    if kind == "boolean":
        return b.leaf('"true" | "false"', close)
    if kind == "null":
        return b.leaf('"null"', close)
    if kind == "array":
        items = schema.get("items") if isinstance(schema.get("items"), Mapping) else {}
        item = b.rule(f"{b.lit(NS + '<item>')} {_value(b, items, NS + '</item>', depth + 1)}")
        lo = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
        hi = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else None
        if hi is not None and hi < lo:
            raise ValueError(f"an array with minItems {lo} > maxItems {hi}")
        bounds = f"{{{lo},{'' if hi is None else hi}}}"
        reps = "*" if (lo, hi) == (0, None) else "+" if (lo, hi) == (1, None) else bounds
        if hi == 0:
            return b.lit(close)
        return f"{item}{reps} {b.lit(close)}"
    if kind == "object":
        return f"{_properties(b, schema, depth)} {b.lit(close)}".strip()
    raise ValueError(f"unknown JSON-schema type {kind!r}")


def _properties(b: _LarkBuilder, schema: Mapping[str, Any], depth: int) -> str:
    """An object's members as nested elements, in the schema's order: required ones always, others optional."""
    props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
    required = [r for r in schema.get("required") or [] if isinstance(r, str)]
    missing = [r for r in required if r not in props]
    if missing:
        raise ValueError(f"required parameter(s) {missing} without a schema in `properties`")
    parts = []
    for key, sub in props.items():
        if not isinstance(key, str) or not key or any(c in key for c in "<>/ \t\n") or NS in key:
            raise ValueError(f"parameter name {key!r} cannot be written as an element name")
        element = b.rule(f"{b.lit(f'{NS}<{key}>')} {_value(b, sub, f'{NS}</{key}>', depth + 1)}")
        parts.append(element if key in required else f"{element}?")
    return " ".join(parts)


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], *, function: str | None = None, parallel: bool = True,
                      special_tokens: Mapping[str, int] | None = None,
                      optional_thinking: bool = False) -> str:
    """An llguidance Lark grammar whose every output is a valid M3 tool-call block (the canonical form that
    `render_tool_calls` writes and `ToolCallParser` reads), for `tool_choice` naming `function` (one invoke of it)
    or, with `function=None`, `tool_choice="required"` (one or more invokes of the listed functions; exactly one
    when not `parallel`).

    Each parameter is an element named after it (required ones present, optional ones may be, in the schema's
    order), its value constrained by its JSON schema: strings are text without `<` (minLength / maxLength kept),
    integers and numbers JSON numbers (minimum / maximum / multipleOf kept, via llguidance's %json), booleans
    `true`/`false`, enums and consts one of their values, objects nested elements, arrays `<item>` elements
    (minItems / maxItems kept), anyOf / oneOf / type lists any of their branches, allOf merged; `$ref` must have
    been inlined (`inline_refs`). Not enforced: string `pattern` / `format`, `uniqueItems`, keys beyond
    `properties`. ValueError for a schema that no rendered call can satisfy or that cannot be written as
    elements.

    `special_tokens`: the tokenizer's special tokens (text -> id). The markers that are special tokens in the
    checkpoint's vocabulary (M3: `]<]minimax[>[`, `<tool_call>`, ...) are matched as those tokens, the way the
    chat template's text tokenises. `optional_thinking`: the output may start with a thinking block,
    `<mm:think>` ... `</mm:think>` or a bare `</mm:think>` (M3's adaptive mode); both markers must then be
    special tokens.
    """
    functions = _function_schemas(tools) or {}
    if function is not None:
        if function not in functions:
            raise ValueError(f"function {function!r} is not among the tools")
        functions = {function: functions[function]}
    if not functions:
        raise ValueError("no function to call")
    b = _LarkBuilder(special_tokens)
    invokes = []
    for name, params in functions.items():
        forced_call_prefix(name)  # ValueError for a name that cannot be written in an invoke header
        params = _merge_all_of(params) if isinstance(params, Mapping) else {}
        body = _properties(b, params, 0)
        invokes.append(b.rule(f'{b.lit(f"{NS}<invoke name=\"{name}\">")} {body} {b.lit(INVOKE_END + chr(10))}'))
    invoke = b.rule(" | ".join(invokes))
    calls = f"{invoke}+" if function is None and parallel else invoke
    block = f"{b.lit(TOOL_CALL_START + chr(10))} {calls} {b.lit(TOOL_CALL_END)}"
    if optional_thinking:
        ids = dict(b.pieces("<mm:think>") + b.pieces("</mm:think>"))
        start, end = ids.get("<mm:think>"), ids.get("</mm:think>")
        if start is None or end is None:
            raise ValueError("optional thinking needs <mm:think> and </mm:think> as special tokens")
        b.lines.append(r"THINKING: /(.|\n)*/")
        think = b.rule(f"<[{start}]> THINKING <[{end}]> | <[{end}]>")
        return "\n".join([f"start: {think}? {block}", *b.lines]) + "\n"
    return "\n".join([f"start: {block}", *b.lines]) + "\n"
