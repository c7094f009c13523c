"""Chat templates are untrusted: rendered in the jinja2 sandbox, exactly as transformers renders real ones, and
every escape or exhaustion attempt refused with one error naming the file the template came from."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jinja2
import pytest
from clover_batch.pipeline import chat_template as ct
from clover_batch.pipeline.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from clover_batch.pipeline.tokenizer import PromptBuilder, build_byte_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
REAL = {
    "qwen3.5": ("qwen3.5-35b-a3b.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3.2": ("llama-3.2-3b-instruct.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & 'later' in é",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Summarize.\n\nThe lease <b>é</b> ends in May."}],
    "system+user": [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "hi"}],
    "multi-turn": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\na1"},
                   {"role": "user", "content": "q2"}],
    "tool-call": [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "sunny"}],
}  # fmt: skip


def _checkpoint(folder: Path, template: str, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **config}))
    return folder


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("family", REAL)
def test_real_templates_render_exactly_as_transformers(family, tools, conversation):
    from transformers.utils.chat_template_utils import render_jinja_template

    file, special = REAL[family]
    text = (FIXTURES / file).read_text()
    template = ChatTemplate(text, file, special)
    messages = CONVERSATIONS[conversation]
    for add_generation_prompt in (True, False):
        (expected,), _ = render_jinja_template([messages], tools=tools, chat_template=text,
                                               add_generation_prompt=add_generation_prompt, **special)
        assert template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt) == expected


def test_real_template_raise_exception_is_a_chat_template_error():
    text = (FIXTURES / "qwen3.5-35b-a3b.jinja").read_text()
    with pytest.raises(ChatTemplateError, match=r"^qwen\.jinja: chat_template failed: No messages provided\.$"):
        ChatTemplate(text, "qwen.jinja").render([])


@pytest.mark.parametrize("thinking", [False, True], ids=["no-thinking", "thinking"])
def test_qwen_family_prompt_ids_match_transformers_render(tmp_path, thinking):
    """The Qwen3.5/3.6 family template thinks unless told not to: jobs render it with enable_thinking false (the
    empty think block prefilled), or true when the job's model.enable_thinking says so, as transformers does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    text = (FIXTURES / "qwen3.5-35b-a3b.jinja").read_text()
    folder = str(_checkpoint(tmp_path / "ckpt", text, eos_token="<|im_end|>"))
    builder = PromptBuilder(folder, enable_thinking=thinking)
    document = "Rent is 100 EUR.\nNotice: 30 days."
    (rendered,), _ = render_jinja_template([[{"role": "user", "content": f"Summarize.\n\n{document}"}]],
                                           chat_template=text, add_generation_prompt=True, eos_token="<|im_end|>",
                                           enable_thinking=thinking)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n" if thinking
                             else "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert builder.build("Summarize.", document) == builder.encode(rendered, specials=True)
    assert PromptBuilder(folder).enable_thinking is False  # the default of jobs and `generate`


QWEN_STYLE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", [QWEN_STYLE, "{%- for m in messages %}\n  <|im_start|>{{ m.role }}\n"
                                      "  {{ m.content }}<|im_end|>\n{% endfor %}\n<|im_start|>assistant\n"])
def test_ordinary_template_renders_exactly_as_before(tmp_path, template):
    """'Before' is the old code: a plain jinja2.Environment(trim_blocks, lstrip_blocks) over the whole message."""
    builder = PromptBuilder(str(_checkpoint(tmp_path / "ckpt", template)))
    before = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    for instruction, document in [("Summarize.", "A short memo."), ("Extract: a, b", "Line 1\n\nLine 2 é €")]:
        old = before.render(messages=[{"role": "user", "content": f"{instruction}\n\n{document}"}],
                            add_generation_prompt=True)
        assert builder.build(instruction, document) == builder.encode(old, specials=True)
    old = before.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert builder.chat("hi") == builder.encode(old, specials=True)


def _escape_templates(marker: Path) -> dict[str, str]:
    """The issue's payload and two other well-known jinja2 sandbox escapes, each trying to create `marker`."""
    touch = f"touch {marker}"
    return {
        # the issue's: the template's own `self` reaches the module globals and __import__
        "self-globals": f"{{{{ self.__init__.__globals__.__builtins__.__import__('os').system('{touch}') }}}}"
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        # the classic subclass walk, through the |attr filter, to os._wrap_close and its module's system()
        "subclasses-via-attr": "{% for c in ()|attr('__class__')|attr('__base__')|attr('__subclasses__')() %}"
                               "{% if c.__name__ == '_wrap_close' %}"
                               f"{{{{ c.__init__.__globals__['system']('{touch}') }}}}"
                               "{% endif %}{% endfor %}{{ messages[0].content }}",
        # jinja's own globals (cycler) lead to the os module
        "cycler-globals": f"{{{{ cycler.__init__.__globals__.os.system('{touch}') }}}}{{{{ messages[0].content }}}}",
    }


