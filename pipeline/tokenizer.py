"""Tokenizers and prompts: the only place text becomes token ids.

- `build_byte_tokenizer()`: a byte-level tokenizer built with the `tokenizers` library. Ids 0..255 are the 256
  bytes (GPT-2 ByteLevel alphabet, no merges), then four special tokens: 256 `<|endoftext|>` (eos and pad),
  257 `<|im_start|>`, 258 `<|im_end|>` (also eos), 259 `<|mask|>`. The presets use it; `model init` writes it
  as tokenizer.json into checkpoint folders.
- `load_tokenizer(source)`: tokenizer.json of a checkpoint folder, or the byte tokenizer for a preset name.
- `PromptBuilder`: the checkpoint's chat template (tokenizer_config.json `chat_template`, rendered with jinja2)
  or a plain Qwen-style template. The document is encoded with special-token matching switched off, so text such
  as "<|im_end|>" inside a document can never close the turn early (no prompt injection through the document).
"""

from __future__ import annotations

import functools
import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

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


def load_chat_template(source: str) -> str | None:
    """The jinja chat template of a checkpoint folder (tokenizer_config.json), or None."""
    path = os.path.join(source, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # HF allows a list of named templates
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


class PromptBuilder:
    """Turns (instruction, document text) into prompt token ids for one model source."""

    def __init__(self, source: str):
        self.tokenizer = load_tokenizer(source)
        template = load_chat_template(source)
        if template is None:
            self._template = lambda content: PLAIN_TEMPLATE.format(content=content)
        else:
            import jinja2  # only checkpoints with a chat template need it

            compiled = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
            self._template = lambda content: compiled.render(messages=[{"role": "user", "content": content}],
                                                             add_generation_prompt=True)

    def _render(self, content: str) -> tuple[str, str]:
        """The template around one user message `content`, split where the sentinel stands in it."""
        before, _, after = self._template(content).partition(_DOC_SENTINEL)
        return before, after

    def encode(self, text: str, *, specials: bool) -> list[int]:
        self.tokenizer.encode_special_tokens = not specials
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = False

    def _wrap(self, content: str, text: str) -> list[int]:
        before, after = self._render(content)
        middle = self.encode(text, specials=False)
        return self.encode(before, specials=True) + middle + self.encode(after, specials=True)

    def build(self, instruction: str, document: str) -> list[int]:
        """Prompt ids for one document: the instruction, a blank line, the document, as one user message."""
        return self._wrap(f"{instruction}\n\n{_DOC_SENTINEL}", document)

    def chat(self, text: str) -> list[int]:
        """Prompt ids for `text` as the whole user message (special-token text in it stays plain text)."""
        return self._wrap(_DOC_SENTINEL, text)

    def decode(self, ids: list[int]) -> str:
        known = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return self.tokenizer.decode([i for i in ids if i < known], skip_special_tokens=True)
