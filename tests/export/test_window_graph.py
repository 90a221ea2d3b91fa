"""onnxruntime's GroupQueryAttention against our PyTorch attention, for the attributes the serving graph sets
per layer: `local_window_size` (the keys a query sees: transformers' `sliding_window` W is the op's W, not
W - 1 or W + 1, in onnxruntime 1.32), `scale` and `softcap`, in a prefill, a decode step over a cache and a
chunk after a cached prefix."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from model.attention import causal_mask, scaled_dot_product_attention, sliding_window_mask

H, H_KV, D, SEQ, MAX_SEQ = 4, 2, 8, 14, 16
STEPS = [(0, SEQ), (SEQ - 1, 1), (5, 4)]  # (positions already cached, positions this step)


def gqa_session(window: int, scale: float, softcap: float) -> ort.InferenceSession:
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=H,
                            kv_num_heads=H_KV, local_window_size=window, softcap=softcap, scale=scale)
    floats = [("q", [1, "s", H * D]), ("k", [1, "s", H_KV * D]), ("v", [1, "s", H_KV * D]),
              ("past_k", [1, H_KV, MAX_SEQ, D]), ("past_v", [1, H_KV, MAX_SEQ, D])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in floats]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present_k", "present_v")]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def heads(x: np.ndarray, n: int) -> np.ndarray:
    return x.reshape(-1, n, D).transpose(1, 0, 2)  # (n, T, D)


def run_gqa(session, q, k, v, past: int, seq: int) -> np.ndarray:
    cache_k, cache_v = np.zeros((2, 1, H_KV, MAX_SEQ, D), np.float32)
    cache_k[0, :, :past], cache_v[0, :, :past] = heads(k[:past], H_KV), heads(v[:past], H_KV)
    end = past + seq
    feeds = {"q": q[None, past:end], "k": k[None, past:end], "v": v[None, past:end], "past_k": cache_k,
             "past_v": cache_v, "seqlens_k": np.array([end - 1], np.int32), "total": np.array(end, np.int32)}
    return session.run(["out"], feeds)[0][0]  # (seq, H * D)


def run_torch(q, k, v, past: int, seq: int, window: int | None, scale: float, softcap: float | None) -> np.ndarray:
    end = past + seq
    qh = torch.from_numpy(heads(q[past:end], H))
    kh, vh = (torch.from_numpy(heads(x[:end], H_KV)).repeat_interleave(H // H_KV, 0) for x in (k, v))
    mask = causal_mask(seq, end) if window is None else sliding_window_mask(seq, end, window)
    out = scaled_dot_product_attention(qh, kh, vh, mask, scale=scale, softcap=softcap)  # (H, seq, D)
    return out.transpose(0, 1).reshape(seq, H * D).numpy()


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    q, k = (rng.normal(0, 2, (SEQ, n * D)).astype(np.float32) for n in (H, H_KV))
    return q, k, rng.normal(0, 1, (SEQ, H_KV * D)).astype(np.float32)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_local_window_size_is_the_sliding_window(qkv, window):
    q, k, v = qkv
    for past, seq in STEPS:
        want = run_torch(q, k, v, past, seq, window, D ** -0.5, None)
        assert np.abs(run_gqa(gqa_session(window, D ** -0.5, 0.0), q, k, v, past, seq) - want).max() < 1e-5
        for off_by_one in (window - 1, window + 1):  # either neighbour sees other keys somewhere
            if off_by_one > 0 and past + seq > window:
                other = run_gqa(gqa_session(off_by_one, D ** -0.5, 0.0), q, k, v, past, seq)
                assert np.abs(other - want).max() > 1e-3, (window, off_by_one, past, seq)


def test_no_window_is_full_causal_attention(qkv):
    q, k, v = qkv
    for past, seq in STEPS:
        want = run_torch(q, k, v, past, seq, None, D ** -0.5, None)
        assert np.abs(run_gqa(gqa_session(-1, D ** -0.5, 0.0), q, k, v, past, seq) - want).max() < 1e-5


def test_scale_and_softcap_are_gemma2s_order_scale_then_cap(qkv):
    q, k, v = qkv
    session = gqa_session(5, 0.3, 1.5)
    for past, seq in STEPS:
        want = run_torch(q, k, v, past, seq, 5, 0.3, 1.5)
        assert np.abs(run_gqa(session, q, k, v, past, seq) - want).max() < 1e-5
        uncapped = run_torch(q, k, v, past, seq, 5, 0.3, None)
        assert np.abs(uncapped - want).max() > 1e-3  # the cap is reached
