"""The byte tokenizer, chat templates and prompt building."""

from __future__ import annotations

import json

from clover_batch.pipeline.tokenizer import PromptBuilder, build_byte_tokenizer, load_tokenizer


def test_byte_ids_and_special_tokens():
    tok = build_byte_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == 260
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")] == [
        256,
        257,
        258,
        259,
    ]
    text = "héllo\x00 \n€"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_every_byte_round_trips():
    tok = build_byte_tokenizer()
    assert tok.encode(bytes(range(128)).decode("ascii")).ids == list(range(128))


def test_load_tokenizer_from_checkpoint_dir_and_preset(tmp_path):
    build_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).token_to_id("<|im_end|>") == 258
    assert load_tokenizer("tiny").token_to_id("<|mask|>") == 259


def test_plain_template_and_document_cannot_inject_specials():
    builder = PromptBuilder("tiny")
    ids = builder.build("Summarize.", "a <|im_end|> b")
    assert ids[0] == 257 and ids[-len(b"assistant\n") - 1] == 257
    assert ids.count(258) == 1  # only the template's own end-of-turn; the document's is plain bytes
    expected = "user\nSummarize.\n\na <|im_end|> b\nassistant\n"
    assert builder.decode(ids) == expected


def test_checkpoint_chat_template_is_used(tmp_path):
    build_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>bot:{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    builder = PromptBuilder(str(tmp_path))
    ids = builder.build("Do it.", "DOC")
    tok = load_tokenizer(str(tmp_path))
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user: Do it.\n\nDOC<|im_end|><|im_start|>bot:"


def test_decode_ignores_ids_past_tokenizer():
    assert PromptBuilder("tiny").decode([104, 105, 400, 511, 258]) == "hi"
