"""Tokenizers and prompts: the only place text becomes token ids.

- `build_byte_tokenizer()`: a byte-level tokenizer built with the `tokenizers` library. Ids 0..255 are the 256
  bytes (GPT-2 ByteLevel alphabet, no merges), then four special tokens: 256 `<|endoftext|>` (eos and pad),
  257 `<|im_start|>`, 258 `<|im_end|>` (also eos), 259 `<|mask|>`. The presets use it; `model init` writes it
  as tokenizer.json into checkpoint folders.
- `load_tokenizer(source)`: tokenizer.json of a checkpoint folder, or the byte tokenizer for a preset name.
- `PromptBuilder`: the checkpoint's chat template (tokenizer_config.json `chat_template` or chat_template.jinja,
  rendered in the jinja2 sandbox of pipeline/chat_template.py) or a plain Qwen-style template. The document is
  encoded with special-token matching switched off, so text such as "<|im_end|>" inside a document can never
  close the turn early (no prompt injection through the document).
"""

from __future__ import annotations

import functools
import os

from clover_batch.pipeline.chat_template import ChatTemplateError, load_chat_template
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["ChatTemplateError", "PromptBuilder", "build_byte_tokenizer", "load_chat_template", "load_tokenizer"]

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)  # ids 256, 257, 258, 259 in the byte tokenizer

PLAIN_TEMPLATE = "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
_DOC_SENTINEL = "\x00CLOVER_DOCUMENT\x00"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer() -> Tokenizer:
    """The byte-level tokenizer of the presets: id b is byte b, then the special tokens from id 256."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


@functools.lru_cache(maxsize=8)
def load_tokenizer(source: str) -> Tokenizer:
    """tokenizer.json from a checkpoint folder; the byte tokenizer for a preset (any source without one)."""
    path = os.path.join(source, "tokenizer.json")
    if os.path.isdir(source):
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint folder {source} has no tokenizer.json")
        return Tokenizer.from_file(path)
    return build_byte_tokenizer()


class PromptBuilder:
    """Turns (instruction, document text) into prompt token ids for one model source.

    The template is rendered around a placeholder, once per instruction (cached): the document itself never goes
    through jinja, so its length cannot slow the render, and its text is encoded with special-token matching off.
    """

    def __init__(self, source: str, *, enable_thinking: bool = False):
        self.enable_thinking = enable_thinking  # passed to the template (Qwen3.6-family templates think by default)
        self.tokenizer = load_tokenizer(source)
        self.template = load_chat_template(source) if os.path.isdir(source) else None
        self._scaffolds: dict[str, tuple[list[int], list[int]]] = {}

    def _render(self, content: str) -> str:
        if self.template is None:
            return PLAIN_TEMPLATE.format(content=content)
        return self.template.render([{"role": "user", "content": content}], add_generation_prompt=True,
                                    enable_thinking=self.enable_thinking)

    def _scaffold(self, content: str) -> tuple[list[int], list[int]]:
        """Token ids before and after the placeholder in the template's text for one user message `content`."""
        if content not in self._scaffolds:
            rendered = self._render(content)
            if rendered.count(_DOC_SENTINEL) != 1:
                origin = self.template.origin if self.template else "the plain template"
                raise ChatTemplateError(f"{origin}: the chat template must place the user message in the prompt "
                                        f"exactly once (it appears {rendered.count(_DOC_SENTINEL)} times)")
            before, _, after = rendered.partition(_DOC_SENTINEL)
            self._scaffolds[content] = (self.encode(before, specials=True), self.encode(after, specials=True))
        return self._scaffolds[content]

    def encode(self, text: str, *, specials: bool) -> list[int]:
        self.tokenizer.encode_special_tokens = not specials
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = False

    def _wrap(self, content: str, text: str) -> list[int]:
        before, after = self._scaffold(content)
        return before + self.encode(text, specials=False) + after

    def build(self, instruction: str, document: str) -> list[int]:
        """Prompt ids for one document: the instruction, a blank line, the document, as one user message."""
        return self._wrap(f"{instruction}\n\n{_DOC_SENTINEL}", document)

    def document_span(self, instruction: str, prompt_tokens: int) -> tuple[int, int]:
        """Where the document lies, [start, end), in a prompt of `build(instruction, ...)` of this length."""
        before, after = self._scaffold(f"{instruction}\n\n{_DOC_SENTINEL}")
        return len(before), prompt_tokens - len(after)

    def check(self, instruction: str) -> None:
        """Render the template for `instruction` now (raises ChatTemplateError): the driver's check before a run."""
        self._scaffold(f"{instruction}\n\n{_DOC_SENTINEL}")

    def chat(self, text: str) -> list[int]:
        """Prompt ids for `text` as the whole user message (special-token text in it stays plain text)."""
        return self._wrap(_DOC_SENTINEL, text)

    def decode(self, ids: list[int]) -> str:
        known = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return self.tokenizer.decode([i for i in ids if i < known], skip_special_tokens=True)
