"""Chat templates of checkpoints, rendered in a jinja2 sandbox: a template is untrusted data, never code we run.

A checkpoint's `chat_template` (in tokenizer_config.json, or a chat_template.jinja file beside it) is a jinja
template written by whoever published the checkpoint. Rendered by a plain `jinja2.Environment` it reaches Python
internals (`self.__init__.__globals__.__builtins__...`) and runs anything it likes, on the driver and in every Ray
worker. Here it is compiled in jinja2's `ImmutableSandboxedEnvironment`, as transformers does, with the same
helpers real templates use: `raise_exception`, `strftime_now`, a JSON `tojson` that does not HTML-escape, the
`loopcontrols` extension, a `{% generation %}` tag, and `namespace` / `dict` that refuse underscore names
(jinja's `lipsum` is left out: random text has no place in a prompt).

The sandbox stops code execution, not resource exhaustion, so a render also has:
- a time budget (`RENDER_SECONDS`), checked at every attribute access, call, operator and output chunk;
- size caps: no string, list or mapping bigger than `MAX_VALUE_ITEMS` read, passed or built with `*`, no integer
  argument above it (`'x'.ljust(10**10)`), no huge `**`, no format width above it, and at most `MAX_OUTPUT_CHARS`
  of output.
Real templates stay far below all of these (the Qwen3.5 and Llama 3.2 ones render in about a millisecond).

Every failure is a `ChatTemplateError` whose message starts with the file the template came from.
"""

from __future__ import annotations

import json
import os
import re
import string
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 10.0  # one render of a real template takes about a millisecond
MAX_VALUE_ITEMS = 1_000_000  # characters or items in one value; also the largest integer argument or format width
MAX_OUTPUT_CHARS = 4_000_000  # rendered text (the document itself is never rendered, only a placeholder for it)
MAX_TEMPLATE_CHARS = 1_000_000  # real templates are under 20 KB
MAX_CONFIG_BYTES = 64 * 2**20  # tokenizer_config.json (large ones list 100K+ added tokens)

# Special tokens transformers passes to every template (its `special_tokens_map`), e.g. Llama's `{{ bos_token }}`.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that cannot be used: unreadable, malformed, escaping the sandbox, too costly, or failing."""


class _ResourceLimit(SecurityError):
    """A render over the time budget or a size cap (not an escape attempt, but refused the same way)."""


_deadline: ContextVar[float] = ContextVar("chat_template_deadline", default=float("inf"))


def _too_big(value: Any) -> bool:
    return isinstance(value, str | bytes | list | tuple | dict) and len(value) > MAX_VALUE_ITEMS


def _check_value(value: Any, what: str) -> Any:
    if _too_big(value):
        raise _ResourceLimit(f"{what} has {len(value):,} items, over the limit of {MAX_VALUE_ITEMS:,}")
    return value


def _check_arguments(args: tuple, kwargs: Mapping[str, Any], what: str) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_VALUE_ITEMS:
            raise _ResourceLimit(f"{what} was given the integer {value}, over the limit of {MAX_VALUE_ITEMS:,}")
        _check_value(value, f"an argument of {what}")


def _tick() -> None:
    if time.monotonic() > _deadline.get():
        raise _ResourceLimit(f"rendering took longer than {RENDER_SECONDS:g} s")


_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_format_widths(fmt: str, args: tuple) -> None:
    """'%0999999999d' % 1 and '{:>999999999}'.format(1) allocate gigabytes in one C call: refuse such widths."""
    widths = [w for m in _PERCENT_FIELD.finditer(fmt) for w in m.groups() if w]
    try:
        widths += [w for _, _, spec, _ in string.Formatter().parse(fmt) if spec for w in re.findall(r"\d+|\{", spec)]
    except ValueError:
        pass  # not a valid str.format string; the call itself will fail
    for width in widths:
        if width in ("*", "{"):  # the width comes from the arguments
            _check_arguments(args, {}, "a formatted field width")
        elif int(width) > MAX_VALUE_ITEMS:
            raise _ResourceLimit(f"a format width of {int(width):,} is over the limit of {MAX_VALUE_ITEMS:,}")


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox plus the time budget and size caps of the module docstring."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja returns an Undefined here and fails later, vaguely; a template reaching for `__globals__` or
        # `mro` is an escape attempt whatever it does next, so it is refused at once, by name
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return _check_value(super().getattr(obj, attribute), f"attribute {attribute!r}")

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return _check_value(super().getitem(obj, argument), "an item")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        name = getattr(__obj, "__name__", type(__obj).__name__)
        _check_arguments(args, kwargs, f"{name}()")
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
        if name in ("format", "format_map") and isinstance(owner, str):
            _check_format_widths(owner, (*args, *kwargs.values()))
        return _check_value(super().call(__context, __obj, *args, **kwargs), f"the result of {name}()")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_VALUE_ITEMS:
                    raise _ResourceLimit(f"repeating a value {n:,} times is over the limit of {MAX_VALUE_ITEMS:,}")
        elif operator == "**":
            if isinstance(right, int | float) and abs(right) > 1024 and isinstance(left, int | float) and abs(left) > 1:
                raise _ResourceLimit(f"the power {left!r} ** {right!r} is too large")
        elif operator == "%" and isinstance(left, str):
            _check_format_widths(left, right if isinstance(right, tuple) else (right,))
        return _check_value(super().call_binop(context, operator, left, right), f"the result of {operator!r}")


