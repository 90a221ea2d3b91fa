"""The KV cache and the scheduler: dense slots, fixed memory, the token budget, FCFS, n > 1 forks."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.errors import InvalidRequest
from service.engine.kv_cache import KVCache, block_tokens_for
from service.engine.sequence import Status
from service.runtime.static_runner import CacheShape
from tests.engine.harness import Run, check_idle, drive, greedy, random_prompt, run_alone, sampled

SHAPE = CacheShape(n_layer=2, n_head=2, d_head=3, max_seq=8)


# ---- KVCache on its own --------------------------------------------------------------------------

def test_dense_slots_move_the_last_sequence_into_a_hole():
    kv = KVCache(CacheShape(1, 1, 2, 8), 4)
    slots = [kv.allocate(name) for name in "abcd"]
    assert slots == [0, 1, 2, 3]
    for s in slots:
        kv.buffers[0][s, 0, :s + 1] = s + 1
        kv.lengths[s] = s + 1
    assert kv.release(1) == ("d", 1)
    assert kv.owners[:kv.used] == ["a", "d", "c"] and kv.lengths[1] == 4
    np.testing.assert_array_equal(kv.buffers[0][1, 0, :4], np.full((4, 2), 4.0))
    assert kv.release(2) is None and kv.used == 2  # the last slot leaves without a move
    kv.reserve(1)
    assert kv.free_slots == 1
    with pytest.raises(RuntimeError, match="cannot reserve"):
        kv.reserve(2)


def fill(kv: KVCache, slot: int, value: float, length: int) -> None:
    for b in kv.buffers:
        b[slot, :, :length] = value
    kv.lengths[slot] = length


def test_allocate_is_dense_and_release_moves_the_last_slot_into_the_hole():
    kv = KVCache(SHAPE, 4)
    owners = ["a", "b", "c", "d"]
    assert [kv.allocate(o) for o in owners] == [0, 1, 2, 3]
    for slot, length in enumerate((2, 3, 4, 5)):
        fill(kv, slot, slot + 1.0, length)
    assert kv.used == 4 and kv.free_slots == 0
    with pytest.raises(RuntimeError):
        kv.allocate("e")

    moved = kv.release(1)  # b leaves: d (slot 3) moves into slot 1
    assert moved == ("d", 1)
    assert kv.owners == ["a", "d", "c", None] and kv.used == 3 and kv.free_slots == 1
    assert kv.lengths.tolist() == [2, 5, 4, 0]
    for b in kv.buffers:
        assert (b[1, :, :5] == 4.0).all()  # d's live prefix came along
        assert (b[0, :, :2] == 1.0).all() and (b[2, :, :4] == 3.0).all()  # the others untouched

    assert kv.release(2) is None  # the last slot: nothing moves
    assert kv.owners[:2] == ["a", "d"] and kv.used == 2
    assert kv.allocate("f") == 2  # the next slot is the first free one


def test_reservations_count_against_free_slots():
    kv = KVCache(SHAPE, 4)
    kv.allocate("a")
    kv.reserve(2)
    assert kv.free_slots == 1
    with pytest.raises(RuntimeError):
        kv.reserve(2)
    assert kv.allocate("b", reserved=True) == 1 and kv.reserved == 1 and kv.free_slots == 1
    kv.unreserve(1)
    assert kv.free_slots == 2


def test_copy_copies_the_prefix_of_every_layer():
    kv = KVCache(SHAPE, 3)
    for o in "abc":
        kv.allocate(o)
    fill(kv, 0, 7.0, 6)
    kv.copy(0, 2, 4)
    for b in kv.buffers:
        assert (b[2, :, :4] == 7.0).all() and (b[2, :, 4:] == 0.0).all()
    assert kv.lengths[2] == 4


def test_blocks_are_held_per_sequence_and_counted_against_the_budget():
    kv = KVCache(SHAPE, 4, block_tokens=2, n_blocks=6)
    assert kv.blocks_per_slot == 4 and kv.free_blocks == 6 and kv.free_tokens == 12
    a = kv.allocate("a", blocks=2)
    kv.reserve(1, blocks_each=3)  # a sibling's slot and blocks, promised
    assert kv.free_blocks == 1 and kv.free_slots == 2
    with pytest.raises(RuntimeError, match="cannot reserve"):
        kv.reserve(1, blocks_each=2)
    assert kv.missing(a, 4) == 0 and kv.missing(a, 5) == 1 and kv.missing(a, 99) == 2  # capped at the context
    kv.grow(a, 5)
    assert kv.held[a] == 3 and kv.free_blocks == 0
    with pytest.raises(RuntimeError, match="more blocks"):
        kv.grow(a, 7)
    b = kv.allocate("b", blocks=3, reserved=True)
    assert kv.promised == 0 and kv.held_total == 6
    kv.release(a)  # b moves into slot 0 and keeps its blocks
    assert kv.owners[0] == "b" and kv.held[0] == 3 and kv.free_blocks == 3 and b == 1
    kv.shared = lambda: 2  # what a prefix cache keeps counts too
    assert kv.free_blocks == 1


def test_freed_positions_give_their_pages_back():
    shape = CacheShape(n_layer=1, n_head=2, d_head=64, max_seq=64)  # a position of a head: 256 bytes
    assert block_tokens_for(shape) == 16  # a block of each head's row: one page
    kv = KVCache(shape, 3)
    for owner, length in zip("abc", (64, 20, 40), strict=True):
        fill(kv, kv.allocate(owner, blocks=kv.blocks_for(length)), ord(owner), length)
    kv.release(0)  # c (40 positions) moves into a's slot; a's positions past them go back and read as zeros
    for b in kv.buffers:
        assert (b[0, :, :40] == ord("c")).all()
        assert (b[0, :, 48:] == 0).all()  # whole pages past the moved prefix: released
        assert (b[2] == 0).all()  # the last slot: released whole
        assert (b[1, :, :20] == ord("b")).all()
    assert kv.discard(1, 0) == 2 * 2 * 64 * 256  # every head row of the slot, key and value
    assert (kv.buffers[0][1] == 0).all()


# ---- the engine's cache and schedule -------------------------------------------------------------

def check_dense(engine) -> None:
    """Slots [0, used) are owned, in order, each by a live sequence that knows its slot."""
    kv = engine.kv
    for i in range(kv.used):
        seq = kv.owners[i]
        assert seq is not None and seq.slot == i and seq.status in (Status.PREFILLING, Status.DECODING)
        cached = seq.prompt_len + len(seq.output_ids) - 1 if seq.status is Status.DECODING else seq.num_prefilled
        assert kv.lengths[i] == cached
        assert kv.held[i] * kv.block_tokens >= kv.lengths[i]  # every position written is in a block it holds
    assert kv.held_total == kv.held.sum()
    assert all(o is None for o in kv.owners[kv.used:])
    assert (kv.lengths[kv.used:] == 0).all()


def mixed(seed: int, count: int = 14) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        length = int(rng.integers(1, 100)) if i % 4 else int(rng.integers(60, 110))
        max_new = int(rng.integers(1, min(128 - length, 30) + 1))
        if i % 5 == 3:
            out.append(sampled(f"r{i}", random_prompt(rng, length), max_new, seed=i, n=2, temperature=0.9))
        else:
            out.append(greedy(f"r{i}", random_prompt(rng, length), max_new))
    return out


def test_slots_stay_dense_and_memory_fixed_over_a_run(make_engine):
    engine = make_engine(max_running=6, max_batch_tokens=32)
    nbytes = engine.kv.nbytes
    buffers = [(id(b), b.ctypes.data, b.shape) for b in engine.kv.buffers]
    moves = []
    release = engine.kv.release

    def spy(slot):
        moved = release(slot)
        moves.append(moved)
        return moved

    engine.kv.release = spy
    reqs = mixed(0)
    arrivals = {2 * i: [r] for i, r in enumerate(reqs)}
    drive(engine, arrivals=arrivals, before_step=lambda e, step, run: check_dense(e))
    assert any(m is not None for m in moves)  # sequences left from the middle and slots moved
    assert engine.kv.nbytes == nbytes == engine.stats().kv_bytes
    assert [(id(b), b.ctypes.data, b.shape) for b in engine.kv.buffers] == buffers
    assert engine.kv.held_total == 0 and engine.kv.free_blocks == engine.kv.n_blocks - engine.kv.shared()


def test_kv_cache_bytes_caps_the_tokens_not_the_slots(make_engine, engine_bundle):
    probe = make_engine(max_running=8)
    per_slot = probe.kv.shape.bytes_per_slot
    engine = make_engine(max_running=8, kv_cache_bytes=3 * per_slot + 100, prefix_caching=False)
    assert engine.kv.n_slots == 8 and engine.kv.n_blocks == 3 * engine.kv.blocks_per_slot
    assert engine.kv.nbytes == 3 * per_slot and engine.stats().kv_tokens == 3 * engine.context
    with pytest.raises(ValueError, match=r"cannot hold one sequence of .*\(--max-context"):
        make_engine(max_running=8, kv_cache_bytes=per_slot - 1)
    # short requests take few blocks: all 8 run at once in a cache of 3 contexts
    engine.add(engine.new_request(greedy("first", [1, 2, 3], 6)))
    for i in range(7):
        engine.add(engine.new_request(greedy(f"r{i}", [i + 1, 2, 3], 6)))
    engine.step()
    assert engine.stats().running_sequences == 8
    run = drive(engine)
    assert len(run.events) == 8 and not run.errors
    assert engine.kv.free_blocks == engine.kv.n_blocks


def test_every_step_fits_the_token_budget_and_long_prompts_are_chunked(make_engine):
    budget = 24
    engine = make_engine(max_running=6, max_batch_tokens=budget)
    chunks: dict[str, list[tuple[int, list[int]]]] = {}
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        assert [s.slot for s in out.decode] == list(range(len(out.decode)))
        cost = len(out.decode) + (out.prefill.tokens if out.prefill else 0)
        assert cost <= budget
        if out.prefill is not None:
            p = out.prefill
            assert [s.slot for s in p.seqs] == list(range(p.seqs[0].slot, p.seqs[0].slot + len(p.seqs)))
            for seq, chunk in zip(p.seqs, p.chunks, strict=True):
                chunks.setdefault(seq.request_state.id, []).append((p.start, chunk))
        return out

    engine.scheduler.schedule = schedule
    reqs = mixed(1)
    run = drive(engine, arrivals={i: [r] for i, r in enumerate(reqs)})
    assert not run.errors
    chunked = 0
    for r in reqs:
        parts = chunks[r.request_id]
        assert [s for s, _ in parts] == list(np.cumsum([0] + [len(c) for _, c in parts[:-1]]))
        assert [t for _, c in parts for t in c] == r.prompt_token_ids  # written once, in order
        chunked += len(parts) > 1
        if len(r.prompt_token_ids) > budget:
            assert len(parts) >= 2
    assert chunked >= 3


def test_admission_is_first_come_first_served(make_engine):
    engine = make_engine(max_running=3, max_batch_tokens=30)
    order: list[str] = []
    prefill_batch, prefill = engine.runner.prefill_batch, engine.runner.prefill

    def first_seen():
        for seq in engine.kv.owners[:engine.kv.used]:
            if seq is not None and seq.request_state.id not in order:
                order.append(seq.request_state.id)

    def pb(first_slot, prompts):
        out = prefill_batch(first_slot, prompts)
        first_seen()
        return out

    engine.runner.prefill_batch = pb
    engine.runner.prefill = lambda *a, **k: (first_seen(), prefill(*a, **k))[1]
    rng = np.random.default_rng(2)
    reqs = [greedy("a", random_prompt(rng, 5), 20), greedy("b", random_prompt(rng, 80), 5),  # b is chunked
            greedy("c", random_prompt(rng, 2), 3),  # short, behind the long one: waits for it
            sampled("d", random_prompt(rng, 4), 6, seed=1, n=2, temperature=1.0),  # needs 2 slots
            greedy("e", random_prompt(rng, 3), 4), greedy("f", random_prompt(rng, 6), 4)]
    states = []
    run = Run()
    for r in reqs:
        s = engine.new_request(r)
        states.append(s)
        engine.add(s)
    seen_waiting = []
    while engine.has_work:
        seen_waiting.append([s.id for s in engine.scheduler.waiting])
        run.collect(engine.step())
    check_idle(engine)
    assert order == ["a", "b", "c", "d", "e", "f"]
    started = sorted(states, key=lambda s: s.scheduled_at)
    assert [s.id for s in started] == ["a", "b", "c", "d", "e", "f"]
    # every waiting queue seen was a suffix of the arrival order: nobody was overtaken
    ids = [r.request_id for r in reqs]
    assert all(w == ids[len(ids) - len(w):] for w in seen_waiting)


def test_n_siblings_share_one_prefill_and_copy_its_cache(make_engine):
    engine = make_engine(max_running=8, max_batch_tokens=20, prefix_caching=False)  # each run prefills it all
    prefilled: list[int] = []
    copies: list[tuple[int, int, int]] = []
    prefill_batch, prefill, copy = engine.runner.prefill_batch, engine.runner.prefill, engine.kv.copy
    engine.runner.prefill_batch = lambda first, prompts: (prefilled.extend(len(p) for p in prompts),
                                                          prefill_batch(first, prompts))[1]
    engine.runner.prefill = lambda slot, ids, start, **k: (prefilled.append(len(ids)), prefill(slot, ids, start, **k))[1]

    def spy_copy(src, dst, length):
        copies.append((src, dst, length))
        copy(src, dst, length)

    engine.kv.copy = spy_copy
    prompt = random_prompt(np.random.default_rng(3), 45)  # longer than the budget: chunked, then forked
    alone = drive(engine, [greedy("fam", prompt, 12, ignore_eos=True)]).tokens("fam")
    assert alone == run_alone(make_engine, greedy("fam", prompt, 12, ignore_eos=True)).tokens("fam")
    run = Run()
    engine.add(engine.new_request(greedy_n("fam", prompt, 12, 3)))
    engine.generate(on_outputs=run.collect)
    check_idle(engine)
    assert sum(prefilled) == 2 * len(prompt)  # once for the n=1 run, once for the n=3 request
    forks = [c for c in copies if c[2] == len(prompt)]
    assert len(forks) == 2 and len({dst for _, dst, _ in forks}) == 2
    assert all(src == forks[0][0] for src, _, _ in forks)
    assert [run.tokens("fam", i) for i in range(3)] == [alone] * 3  # greedy siblings: the same tokens


@pytest.mark.parametrize("order", [("fam", "short"), ("other", "fam", "short"), ("short", "fam", "other")])
def test_forked_siblings_survive_a_neighbour_leaving_in_the_same_step(make_engine, order):
    """Prompts prefilled together, one of them a family of 3 and one ending at its first token: slots
    move while the step's tokens are handed out (the last slot, a sibling already given its token,
    moves into the hole), and every sibling keeps its own token and cache."""
    rng = np.random.default_rng(5)
    prompts = {"fam": random_prompt(rng, 9), "short": random_prompt(rng, 4), "other": random_prompt(rng, 6)}
    make = {"fam": lambda: greedy_n("fam", prompts["fam"], 10, 3),
            "short": lambda: greedy("short", prompts["short"], 1),
            "other": lambda: sampled("other", prompts["other"], 8, seed=3, n=2, temperature=0.9,
                                     stopping=dict(ignore_eos=True))}
    engine = make_engine(max_running=8, max_batch_tokens=64)
    moves = []
    release = engine.kv.release
    engine.kv.release = lambda slot: moves.append(release(slot)) or moves[-1]
    run = drive(engine, [make[k]() for k in order], before_step=lambda e, step, r: check_dense(e))
    assert any(m is not None for m in moves)
    want = run_alone(make_engine, greedy_n("fam", prompts["fam"], 10, 1)).tokens("fam")
    assert [run.tokens("fam", i) for i in range(3)] == [want] * 3
    for rid in order:
        if rid != "fam":
            alone = run_alone(make_engine, make[rid]())
            n = 2 if rid == "other" else 1
            assert [run.tokens(rid, i) for i in range(n)] == [alone.tokens(rid, i) for i in range(n)]


def greedy_n(rid, prompt, max_new, n):
    r = greedy(rid, prompt, max_new, ignore_eos=True)
    r.n = n
    return r


def test_n_request_waits_until_all_its_slots_are_free(make_engine):
    engine = make_engine(max_running=4, max_batch_tokens=40)
    engine.add(engine.new_request(greedy("a", [1, 2, 3], 10)))
    engine.add(engine.new_request(greedy("b", [4, 5, 6], 3)))
    engine.step()
    engine.add(engine.new_request(sampled("fam", [7, 8], 5, seed=2, n=3, temperature=1.0)))
    engine.step()
    assert [s.id for s in engine.scheduler.waiting] == ["fam"]  # 2 free slots, 3 needed
    assert engine.stats().running_sequences == 2
    run = drive(engine)
    assert all(len(run.tokens("fam", i)) == 5 for i in range(3))


def test_stats_report_the_engine_state(make_engine, engine_model):
    engine = make_engine(max_running=3, max_batch_tokens=30)
    s = engine.stats()
    assert (s.running_requests, s.running_sequences, s.waiting_requests, s.kv_slots, s.kv_free_slots) == (0, 0, 0, 3, 3)
    assert s.kv_free_tokens == s.kv_tokens == engine.kv.n_blocks * engine.kv.block_tokens and s.generated_tokens == 0
    assert s.tokens_per_s == 0.0 and s.preemptions == 0
    engine.add(engine.new_request(sampled("fam", [7, 8], 5, seed=2, n=2, temperature=1.0,
                                          stopping=dict(ignore_eos=True))))
    engine.add(engine.new_request(greedy("a", [1, 2, 3], 10, ignore_eos=True)))
    engine.add(engine.new_request(greedy("b", [4, 5, 6], 3, ignore_eos=True)))
    assert engine.stats().waiting_requests == 3
    engine.step()
    s = engine.stats()
    assert (s.running_requests, s.running_sequences, s.waiting_requests, s.kv_free_slots) == (2, 3, 1, 0)
    held = engine.kv.held_total * engine.kv.block_tokens
    assert s.kv_free_tokens == s.kv_tokens - held  # the prefix cache's blocks count as free
    assert s.generated_tokens == 3 and s.steps == 1 and s.tokens_per_s > 0
    drive(engine)
    s = engine.stats()
    assert s.generated_tokens == 2 * 5 + 10 + 3 and s.kv_free_slots == 3 and s.running_requests == 0


def test_max_context_shortens_every_slot_and_bounds_requests(make_engine):
    full = make_engine(max_running=4)
    short = make_engine(max_running=4, max_context=32)
    assert short.context == 32 and short.kv.shape.max_seq == 32
    assert short.kv.blocks_per_slot * full.context == full.kv.blocks_per_slot * 32
    assert short.prefixes.nbytes * full.context == full.prefixes.nbytes * 32  # 4 contexts of the served length
    assert short.limits.max_new_tokens == short.limits.max_prompt_tokens == 31
    requests = [greedy(f"r{i}", [i + 1, 5, 9, 2], 20) for i in range(3)]
    a, b = drive(full, requests), drive(short, requests)
    for r in requests:  # the same tokens from the shorter slots
        assert b.tokens(r.request_id) == a.tokens(r.request_id) and b.finish(r.request_id) == a.finish(r.request_id)
    with pytest.raises(InvalidRequest, match="context of 32"):
        short.new_request(greedy("long", list(range(1, 14)), 20))
    with pytest.raises(ValueError, match="exceeds the model context"):
        make_engine(max_context=full.context + 1)
