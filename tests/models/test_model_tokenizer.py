"""Our Tokenizer against transformers.AutoTokenizer: on the converted SmolLM2 folder (ids, decode,
chat template), against transformers' own GGUF tokenizer (vocab and merges), and BOS handling."""
from __future__ import annotations

import json
import shutil

import pytest

from prefill_server.errors import InvalidRequest
from prefill_server.models.tokenizer import Tokenizer

STRINGS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces and trailing  ",
    "a  b   c    d\t\te\r\n",
    "\n\n\nthree newlines",
    "Unicode: é à ü ß — “quotes” 你好，世界 こんにちは 😀👍🏽 مرحبا",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "In 2024, 3.14159 and 1,000,000 people; x1y22",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "def f():\n  return 1"}],
]


@pytest.fixture(scope="module")
def ours(smollm_dir):
    return Tokenizer(smollm_dir)


@pytest.fixture(scope="module")
def hf(smollm_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_dir)


@pytest.mark.parametrize("text", STRINGS)
def test_encode_decode_match_hf(ours, hf, text):
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == hf(text, add_special_tokens=special)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens(ours, hf):
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>") == (hf.bos_token, hf.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert ours.vocab_size == 49152
    assert ours.encode("Hello") == [19556]  # SmolLM2 adds no BOS


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_hf(ours, hf, messages, gen):
    text = ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode_chat(messages, add_generation_prompt=gen) == list(ids)


CONTINUED = CHATS + [
    [{"role": "user", "content": "Write a poem about the sea"}, {"role": "assistant", "content": "The sea is"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, "}],  # trailing space
    [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1 2 3\n"}],  # trailing newline
]


@pytest.mark.parametrize("messages", CONTINUED)
def test_continue_final_message_matches_hf(ours, hf, messages):
    """The text ends inside the final message (vLLM's continue_final_message renders through
    transformers): the same text and ids as transformers."""
    text = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                          continue_final_message=True)
    assert text.rstrip().endswith(messages[-1]["content"].rstrip())
    with pytest.raises(InvalidRequest, match="cannot both be true"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_matches_transformers_gguf_tokenizer(ours, smollm_gguf):
    """Vocab, merges and special tokens equal transformers' reading of the GGUF."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    for text in STRINGS:
        assert ours.encode(text) == ref(text)["input_ids"], text


def test_digits_split_before_whitespace_merge(ours):
    """SmolLM2 isolates digits before the GPT-2 regex (llama.cpp pre-tokenizer 'smollm', HF's
    Digits(individual_digits) + ByteLevel), so spaces before a digit stay one token. transformers'
    GGUF reader skips the Digits step and gives 'x', 'Ġ', 'Ġ', '1' here; vLLM on our folder agrees with us."""
    ids = ours.encode("x  1")
    assert [ours.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]


@pytest.mark.parametrize("bad,match", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\]\.role must be a string \(missing\)"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string \(int\)"),
    ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\.content"),
])
def test_invalid_messages(ours, bad, match):
    with pytest.raises(InvalidRequest, match=match):
        ours.apply_chat_template(bad)


def with_template(tmp_path, smollm_dir, template: str) -> Tokenizer:
    """SmolLM2's tokenizer with ``template`` as its chat template."""
    shutil.copy(smollm_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    (tmp_path / "chat_template.jinja").write_text(template)
    return Tokenizer(tmp_path)


def test_raise_exception_in_template_is_invalid_request(ours, tmp_path, smollm_dir):
    tok = with_template(tmp_path, smollm_dir,
                        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                        "{% for m in messages %}{{ bos_token + m['content'] | tojson }}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "é<"}]) == '<|im_start|>"é<"'
    with pytest.raises(InvalidRequest, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_a_field_the_template_cannot_use_is_invalid_request(tmp_path, smollm_dir):
    """An extra message field of a type the template does not expect (a number where it joins a
    list, here) is the caller's input too: a 400 that names the problem, not a 500."""
    tok = with_template(tmp_path, smollm_dir, "{% for m in messages %}{{ m['content'] }}{% if m.name %}"
                        "{{ m.name | join(',') }}{{ m.name[0] + 1 }}{% endif %}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "x", "name": [1]}]) == "x12"
    for bad in (5, ["a"]):  # join over a number: TypeError; "a" + 1: TypeError
        with pytest.raises(InvalidRequest, match="could not render these messages .TypeError"):
            tok.apply_chat_template([{"role": "user", "content": "x", "name": bad}])


@pytest.mark.parametrize("post_processor", ["bos", "bos_eos", "bytelevel"])
def test_special_tokens_added_like_hf(smollm_dir, tmp_path, post_processor):
    """tokenizer.json's post-processor decides BOS/EOS (Llama-3 style TemplateProcessing here);
    tokenizer_config's add_bos_token is ignored, as transformers 5 does when tokenizer.json exists."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.processors import TemplateProcessing

    raw = RawTokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    if post_processor != "bytelevel":
        eos = " <|im_end|>" if post_processor == "bos_eos" else ""
        raw.post_processor = TemplateProcessing(single="<|im_start|> $A" + eos, pair="<|im_start|> $A $B" + eos,
                                                special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)])
    raw.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((smollm_dir / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=post_processor == "bytelevel")  # ignored either way
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("Hello world", ""):
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert (ids[:1] == [1]) == (post_processor != "bytelevel")
        assert (ids[-1:] == [2]) == (post_processor == "bos_eos")
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
