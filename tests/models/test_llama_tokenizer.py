"""Our GGUF-built tokenizer against transformers' tokenizer from the same GGUF file."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.model  # needs the embedded SmolLM2 GGUF

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello  world   with    many     spaces",
    "   leading and trailing spaces   ",
    "line one\nline two\n\n\nline five\r\nwindows\ttab\t\tdouble tab",
    "Digits: 0 1 12 123 1234 12345 3.14159 1,000,000 2024-06-01  42  7",
    "Unicode: café naïve résumé Ünïcödé — “quotes” ‘single’ … ½ ² ∑ ∞ Ω",
    "中文字符和日本語のテキスト、한국어 텍스트",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<|endoftext|>text after<|im_end|><|im_start|>",
    "I'm sure they'll say it's what we've done; you'd agree, wouldn't you?",
    "https://example.com/path?query=1&x=2 user@example.org #hashtag @mention",
    "",
    " ",
    "\n",
    "a" * 300,
]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_hf(tok, hf_tokenizer, text):
    ref = hf_tokenizer(text)["input_ids"]
    assert tok.encode(text) == ref


@pytest.mark.parametrize("text", TEXTS)
def test_decode_roundtrip_and_equals_hf(tok, hf_tokenizer, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tokenizer.decode(ids)


def test_special_tokens_are_single_ids(tok):
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tok.encode(name)
        assert len(ids) == 1 and ids == [tok.token_to_id(name)]
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.eos_id == 2 and tok.bos_id == 1
    assert {0, 2} <= tok.stop_ids
    assert tok.vocab_size == 49152


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? Explain 😀\nin two lines."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_equals_hf(tok, hf_tokenizer, messages, gen):
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert ours == ref
    assert tok.encode(ours) == hf_tokenizer(ref)["input_ids"]


def test_chat_template_shape(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
