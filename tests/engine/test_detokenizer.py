"""Streaming detokenisation: deltas never carry a broken character, and add up to the full decode."""

from __future__ import annotations

import numpy as np
import pytest

from model.training.tokenizer import train_bpe
from service.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, TextStream
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.runtime.tokenizer import Tokenizer
from tests.engine.harness import drive, random_prompt

UNICODE_TEXTS = [
    "héllo wörld 你好世界 😀🎉 日本語",
    "naïve café — déjà vu 😀😀 你好 🎉🎉🎉",
    "日本語のテキスト、中文文本 and ascii 🇬🇧 👩‍👩‍👧‍👦",
    "Ünïcödé ñ ß ø å 世界 world 😀 hello 🎉 語",
] * 6


@pytest.fixture(scope="module")
def unicode_tokenizer() -> Tokenizer:
    return Tokenizer(train_bpe(UNICODE_TEXTS, vocab_size=275, min_frequency=1))


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The deltas of feeding `ids` one at a time, the flush last."""
    s = TextStream(tokenizer)
    deltas = [s.push(t)[0] for t in ids]
    deltas.append(s.finish()[0])
    return deltas


def check_stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    full = tokenizer.decode(ids, skip_special_tokens=True)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == full, ids
    sent = ""
    for k, d in enumerate(deltas):
        # a delta is the next stretch of the full text, so a U+FFFD in it is one the full decode has
        # there too: never a fragment of a character that later tokens complete
        assert full.startswith(sent + d)
        for j, ch in enumerate(d):
            if ch == REPLACEMENT:
                assert full[len(sent) + j] == REPLACEMENT
        if k < len(ids):
            # and what is sent after k + 1 tokens is already settled by them
            assert tokenizer.decode(ids[:k + 1], skip_special_tokens=True).startswith(sent + d)
        sent += d
    return deltas


def test_emoji_and_cjk_are_split_across_tokens(unicode_tokenizer):
    """The premise: byte-level BPE cuts multi-byte characters, so a token alone decodes broken."""
    ids = unicode_tokenizer.encode(UNICODE_TEXTS[0])
    alone = [unicode_tokenizer.decode([t]) for t in ids]
    assert any(REPLACEMENT in a for a in alone)


@pytest.mark.parametrize("text", UNICODE_TEXTS[:4] + ["😀", "a😀b", "你", "🇬🇧🇬🇧", "\x00\x7f é\u0301"])
def test_unicode_stream_equals_decode_and_has_no_broken_fragments(unicode_tokenizer, tiny_tokenizer, text):
    for tok in (unicode_tokenizer, tiny_tokenizer):
        ids = tok.encode(text)
        deltas = check_stream(tok, ids)
        assert REPLACEMENT not in "".join(deltas)


def test_ascii_text_is_not_held_back(tiny_tokenizer):
    ids = tiny_tokenizer.encode("But soft, what light through yonder window breaks?")
    deltas = stream(tiny_tokenizer, ids)
    assert deltas[:-1] == [tiny_tokenizer.decode([t]) for t in ids] and deltas[-1] == ""


def test_a_character_is_sent_with_the_token_that_completes_it(unicode_tokenizer):
    text = "a😀b你c"
    ids = unicode_tokenizer.encode(text)
    deltas = stream(unicode_tokenizer, ids)
    for k in range(len(ids)):
        prefix = unicode_tokenizer.decode(ids[:k + 1])
        complete = prefix.rstrip(REPLACEMENT)
        assert "".join(deltas[:k + 1]) == complete, (k, prefix)


def test_special_tokens_are_skipped(tiny_tokenizer):
    eos = tiny_tokenizer.eos_id
    ids = tiny_tokenizer.encode("To be") + [eos] + tiny_tokenizer.encode(", or not") + [eos, eos]
    assert "".join(check_stream(tiny_tokenizer, ids)) == "To be, or not"


@pytest.mark.parametrize("which", ["tiny", "unicode"])
def test_random_id_sequences(tiny_tokenizer, unicode_tokenizer, which):
    tok = tiny_tokenizer if which == "tiny" else unicode_tokenizer
    rng = np.random.default_rng(0 if which == "tiny" else 1)
    broken = 0
    for _ in range(200):
        ids = rng.integers(0, tok.vocab_size, int(rng.integers(1, 40))).tolist()
        check_stream(tok, ids)
        broken += REPLACEMENT in tok.decode(ids, skip_special_tokens=True)
    assert broken > 50  # random byte tokens do make invalid UTF-8: the hard cases were exercised


def test_random_multibyte_fragments(unicode_tokenizer):
    """Sequences built from the tokens of multi-byte characters, in random orders and cuts."""
    pieces = [unicode_tokenizer.encode(c) for c in "你好世界😀🎉日本語éöß"]
    flat = sorted({t for p in pieces for t in p})
    rng = np.random.default_rng(2)
    for _ in range(200):
        if rng.random() < 0.5:
            ids = [t for i in rng.integers(0, len(pieces), 8) for t in pieces[i]]
            cut = int(rng.integers(0, len(ids)))
            ids = ids[cut:] if rng.random() < 0.5 else ids[:cut + 1]
        else:
            ids = rng.choice(flat, int(rng.integers(1, 20))).tolist()
        check_stream(unicode_tokenizer, ids)


@pytest.mark.parametrize("which", ["tiny", "unicode"])
def test_incremental_detokenizer_on_random_ids(tiny_tokenizer, unicode_tokenizer, which):
    """The window detokenizer (the path for tokenizers that are not byte-level) on its own."""
    tok = tiny_tokenizer if which == "tiny" else unicode_tokenizer
    rng = np.random.default_rng(5)
    for _ in range(200):
        ids = rng.integers(0, tok.vocab_size, int(rng.integers(1, 30))).tolist()
        d = IncrementalDetokenizer(tok)
        sent = ""
        for k, t in enumerate(ids):
            sent += d.add(t)
            assert tok.decode(ids[:k + 1], skip_special_tokens=True).startswith(sent)
        assert sent + d.flush() == tok.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_flush_gives_the_rest(unicode_tokenizer):
    ids = unicode_tokenizer.encode("x😀")
    d = IncrementalDetokenizer(unicode_tokenizer)
    out = "".join(d.add(t) for t in ids[:-1])
    assert REPLACEMENT not in out
    assert out + d.flush() == unicode_tokenizer.decode(ids[:-1])  # the broken tail, as U+FFFD
    assert d.flush() == ""


# ---- TextStream with stop strings ----------------------------------------------------------------

def stop_stream(tokenizer, ids, stop):
    s = TextStream(tokenizer, stop)
    deltas = []
    for t in ids:
        d, hit = s.push(t)
        deltas.append(d)
        if hit:
            return deltas, True
    d, hit = s.finish()
    return deltas + [d], hit


@pytest.mark.parametrize("stop", ["世界", "😀🎉", "wörld 你", "o w", "界 😀"])
def test_stop_strings_made_of_split_characters(unicode_tokenizer, stop):
    text = UNICODE_TEXTS[0]
    ids = unicode_tokenizer.encode(text)
    deltas, hit = stop_stream(unicode_tokenizer, ids, [stop])
    assert hit
    assert "".join(deltas) == text[:text.find(stop)]
    sent = ""
    for d in deltas:
        sent += d
        assert text[:text.find(stop)].startswith(sent)


def test_random_stop_strings_against_a_plain_search(tiny_tokenizer):
    """TextStream's output equals: after each token, decode everything so far and, once any stop
    string appears, cut at the earliest one (a stop string that would start earlier but completes
    later never completes: generation has ended)."""
    rng = np.random.default_rng(3)
    texts = ["But soft, what light through yonder window breaks? It is the east",
             "To be, or not to be, that is the question: whether 'tis nobler",
             "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace"]
    for _ in range(200):
        text = texts[int(rng.integers(0, 3))]
        ids = tiny_tokenizer.encode(text)
        stops = []
        for _ in range(int(rng.integers(1, 4))):
            a = int(rng.integers(0, len(text) - 1))
            stops.append(text[a:a + int(rng.integers(1, 6))] if rng.random() < 0.7 else "zq" + text[a])
        deltas, hit = stop_stream(tiny_tokenizer, ids, stops)
        want, found = text, False
        for k in range(len(ids)):
            so_far = tiny_tokenizer.decode(ids[:k + 1])
            cuts = [so_far.find(s) for s in stops if s in so_far]
            if cuts:
                want, found = so_far[:min(cuts)], True
                assert len(deltas) == k + 1  # it ends with the token that completes the stop string
                break
        assert "".join(deltas) == want, stops
        assert hit == found


# ---- through the engine --------------------------------------------------------------------------

def test_engine_event_texts_add_up_to_the_decoded_tokens(make_engine):
    """A random-weight model sampled at high temperature emits effectively random ids, many of them
    single bytes of multi-byte characters: the event texts still add up to decode(all ids)."""
    engine = make_engine(max_running=8, max_batch_tokens=64)
    rng = np.random.default_rng(4)
    reqs = [GenerationRequest(f"r{i}", random_prompt(rng, 5), SamplingParams(temperature=3.0, seed=i),
                              StoppingCriteria(max_new_tokens=100, ignore_eos=True)) for i in range(8)]
    run = drive(engine, reqs)
    tok = engine.tokenizer
    broken = 0
    for r in reqs:
        ids = run.tokens(r.request_id)
        full = tok.decode(ids, skip_special_tokens=True)
        assert run.text(r.request_id) == full
        sent = ""
        for e in run.events[(r.request_id, 0)]:
            for j, ch in enumerate(e.text):
                if ch == REPLACEMENT:
                    assert full[len(sent) + j] == REPLACEMENT
            sent += e.text
        broken += full.count(REPLACEMENT)
        assert len(set(ids)) > 40
    assert broken > 0