def _guarded_filter(name: str, fn: Callable) -> Callable:
    """A builtin filter with the size caps on its arguments and result (`'x'|center(10**10)`)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _check_arguments(args, kwargs, f"the {name!r} filter")
        if name == "format" and args and isinstance(args[0], str):
            _check_format_widths(args[0], args[1:])
        return _check_value(fn(*args, **kwargs), f"the result of the {name!r} filter")

    for attr in ("jinja_pass_arg",):  # keep jinja's pass_context / pass_eval_context markers
        if hasattr(fn, attr):
            setattr(guarded, attr, getattr(fn, attr))
    return guarded


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore names (as transformers does): no dunder stored on it."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_' ({name!r})")


class _Dict:
    """`dict(...)` for templates without the `dict` type object itself (its attributes lead to Python internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON, as transformers renders it
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters = {name: _guarded_filter(name, fn) for name, fn in env.filters.items()}
    env.filters["tojson"] = _guarded_filter("tojson", _tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_Dict())
    # lipsum makes random text (a prompt that changes from worker to worker) by the megabyte; no chat template
    # uses it
    del env.globals["lipsum"]
    return env


class ChatTemplate:
    """One checkpoint's chat template, compiled in the sandbox; `render` gives the prompt text for messages."""

    def __init__(self, text: str, origin: str, special_tokens: Mapping[str, str] | None = None):
        self.origin = origin  # the file the template came from, named in every error
        self.special_tokens = dict(special_tokens or {})
        if not isinstance(text, str):
            raise ChatTemplateError(f"{origin}: chat_template must be a string, got {type(text).__name__}")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"{origin}: chat_template is {len(text):,} characters, over the limit of "
                                    f"{MAX_TEMPLATE_CHARS:,}")
        try:
            self._compiled = _environment().from_string(text)
        except TemplateError as e:
            raise ChatTemplateError(f"{origin}: chat_template is not a valid jinja template: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, enable_thinking: bool | None = None) -> str:
        """The template's text for `messages`, with the variables transformers passes (documents unset);
        `enable_thinking`, when given, as `apply_chat_template(..., enable_thinking=...)` passes it."""
        variables = {**self.special_tokens, "messages": messages, "tools": tools, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        token = _deadline.set(time.monotonic() + RENDER_SECONDS)
        try:
            out, size = [], 0
            for chunk in self._compiled.generate(**variables):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise _ResourceLimit(f"the output is over the limit of {MAX_OUTPUT_CHARS:,} characters")
                _tick()
                out.append(chunk)
            return "".join(out)
        except _ResourceLimit as e:
            raise ChatTemplateError(f"{self.origin}: chat_template refused: it is too costly to render ({e})") from None
        except SecurityError as e:
            raise ChatTemplateError(
                f"{self.origin}: chat_template refused: it tries to reach Python internals outside the jinja sandbox "
                f"({e}). Nothing it asked for was run; do not use this checkpoint unless you trust its source"
            ) from None
        except TemplateError as e:  # raise_exception() and jinja's own runtime errors
            raise ChatTemplateError(f"{self.origin}: chat_template failed: {e}") from None
        except Exception as e:  # the template's own bug (1/0, 'a' + 1, recursion): still the template's failure
            raise ChatTemplateError(f"{self.origin}: chat_template failed: {type(e).__name__}: {e}") from None
        finally:
            _deadline.reset(token)


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """Special-token strings of a tokenizer_config.json (plain strings or AddedToken objects with `content`)."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _read_text(path: str) -> str:
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise ChatTemplateError(f"{path}: {size:,} bytes, over the limit of {MAX_CONFIG_BYTES:,}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read it: {e}") from None


def load_chat_template(folder: str) -> ChatTemplate | None:
    """The chat template of a checkpoint folder, or None when it has none.

    chat_template.jinja wins over tokenizer_config.json's `chat_template` (as in transformers); a list of named
    templates uses the one named "default". Special tokens always come from tokenizer_config.json.
    """
    config_path = os.path.join(folder, "tokenizer_config.json")
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        try:
            config = json.loads(_read_text(config_path))
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{config_path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{config_path}: must hold a JSON object")
    special = _special_tokens(config)
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        return ChatTemplate(_read_text(jinja_path), jinja_path, special)
    text = config.get("chat_template")
    if isinstance(text, list):  # transformers allows a list of named templates
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if text is None:
        return None
    return ChatTemplate(text, config_path, special)
