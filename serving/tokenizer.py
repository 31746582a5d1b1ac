"""Text in and out of the engine: the checkpoint's tokenizer and chat template, streaming detokenization,
stop strings.

Three parts, each usable on its own:

- `M3Tokenizer.from_dir(path)` reads a Hugging Face checkpoint directory (tokenizer.json through the
  `tokenizers` library, the chat template rendered with a sandboxed jinja2 the way transformers renders
  it, and the BOS/EOS ids from tokenizer_config / special_tokens_map / generation_config / config). M3's
  chat template writes the `]~!b[` BOS itself (spec §6), so nothing here ever prepends one.
- `IncrementalDetokenizer` turns a stream of token ids into a stream of text without splitting a UTF-8
  character, in O(window) work per token.
- `find_stop` / `StopChecker` implement stop strings for streaming.

How the engine strings these together for one request::

    detok = IncrementalDetokenizer(tok, prompt_ids)
    stop = StopChecker(request.stop)
    for each sampled token id (stopping on id in tok.eos_token_ids, which is not passed to detok):
        emit, stopped = stop.push(detok.push(token_id))
        stream(emit)                 # may be "": text that could still turn into a stop string is held back
        if stopped: finish("stop")   # the output text ends right before the stop string
    at the end without a stop string:
        emit, _ = stop.push(detok.flush()); stream(emit + stop.flush())
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from os import PathLike
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# M3's special tokens (spec §6). The template emits BOS once at the start; EOT ends every turn and is the EOS.
M3_BOS = "]~!b["
M3_EOT = "[e~["

VALID_ROLES = frozenset({"system", "user", "assistant", "ai", "tool", "developer"})

_REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode shows for bytes that are not (yet) a whole character


class TokenizerError(ValueError):
    """A tokenizer file this module cannot use; the message names the file."""


class TokenizerMissing(TokenizerError):
    """The checkpoint has no tokenizer.json: the engine can only take token ids for it, not text."""


class ChatTemplateError(TokenizerError):
    """No chat template, or the template rejected the conversation (`raise_exception`) or failed to render."""


# ------------------------------------------------------------------------------------------------------------
# Reading the checkpoint's files


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot be read as JSON: {e}") from e
    if not isinstance(obj, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token_string(entry: object) -> str | None:
    """A special token as tokenizer_config / special_tokens_map spell it: a string or an AddedToken dict."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _ids(value: object) -> list[int]:
    """`eos_token_id` / `bos_token_id` as configs write them: an int, a list of ints, or null."""
    items = value if isinstance(value, list) else [value]
    # bool is an int subclass; a `true` in a config is a mistake, not token id 1.
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _named_templates(value: object, source: Path) -> dict[str, str]:
    """`chat_template` in tokenizer_config / chat_template.json: a string or a list of {name, template}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        out: dict[str, str] = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise TokenizerError(f"{source}: chat_template list entries must be "
                                     "{name, template} string pairs")
            out[item["name"]] = item["template"]
        return out
    raise TokenizerError(f"{source}: chat_template must be a string or a list, got {type(value).__name__}")


def _load_chat_templates(directory: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """Later sources override earlier ones, in the order transformers gives them precedence."""
    templates = _named_templates(tokenizer_config.get("chat_template"), directory / "tokenizer_config.json")
    # Processor-style file (VL checkpoints) written by older transformers.
    processor_file = directory / "chat_template.json"
    processor = _read_json(processor_file)
    if processor is not None:
        templates.update(_named_templates(processor.get("chat_template"), processor_file))
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    # The standalone file is what current checkpoints (M3 included) ship; it wins over the JSON copies.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


# ------------------------------------------------------------------------------------------------------------
# Chat template rendering, as transformers does it


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks in transformers'
    templates; for serving it only has to render its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes `<>&'`, which would change tool schemas in the prompt; transformers
    # replaces it with plain json.dumps, so templates are written against that.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    # Immutable sandbox: the template comes from a downloaded checkpoint and the messages from users, so
    # neither may reach Python internals nor mutate the objects passed in. trim_blocks/lstrip_blocks match
    # transformers, without which the same template renders different whitespace.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """A chat request's messages: a non-empty list of dicts, each with a known `role` and string `content`.

    An assistant turn that only carries `tool_calls` (OpenAI's shape) may have `content` null or absent.
    Other keys (`name`, `tool_calls`, `tool_call_id`, `reasoning_content`, ...) go to the template untouched.
    """
    if not isinstance(messages, list | tuple):
        raise ValueError("messages must be a list of {role, content} objects, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with role and content, got {type(m).__name__}")
        role = m.get("role")
        if role not in VALID_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(VALID_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if content is None and role in ("assistant", "ai") and m.get("tool_calls"):
            continue
        if "content" not in m:
            raise ValueError(f"messages[{i}] ({role}) has no content")
        raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}"
                         + (" (flatten text parts into one string)" if isinstance(content, list) else ""))
    return [_with_parsed_arguments(dict(m), i) for m in messages]


def _with_parsed_arguments(m: dict[str, Any], i: int) -> dict[str, Any]:
    """OpenAI sends an assistant tool call's `arguments` as a JSON string; M3's template iterates them as a
    mapping (`arguments.items()`), so they are parsed first, as vLLM does."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    if not isinstance(calls, list | tuple):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    parsed = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}] must have a function with a name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}") \
                    from None
        if not isinstance(args, Mapping):
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
        parsed.append({**call, "function": {**fn, "arguments": dict(args)}})
    return {**m, "tool_calls": parsed}