@pytest.mark.parametrize("form", ["self-globals", "subclasses-via-attr", "cycler-globals"])
def test_sandbox_escapes_are_refused_naming_the_file_and_run_nothing(tmp_path, form):
    marker = tmp_path / "pwned"
    template = _escape_templates(marker)[form]
    # the payload is real: the old plain Environment runs it
    jinja2.Environment().from_string(template).render(messages=[{"role": "user", "content": "x"}])
    assert marker.exists()
    marker.unlink()

    folder = _checkpoint(tmp_path / "ckpt", template)
    builder = PromptBuilder(str(folder))  # compiling is harmless; rendering is where code would run
    with pytest.raises(ChatTemplateError) as err:
        builder.build("Summarize.", "doc")
    message = str(err.value)
    assert message.startswith(f"{folder}/tokenizer_config.json: chat_template refused: it tries to reach Python "
                              "internals outside the jinja sandbox")
    assert "\n" not in message
    assert not marker.exists()


@pytest.mark.parametrize("template", [
    "{{ '{0.__init__.__globals__}'.format(cycler) }}",  # str.format reaching attributes (CVE-2016-10745 family)
    "{{ ('{0.__init__.__globals__}'|attr('format'))(cycler) }}",  # format taken through |attr (CVE-2025-27516)
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",  # a dunder stored on a namespace
    "{{ messages.append(1) }}",  # mutating the caller's data (the immutable sandbox)
], ids=["str-format", "attr-format", "namespace-dunder", "mutation"])
def test_other_sandbox_probes_are_refused(template):
    with pytest.raises(ChatTemplateError, match="outside the jinja sandbox"):
        ChatTemplate(template + "{{ messages[0].content }}", "t.json").render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template", [
    "{{ 'x' * 1000000000 }}",
    "{{ 'x'.ljust(10000000000) }}",
    "{{ 'x'|center(10000000000) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 2 ** 100000000 }}",
    "{% set ns = namespace(s='xxxxxxxxxx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
], ids=["repeat", "ljust", "center-filter", "percent-width", "format-width", "power", "doubling", "output"])
def test_resource_exhaustion_is_refused_quickly(template):
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=r"^t\.json: chat_template refused: it is too costly to render"):
        ChatTemplate(template, "t.json").render([{"role": "user", "content": "x"}])
    assert time.perf_counter() - start < 5


def test_render_time_budget(monkeypatch):
    monkeypatch.setattr(ct, "RENDER_SECONDS", 0.2)
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages }}"
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=r"rendering took longer than 0\.2 s"):
        ChatTemplate(slow, "t.json").render([{"role": "user", "content": "x"}])
    assert time.perf_counter() - start < 3


@pytest.mark.parametrize(("template", "problem"), [
    ("{{ messages[0].content }}{{ messages[0].content }}", "appears 2 times"),
    ("<|im_start|>assistant\n", "appears 0 times"),
])
def test_template_must_place_the_message_exactly_once(tmp_path, template, problem):
    folder = _checkpoint(tmp_path / "ckpt", template)
    with pytest.raises(ChatTemplateError, match=f"tokenizer_config.json: .*exactly once \\(it {problem}\\)"):
        PromptBuilder(str(folder)).check("Summarize.")


def test_template_helpers_and_extensions():
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|{{ {'a': '<é>'}|tojson }}|"
                "{{ dict(b=1)|tojson }}|{{ strftime_now('%Y') }}|{{ bos_token }}")
    out = ChatTemplate(template, "t", {"bos_token": "<s>"}).render([{"role": "user", "content": "one"},
                                                                      {"role": "user", "content": "two"}])
    assert out == f'one|{{"a": "<é>"}}|{{"b": 1}}|{time.strftime("%Y")}|<s>'


def test_loading_rules_and_file_errors(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    assert load_chat_template(str(folder)) is None
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "pad_token": None}))
    loaded = load_chat_template(str(folder))
    assert (loaded.render([]), loaded.origin, loaded.special_tokens) == (
        "D", f"{folder}/tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>"})
    (folder / "chat_template.jinja").write_text("J{{ bos_token }}")  # the separate file wins, as in transformers
    loaded = load_chat_template(str(folder))
    assert (loaded.render([]), loaded.origin) == ("J<s>", f"{folder}/chat_template.jinja")
    (folder / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: chat_template is not a valid jinja template"):
        load_chat_template(str(folder))
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json: not valid JSON"):
        load_chat_template(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 42}))
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json: chat_template must be a string, got int"):
        load_chat_template(str(folder))
