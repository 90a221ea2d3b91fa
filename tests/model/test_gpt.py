"""GPT equivalences: causality, cached == uncached decode, left-padded batches, config options."""

from __future__ import annotations

import pytest
import torch

from model.config import GPTConfig
from model.generate import left_pad
from tests.conftest import make_model


@torch.no_grad()
def test_changing_future_tokens_leaves_past_logits_unchanged(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, 20))
    t = 11
    changed = ids.clone()
    changed[:, t + 1:] = torch.randint(0, 97, (2, 20 - t - 1))
    a, b = tiny_model(ids), tiny_model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
@torch.no_grad()
def test_prefill_then_decode_equals_one_full_forward(pos_encoding):
    model = make_model(pos_encoding=pos_encoding)
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 24))
    full = model(ids)  # (B, 24, V)
    cache = model.new_kv_cache(3)
    steps = [model(ids[:, :10], kv_cache=cache)]
    for t in range(10, 24):
        steps.append(model(ids[:, t: t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 24


@torch.no_grad()
def test_left_padded_batch_with_mixed_lengths_matches_each_row_alone():
    model = make_model(seed=4)
    torch.manual_seed(2)
    rows = [torch.randint(1, 97, (n,)).tolist() for n in (5, 12, 1, 9)]
    n_new = 8
    continuations = [torch.randint(1, 97, (n_new,)) for _ in rows]

    ids, mask = left_pad(rows, pad_id=0)
    cache = model.new_kv_cache(len(rows))
    batched = [model(ids, attention_mask=mask, kv_cache=cache)[:, -1]]
    for t in range(n_new):
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
        step_ids = torch.stack([c[t] for c in continuations])[:, None]
        batched.append(model(step_ids, attention_mask=mask, kv_cache=cache)[:, -1])
    batched = torch.stack(batched, dim=1)  # (B, n_new + 1, V)

    assert not torch.isnan(batched).any()
    for i, row in enumerate(rows):
        alone = model(torch.tensor([row + continuations[i].tolist()]))[0]  # (len + n_new, V)
        expected = alone[len(row) - 1:]  # logits at the prompt's last token, then each new token
        torch.testing.assert_close(batched[i], expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_padded_positions_never_produce_nan(tiny_model):
    ids, mask = left_pad([[5], [1, 2, 3, 4, 5, 6]], pad_id=0)
    logits = tiny_model(ids, attention_mask=mask)
    assert torch.isfinite(logits).all()


@torch.no_grad()
def test_explicit_attention_path_equals_fused_path():
    model = make_model(seed=5)
    torch.manual_seed(3)
    ids, mask = left_pad([[3, 4, 5, 6], [7, 8]], pad_id=0)
    fast = model(ids, attention_mask=mask)
    for block in model.blocks:
        block.attn.use_sdpa = False
    torch.testing.assert_close(model(ids, attention_mask=mask), fast, atol=1e-6, rtol=0)


def test_context_overflow_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="n_ctx"):
        tiny_model(torch.zeros(1, 65, dtype=torch.long))
    cache = tiny_model.new_kv_cache(1, max_len=64)
    tiny_model(torch.zeros(1, 60, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="n_ctx"):
        tiny_model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)


def test_output_head_is_tied_to_token_embedding(tiny_model):
    assert tiny_model.lm_head.weight is tiny_model.tok_emb.weight


def test_sinusoidal_encoding_has_no_learned_positions():
    model = make_model(pos_encoding="sinusoidal")
    assert not any("pos_emb" in n for n, _ in model.named_parameters())
    table = model.pos_table
    assert torch.allclose(table[0, 0::2], torch.zeros(16)) and torch.allclose(table[0, 1::2], torch.ones(16))


@pytest.mark.parametrize("bad", [dict(d_model=30, n_head=4), dict(pos_encoding="rope"), dict(activation="relu")])
def test_invalid_config_is_rejected(bad):
    with pytest.raises(ValueError):
        GPTConfig(**bad)


def test_config_round_trips_through_json(tmp_path):
    c = GPTConfig(vocab_size=123, n_layer=3, d_ff=100, pos_encoding="sinusoidal")
    c.save(tmp_path / "config.json")
    assert GPTConfig.load(tmp_path / "config.json") == c
    with pytest.raises(ValueError, match="unknown"):
        GPTConfig.from_dict({**c.to_dict(), "n_embd": 4})