def _validate_tools(tools: object) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list | tuple) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be a list of tool (JSON schema) objects")
    return [dict(t) for t in tools]


# ------------------------------------------------------------------------------------------------------------
# The tokenizer


class M3Tokenizer:
    """A checkpoint's tokenizer and chat template. Build it with `from_dir`."""

    def __init__(self, backend: Tokenizer, *, chat_templates: Mapping[str, str] | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 bos_token_id: int | None = None, eos_token_ids: Iterable[int] = (),
                 extra_template_vars: Mapping[str, str] | None = None, add_bos_token: bool = False) -> None:
        self.backend = backend
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        # Strings the template sees as `bos_token` / `eos_token` (transformers passes the tokenizer's, even
        # where they disagree with the ids, as M3's BOS does: spec §6). "" rather than None so that
        # `{{ bos_token }}` renders nothing, as an undefined variable would, instead of "None".
        self.bos_token = bos_token if bos_token is not None else (self.id_to_token(bos_token_id) or "")
        if eos_token is None and self.eos_token_ids:
            eos_token = self.id_to_token(self.eos_token_ids[0])
        self.eos_token = eos_token or ""
        self._template_vars = {**(extra_template_vars or {}), "bos_token": self.bos_token,
                               "eos_token": self.eos_token}
        # Recorded for callers; not acted on: M3's template writes the BOS, a prepended one would double it.
        self.add_bos_token = add_bos_token

    @classmethod
    def from_dir(cls, path: str | PathLike[str]) -> M3Tokenizer:
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: not a checkpoint directory")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerMissing(f"{directory} has no tokenizer.json: this model has no tokenizer, "
                                   "so prompts must be sent as token ids")
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise TokenizerError(f"{tokenizer_file}: the tokenizers library cannot load it: {e}") from e
        # Serving must see the whole prompt; a truncation/padding setting saved in tokenizer.json would
        # silently cut or pad it.
        backend.no_truncation()
        backend.no_padding()

        tok_config = _read_json(directory / "tokenizer_config.json") or {}
        special_map = _read_json(directory / "special_tokens_map.json") or {}
        gen_config = _read_json(directory / "generation_config.json") or {}
        model_config = _read_json(directory / "config.json") or {}
        text_config = model_config.get("text_config")
        text_config = text_config if isinstance(text_config, dict) else {}

        def token(name: str) -> str | None:
            found = _token_string(tok_config.get(name))
            return found if found is not None else _token_string(special_map.get(name))

        bos_token, eos_token = token("bos_token"), token("eos_token")

        def vocab_id(tok: str | None) -> int | None:
            return backend.token_to_id(tok) if tok else None

        # BOS: M3's configs disagree (special_tokens_map / generation_config say `]~b]`, the HF text config
        # `]~!b[`); the template emits `]~!b[`, so that wins whenever the vocabulary has it (spec §6).
        bos_candidates = [vocab_id(M3_BOS), *_ids(text_config.get("bos_token_id")),
                          *_ids(model_config.get("bos_token_id")), *_ids(gen_config.get("bos_token_id")),
                          vocab_id(bos_token)]
        bos_token_id = next((i for i in bos_candidates if i is not None), None)

        # EOS: every id any config names stops generation, plus M3's end-of-turn token.
        eos_ids = [*_ids(gen_config.get("eos_token_id")), *_ids(model_config.get("eos_token_id")),
                   *_ids(text_config.get("eos_token_id"))]
        eot = vocab_id(M3_EOT)
        if eot is not None:
            eos_ids.append(eot)
        if not eos_ids and vocab_id(eos_token) is not None:
            # A tokenizer-only checkpoint: the tokenizer's EOS is all there is.
            eos_ids.append(vocab_id(eos_token))

        extra_vars = {name: s for name in ("pad_token", "unk_token") if (s := token(name)) is not None}
        add_bos = tok_config.get("add_bos_token")
        return cls(backend, chat_templates=_load_chat_templates(directory, tok_config), bos_token=bos_token,
                   eos_token=eos_token, bos_token_id=bos_token_id, eos_token_ids=eos_ids,
                   extra_template_vars=extra_vars, add_bos_token=add_bos is True)

    # -- vocabulary ------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (M3: 200061), which can be below the model's embedding rows (200064)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # -- text <-> ids ----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in it (`]~b]`, `[e~[`, ...) become their single ids.

        `add_special_tokens=True` applies tokenizer.json's post-processor (M3's adds nothing); a BOS it puts
        in front of a text that already starts with one is dropped.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        # encode_batch, not encode: the binding releases the GIL only there, so a long prompt tokenised on a
        # worker thread does not stop the servers' event loop.
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._collapse_double_bos(ids) if add_special_tokens else ids

    def _collapse_double_bos(self, ids: list[int]) -> list[int]:
        if len(ids) >= 2 and self.bos_token_id is not None and ids[0] == ids[1] == self.bos_token_id:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary (the model's unused embedding rows) decode to nothing."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default") or (
            next(iter(self.chat_templates.values())) if len(self.chat_templates) == 1 else None)

    def _select_template(self, chat_template: str | None, has_tools: bool) -> str:
        if chat_template is not None:
            # A name of one of the checkpoint's templates, else the template text itself (transformers' rule).
            return self.chat_templates.get(chat_template, chat_template)
        if has_tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        template = self.chat_template
        if template is None:
            if self.chat_templates:
                raise ChatTemplateError(f"this model has several chat templates "
                                        f"{sorted(self.chat_templates)} and none named 'default'; "
                                        "pass chat_template=<name>")
            raise ChatTemplateError("this model has no chat template: send a plain prompt or token ids")
        return template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None, **template_kwargs: Any) -> str:
        """Render the checkpoint's own chat template. Extra keyword arguments reach the template as variables
        (M3: `thinking_mode` = "enabled" | "adaptive" | "disabled")."""
        checked = validate_messages(messages)
        tool_list = _validate_tools(tools)
        template = _compile_template(self._select_template(chat_template, bool(tool_list)))
        variables = {**self._template_vars, **template_kwargs, "messages": checked, "tools": tool_list,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e
        except Exception as e:  # third-party template on user data: any failure is this request's, not ours
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Prompt ids of a conversation: the rendered template, with exactly the BOS the template wrote."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        chat_template=chat_template, **template_kwargs)
        # add_special_tokens=False: the template already starts with `]~!b[`; a tokenizer-added BOS would
        # double it (spec §6). A doubled BOS is collapsed too, should a template write both `{{ bos_token }}`
        # and the literal.
        return self._collapse_double_bos(self.encode(text, add_special_tokens=False))


# ------------------------------------------------------------------------------------------------------------
# Streaming detokenization


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# Prompt tokens kept as decoding context for the first output tokens (vLLM uses the same 5).
_CONTEXT_TOKENS = 5
# A run of tokens all ending in an unfinished character longer than this is pathological (a UTF-8 character
# spans at most 4 bytes); past it the held character is emitted as U+FFFD so the window stays bounded.
_MAX_HELD_TOKENS = 64


class IncrementalDetokenizer:
    """Token ids in, newly completed text out, in O(window) work per token.

    Keeps a window of ids `[prefix_offset:]`: the text of `[prefix_offset:read_offset]` was emitted already;
    each push decodes the whole window and emits what lies past that text. Decoding a window rather than the
    new token alone lets the tokenizer's decoder see neighbours (byte-level BPE joins bytes of one character
    spread over several tokens; other decoders drop or add spaces depending on the previous token). When
    the window's text ends in U+FFFD, its last bytes may be an unfinished character: that one character is
    held and the window stays open until a later token finishes it (or flush()). The window slides forward
    whenever its text ends on a whole character, so it holds only the last few tokens.

    With byte-level BPE (M3), the concatenated outputs equal `tokenizer.decode(output_ids)` for any sequence.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = [int(i) for i in (prompt_ids or [])[-_CONTEXT_TOKENS:]]
        if context and self._decode(context).endswith(_REPLACEMENT):
            # A prompt ending mid-character would let the first output bytes finish a character that is half
            # prompt; decode(output_ids) shows those bytes as U+FFFD, so decode without the context instead.
            context = []
        self._ids: list[int] = context  # the window; ids before it are dropped
        self._read_offset = len(context)  # window ids before this have had their text emitted
        self._prefix_text = self._decode(context)  # text of window[:read_offset]
        self._sent = 0  # chars past prefix_text already emitted while the window is held open
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self.num_tokens = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Text this token completes: "" while a character is unfinished or the token decodes to nothing."""
        self._ids.append(int(token_id))
        self.num_tokens += 1
        window_text = self._decode(self._ids)
        start = len(self._prefix_text) + self._sent
        held = len(self._ids) - self._read_offset
        if window_text.endswith(_REPLACEMENT) and held < _MAX_HELD_TOKENS:
            # Only the trailing U+FFFD can still change (more bytes may finish that character); every
            # character before it is final, so stream those now and keep the window open.
            new = window_text[start:-1]
            self._sent += len(new)
        else:
            new = window_text[start:]
            self._advance()
        return self._emit(new)

    def flush(self) -> str:
        """End of the stream: whatever is held, U+FFFD included."""
        new = self._decode(self._ids)[len(self._prefix_text) + self._sent:]
        self._advance()
        return self._emit(new)

    def _advance(self) -> None:
        # The window's text is now all emitted. Keep the ids added since the last advance as context for the
        # next ones (they may still merge with what follows) and drop everything older.
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._sent = 0

    def _emit(self, new: str) -> str:
        if new:
            self._chunks.append(new)
            self._text_cache = None
        return new

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]  # keeps later joins from re-walking every chunk
        return self._text_cache


