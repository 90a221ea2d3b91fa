"""When a sequence ends: max_new_tokens, min_new_tokens, EOS, stop token ids and stop strings.

Stop strings are matched on the decoded text, across token boundaries; the text before the stop
string is emitted, the stop string is not, and no delta ever carries part of a stop string that
later matches.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.request import FinishReason
from tests.engine.harness import Run, check_event_stream, drive, greedy, random_prompt, run_alone, sampled

EOS = 0
REPLACEMENT = "\ufffd"


def greedy_first_token(make_engine, prompt: list[int]) -> int:
    return run_alone(make_engine, greedy("probe", prompt, 1)).tokens("probe")[0]


@pytest.fixture(scope="module")
def eos_prompt(request, engine_bundle) -> list[int]:
    """A prompt whose greedy next token is EOS: found by running random prompts until one's greedy
    continuation reaches EOS, then extending it up to the token before.

    The lively model reaches EOS within the first few attempts, so not finding one is a failure. A trained
    model under test in the serving lane may never end its text (the shipped one is trained on running
    text): there the tests that need such a prompt are skipped."""
    from service.engine.config import EngineConfig
    from service.engine.core import Engine
    from tests.conftest import serving_bundle

    lane = serving_bundle(request.config) is not None
    engine = Engine(EngineConfig(bundle=engine_bundle, graph="static", max_running=64, max_batch_tokens=1024,
                                 threads=1))
    rng = np.random.default_rng(11)
    attempts = 1 if lane else 20
    for attempt in range(attempts):
        reqs = [greedy(f"r{attempt}-{i}", random_prompt(rng, int(rng.integers(1, 30))), 60) for i in range(64)]
        prompts = {r.request_id: r.prompt_token_ids for r in reqs}
        run = drive(engine, reqs)
        for rid in sorted(prompts):
            if run.finish(rid) is FinishReason.EOS and len(run.tokens(rid)) >= 2:
                return prompts[rid] + run.tokens(rid)[:-1]
    if lane:
        pytest.skip(f"no greedy continuation of {attempts * 64} random prompts reaches EOS: the model of "
                    f"{engine_bundle} does not end its text")
    raise AssertionError("no greedy continuation reached EOS")


def test_max_new_tokens_is_exact(make_engine):
    rng = np.random.default_rng(0)
    reqs = [greedy(f"m{k}", random_prompt(rng, 5 + k), k, ignore_eos=True) for k in (1, 2, 7, 33)]
    reqs.append(sampled("s", random_prompt(rng, 4), 19, seed=1, temperature=1.0, stopping=dict(ignore_eos=True)))
    run = drive(make_engine(), reqs)
    for r in reqs:
        check_event_stream(run, r.request_id)
        assert len(run.tokens(r.request_id)) == r.stopping.max_new_tokens
        assert run.finish(r.request_id) is FinishReason.LENGTH


def test_eos_ends_the_sequence_unless_ignored(make_engine, eos_prompt):
    run = run_alone(make_engine, greedy("e", eos_prompt, 10))
    assert run.tokens("e") == [EOS] and run.finish("e") is FinishReason.EOS
    assert run.text("e") == ""  # EOS is a special token: no text

    ignored = run_alone(make_engine, greedy("e", eos_prompt, 10, ignore_eos=True))
    toks = ignored.tokens("e")
    assert len(toks) == 10 and toks[0] == EOS and ignored.finish("e") is FinishReason.LENGTH
    tok = make_engine().tokenizer
    assert ignored.text("e") == tok.decode(toks, skip_special_tokens=True)


def test_min_new_tokens_suppresses_eos(make_engine, eos_prompt):
    run = run_alone(make_engine, greedy("e", eos_prompt, 12, min_new_tokens=5))
    toks = run.tokens("e")
    assert len(toks) >= 5
    assert EOS not in toks[:4]  # suppressed, not merely ignored: never sampled before min_new_tokens
    assert run.finish("e") is FinishReason.EOS if toks[-1] == EOS else run.finish("e") is FinishReason.LENGTH


def test_min_new_tokens_suppresses_stop_token_ids(make_engine):
    prompt = random_prompt(np.random.default_rng(1), 7)
    first = greedy_first_token(make_engine, prompt)

    stopped = run_alone(make_engine, greedy("s", prompt, 12, stop_token_ids=[first]))
    assert stopped.tokens("s") == [first] and stopped.finish("s") is FinishReason.STOP

    held = run_alone(make_engine, greedy("s", prompt, 12, stop_token_ids=[first], min_new_tokens=6))
    toks = held.tokens("s")
    assert len(toks) >= 6
    assert first not in toks[:5] and toks[0] != first
    if held.finish("s") is FinishReason.STOP:
        assert toks[-1] == first and first not in toks[:-1]
    else:
        assert held.finish("s") is FinishReason.LENGTH and len(toks) == 12

    # sampled requests are held to it too
    for seed in range(5):
        s = run_alone(make_engine, sampled("x", prompt, 12, seed=seed, temperature=0.3,
                                           stopping=dict(stop_token_ids=[first], min_new_tokens=4)))
        assert first not in s.tokens("x")[:3] and len(s.tokens("x")) >= 4


def test_stop_token_ids_end_the_sequence(make_engine):
    prompt = random_prompt(np.random.default_rng(2), 9)
    free = run_alone(make_engine, greedy("f", prompt, 40, ignore_eos=True))
    toks = free.tokens("f")
    k = next(i for i in range(5, len(toks)) if toks[i] not in toks[:i])  # first appearance after a few tokens
    unused = next(t for t in range(1, 300) if t not in toks)  # a second stop id that never comes
    run = run_alone(make_engine, greedy("f", prompt, 40, stop_token_ids=[toks[k], unused], ignore_eos=True))
    assert run.tokens("f") == toks[:k + 1]
    assert run.finish("f") is FinishReason.STOP
    assert run.events[("f", 0)][-1].token_id == toks[k]
    tok = make_engine().tokenizer
    assert run.text("f") == tok.decode(toks[:k], skip_special_tokens=True)  # the stop id brings no text


def boundary_stop(run: Run, rid: str, start: int) -> tuple[str, int]:
    """A stop string made of the end of one event's text and the start of the next one's, both
    complete characters, at or after event `start`. Returns it and the index of the second event."""
    evs = run.events[(rid, 0)]
    for i in range(start, len(evs) - 1):
        a, b = evs[i].text, evs[i + 1].text
        if len(a) >= 1 and len(b) >= 1 and REPLACEMENT not in a[-2:] + b[:2]:
            return a[-2:] + b[:2], i + 1
    raise AssertionError("no token boundary between two complete characters")


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_stop_string_across_token_boundaries(make_engine, seed):
    prompt = random_prompt(np.random.default_rng(seed), 6)
    free = run_alone(make_engine, greedy("t", prompt, 60, ignore_eos=True))
    full = free.text("t")
    stop, j = boundary_stop(free, "t", start=3 + seed)
    cut = full.find(stop)
    assert 0 <= cut
    expected = full[:cut]

    run = run_alone(make_engine, greedy("t", prompt, 60, stop=[stop], ignore_eos=True))
    evs = run.events[("t", 0)]
    assert run.finish("t") is FinishReason.STOP
    assert run.text("t") == expected
    assert stop not in run.text("t")
    # the sequence ends in the step that completes the stop string: the tokens are a prefix of the free run's
    toks = run.tokens("t")
    assert toks == free.tokens("t")[:len(toks)]
    tok = make_engine().tokenizer
    decoded = tok.decode(toks, skip_special_tokens=True)
    assert decoded.find(stop) >= 0 and tok.decode(toks[:-1], skip_special_tokens=True).find(stop) < 0
    # held back, never sent: at every step the streamed text is a prefix of the final text, so no
    # delta carried a part of the stop string
    streamed = ""
    for e in evs:
        streamed += e.text
        assert expected.startswith(streamed)
    check_event_stream(run, "t")


def test_stop_string_in_a_batch_and_the_earliest_of_several_wins(make_engine):
    rng = np.random.default_rng(9)
    prompt = random_prompt(rng, 5)
    free = run_alone(make_engine, greedy("t", prompt, 60, ignore_eos=True))
    full = free.text("t")
    early, _ = boundary_stop(free, "t", start=4)
    late, _ = boundary_stop(free, "t", start=20)
    if full.find(late) < full.find(early):
        early, late = late, early
    assert full.find(early) < full.find(late)
    others = [greedy(f"o{i}", random_prompt(rng, 3 + 7 * i), 30) for i in range(6)]
    run = drive(make_engine(max_batch_tokens=20), others,
                arrivals={2: [greedy("t", prompt, 60, stop=[late, "\u2603never\u2603", early], ignore_eos=True)]})
    assert run.text("t") == full[:full.find(early)]
    assert run.finish("t") is FinishReason.STOP


def test_stop_strings_that_never_match_change_nothing_and_hold_back_little(make_engine):
    prompt = random_prompt(np.random.default_rng(12), 6)
    free = run_alone(make_engine, greedy("t", prompt, 50, ignore_eos=True))
    full = free.text("t")
    # stop strings that start like text the model writes but never complete in it
    starts = [c for c in dict.fromkeys(full) if c != REPLACEMENT][:3]
    stops = [c + "\u2603" for c in starts] + ["\u2603\u2603"]
    assert all(s not in full for s in stops)
    run = run_alone(make_engine, greedy("t", prompt, 50, stop=stops, ignore_eos=True))
    assert run.text("t") == full and run.finish("t") is FinishReason.LENGTH
    assert run.tokens("t") == free.tokens("t")
    # at most (longest stop string - 1) characters are held back at any step
    a = b = ""
    for x, y in zip(free.events[("t", 0)], run.events[("t", 0)], strict=True):
        a, b = a + x.text, b + y.text
        assert a.startswith(b) and len(a) - len(b) <= 1


def test_held_back_text_is_flushed_when_a_stop_token_ends_the_sequence(make_engine):
    """Text held back as a possible stop-string start is sent when the sequence ends another way."""
    prompt = random_prompt(np.random.default_rng(2), 9)
    free = run_alone(make_engine, greedy("f", prompt, 40, ignore_eos=True))
    toks = free.tokens("f")
    tok = make_engine().tokenizer
    # a token not seen before, right after text that ends in a complete character
    k = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i]
             and not tok.decode(toks[:i], skip_special_tokens=True).endswith(REPLACEMENT))
    before = tok.decode(toks[:k], skip_special_tokens=True)
    last = before[-1]
    stop = last + "\u2603"  # starts like the end of the text, never completes: its first character is held
    run = run_alone(make_engine, greedy("f", prompt, 40, stop=[stop], stop_token_ids=[toks[k]], ignore_eos=True))
    assert run.tokens("f") == toks[:k + 1] and run.finish("f") is FinishReason.STOP
    assert run.text("f") == before
    assert run.events[("f", 0)][-1].text.endswith(last)  # held until the end, then sent


def test_stop_string_matched_at_max_new_tokens(make_engine):
    """The stop string completes on the last allowed token: STOP, and its text is still cut."""
    prompt = random_prompt(np.random.default_rng(3), 6)
    free = run_alone(make_engine, greedy("t", prompt, 60, ignore_eos=True))
    stop, _ = boundary_stop(free, "t", start=6)
    full = free.text("t")
    run = run_alone(make_engine, greedy("t", prompt, 60, stop=[stop], ignore_eos=True))
    n = len(run.tokens("t"))
    at_limit = run_alone(make_engine, greedy("t", prompt, n, stop=[stop], ignore_eos=True))
    assert at_limit.finish("t") is FinishReason.STOP
    assert at_limit.text("t") == run.text("t") == full[:full.find(stop)]
    shorter = run_alone(make_engine, greedy("t", prompt, n - 1, stop=[stop], ignore_eos=True))
    assert shorter.finish("t") is FinishReason.LENGTH
    assert shorter.text("t") == make_engine().tokenizer.decode(free.tokens("t")[:n - 1], skip_special_tokens=True)


def test_min_new_tokens_defers_stop_strings(make_engine):
    prompt = random_prompt(np.random.default_rng(4), 6)
    free = run_alone(make_engine, greedy("t", prompt, 60, ignore_eos=True))
    stop, _ = boundary_stop(free, "t", start=2)
    first = len(run_alone(make_engine, greedy("t", prompt, 60, stop=[stop], ignore_eos=True)).tokens("t"))
    run = run_alone(make_engine, greedy("t", prompt, 60, stop=[stop], min_new_tokens=first + 5, ignore_eos=True))
    assert len(run.tokens("t")) >= first + 5
    assert run.tokens("t") == free.tokens("t")[:len(run.tokens("t"))]


def test_every_eos_id_of_the_bundle_ends_a_sequence(make_engine, engine_bundle, tmp_path):
    """A model with several EOS ids (Llama 3's generation_config lists them): each one ends generation."""
    import shutil

    from service.runtime.bundle import read_manifest, write_manifest

    prompt = [5, 6, 7]
    first = drive(make_engine(), [greedy("probe", prompt, 1, ignore_eos=True)]).tokens("probe")[0]
    bundle = tmp_path / "bundle"
    shutil.copytree(engine_bundle, bundle)
    manifest = read_manifest(bundle)
    manifest.model.eos_token_ids = [manifest.model.eos_token_id, first]
    write_manifest(bundle, manifest)
    run = drive(make_engine(bundle=bundle), [greedy("e", prompt, 8)])
    assert run.tokens("e") == [first] and run.finish("e") is FinishReason.EOS
