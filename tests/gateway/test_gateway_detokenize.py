"""Incremental detokenization with the default model's real tokenizer, and stop-string matching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flow.detokenize import IncrementalDetokenizer, StopMatcher, token_byte_table
from worker.text.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "héllo 🎉 party 👩‍👩‍👧‍👦 family",
    "日本語のテキストとテスト、中文字符和한국어 문장",
    "math: ∑ x² ≤ ∞ — done…",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def table(tok):
    return token_byte_table(tok.hf, tok.vocab_size)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tok, table, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(table)
    pieces = [detok.feed([i]) for i in ids] + [detok.flush()]
    joined = "".join(pieces)
    assert "\ufffd" not in joined
    assert joined == tok.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_really_are_split_across_tokens(tok, table):
    # Guards the test above: at least one token must hold an incomplete UTF-8 sequence.
    ids = tok.encode(TEXTS[1] + TEXTS[2], add_special_tokens=False)
    partial = 0
    for i in ids:
        try:
            table[i].decode("utf-8")
        except UnicodeDecodeError:
            partial += 1
    assert partial > 0


def test_special_tokens_produce_no_text(tok, table):
    assert table[tok.eos_token_id] == b""


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stop_string_split_across_chunks_is_never_emitted(chunk):
    text = "The answer is 42.\nUser: next question"
    matcher = StopMatcher(["\nUser:", "STOP"])
    out = []
    for i in range(0, len(text), chunk):
        out.append(matcher.feed(text[i:i + chunk]))
        if matcher.stopped:
            break
    assert matcher.stopped
    assert "".join(out) == "The answer is 42."


def test_no_stop_returns_everything_after_flush():
    matcher = StopMatcher(["###"])
    out = matcher.feed("ab#") + matcher.feed("c#") + matcher.flush()
    assert out == "ab#c#"
    assert not matcher.stopped


def test_first_completed_stop_wins():
    matcher = StopMatcher(["world", "lo"])
    assert matcher.feed("hello world") == "hel"
    assert matcher.stopped
    matcher = StopMatcher(["c", "aca"])  # "c" completes before "aca" does
    assert matcher.feed("aca") == "a"
    assert matcher.stopped
    assert matcher.feed("more") == "" and matcher.flush() == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc#\n", max_size=40), stops=st.lists(st.text(alphabet="abc#", min_size=1,
       max_size=4), min_size=1, max_size=4), cuts=st.lists(st.integers(1, 5), min_size=1, max_size=20))
def test_stop_matcher_equals_cutting_the_whole_text(text, stops, cuts):
    # reference: feed one character at a time, stop as soon as the text contains a stop string
    first = -1
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            first = min(starts)
            break
    expected = text if first < 0 else text[:first]
    matcher = StopMatcher(stops)
    out, pos, k = [], 0, 0
    while pos < len(text) and not matcher.stopped:
        step = cuts[k % len(cuts)]
        out.append(matcher.feed(text[pos:pos + step]))
        pos += step
        k += 1
    out.append(matcher.flush())
    assert "".join(out) == expected
    assert matcher.stopped == (first >= 0)