# ------------------------------------------------------------------------------------------------------------
# Stop strings


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` where the earliest stop string begins, or None.

    `start` is where text not yet checked begins: a stop string lying wholly before it was looked for
    already, so the search starts at `max(0, start - longest_stop + 1)`, the earliest that a stop string
    touching new text can begin.
    """
    longest = max((len(s) for s in stops), default=0)
    if longest == 0:
        return None
    lo = max(0, start - longest + 1)
    best: int | None = None
    for stop in stops:
        if not stop:
            continue  # "" would match everywhere; it is not a stop string
        i = text.find(stop, lo)
        if i != -1 and (best is None or i < best):
            best = i
    return best


class StopChecker:
    """Streaming stop strings: `push(new_text) -> (emit, stopped)`.

    Text is emitted only once it cannot be part of a stop string: a tail that is a prefix of some stop
    string is held until the following text settles it. On a stop, the emitted text ends right before the
    stop string (or includes it with `include_stop=True`) and `stop_str` names it; later pushes emit
    nothing. Without a stop, `flush()` at the end of the stream returns the held tail.
    """

    def __init__(self, stops: Sequence[str] | None, include_stop: bool = False) -> None:
        stops = list(stops or [])
        if not all(isinstance(s, str) for s in stops):
            raise ValueError("stop strings must be strings")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include_stop = include_stop
        self._longest = max((len(s) for s in self.stops), default=0)
        # Every proper prefix of a stop string: the tails worth holding back.
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._held = ""
        self.stopped = False
        self.stop_str: str | None = None

    def push(self, new_text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return new_text, False
        text = self._held + new_text
        # Emitted text holds no stop string nor the start of one (that is what was held), so the search only
        # needs the held tail plus the new text.
        i = find_stop(text, self.stops, len(self._held))
        if i is not None:
            self.stop_str = next(s for s in self.stops if text.startswith(s, i))
            self.stopped = True
            self._held = ""
            return text[:i] + (self.stop_str if self.include_stop else ""), True
        keep = self._partial_stop_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that some stop string begins with."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0

    def flush(self) -> str:
        """End of the stream without a stop: the held tail (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
