"""The serving graph: a decoder whose KV cache is a fixed buffer updated in place.

The exported graph in `onnx_export.py` grows its cache by Concat, which copies the whole past
every step. This one is built op by op from the model's weights around onnxruntime's
`com.microsoft.GroupQueryAttention` (num_heads = kv_num_heads, so plain multi-head attention):

    inputs   input_ids              int64 [batch, seq]
             position_ids           int64 [batch, seq]
             seqlens_k              int32 [batch]       each row's length after this step, minus 1
             total_sequence_length  int32 []            max(seqlens_k) + 1
             past_key_values.{i}.key / .value   float [batch, n_head, max_seq, d_head]
    outputs  logits                 float [batch, seq, vocab]
             present.{i}.key / .value           float [batch, n_head, max_seq, d_head]

Each row's tokens sit at the start of its slot; a step writes its `seq` new keys and values at
positions seqlens_k + 1 - seq ... seqlens_k. When past and present are bound to the same buffer
(IO binding), the kernel writes only the new positions and reads only each row's live prefix, so
a step costs the same whatever max_seq is (docs/engine.md has the measurements).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model.gpt import GPT
from service.runtime.bundle import static_io_names

STATIC_OPSET = 17
MS_DOMAIN = "com.microsoft"


class _Builder:
    def __init__(self, weights: dict[str, np.ndarray]):
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def param(self, name: str, transpose: bool = False) -> str | None:
        if name not in self.weights:
            return None
        w = self.weights[name]
        return self.const(name, w.T if transpose else w)

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{len(self.nodes)}", domain=domain,
                                           **attrs))
        return outputs[0]

    def linear(self, x: str, prefix: str, out: str) -> str:
        """x @ Wᵀ + b with W stored (out, in) as in nn.Linear."""
        y = self.node("MatMul", [x, self.param(f"{prefix}.weight", transpose=True)], [f"{out}_mm"])
        bias = self.param(f"{prefix}.bias")
        return self.node("Add", [y, bias], [out]) if bias else y

    def skip_layer_norm(self, branch: str, residual: str, bias: str, ln: str, eps: float, out: str,
                        sum_out: str) -> tuple[str, str]:
        """(LN(residual + branch + bias), residual + branch + bias): the residual add fused into the norm."""
        inputs = [branch, residual, self.param(f"{ln}.weight"), self.param(f"{ln}.bias") or ""]
        bias_name = self.param(bias)
        if bias_name:
            inputs.append(bias_name)
        while inputs[-1] == "":
            inputs.pop()
        self.node("SkipLayerNormalization", inputs, [out, "", "", sum_out], domain=MS_DOMAIN, epsilon=eps)
        return out, sum_out

    def layer_norm(self, x: str, prefix: str, eps: float, out: str) -> str:
        inputs = [x, self.param(f"{prefix}.weight")]
        bias = self.param(f"{prefix}.bias")
        if bias:
            inputs.append(bias)
        return self.node("LayerNormalization", inputs, [out], axis=-1, epsilon=eps)


def build_static_cache_graph(model: GPT) -> onnx.ModelProto:
    c = model.config
    weights = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if c.pos_encoding == "sinusoidal":
        weights["pos_emb.weight"] = model.pos_table.float().cpu().numpy()
    b = _Builder(weights)
    in_names, out_names = static_io_names(c.n_layer)
    tok = b.node("Gather", [b.param("tok_emb.weight"), "input_ids"], ["tok_x"])  # (B, S, d)
    pos = b.node("Gather", [b.param("pos_emb.weight"), "position_ids"], ["pos_x"])
    x = b.node("Add", [tok, pos], ["x_0"])
    h = b.layer_norm(x, "blocks.0.ln_1", c.layer_norm_eps, "h_0")
    for i in range(c.n_layer):
        p = f"blocks.{i}"
        qkv = b.linear(h, f"{p}.attn.qkv_proj", f"qkv_{i}")  # (B, S, 3d): q heads, k heads, v heads
        attn = b.node("GroupQueryAttention",
                      [qkv, "", "", in_names[4 + 2 * i], in_names[5 + 2 * i], "seqlens_k", "total_sequence_length"],
                      [f"attn_{i}", out_names[1 + 2 * i], out_names[2 + 2 * i]], domain=MS_DOMAIN,
                      num_heads=c.n_head, kv_num_heads=c.n_head, scale=1.0 / math.sqrt(c.d_head), do_rotary=0)
        o = b.node("MatMul", [attn, b.param(f"{p}.attn.out_proj.weight", transpose=True)], [f"attn_out_{i}"])
        # x += o + b_O; h = LN_2(x), in one pass
        h, x = b.skip_layer_norm(o, x, f"{p}.attn.out_proj.bias", f"{p}.ln_2", c.layer_norm_eps, f"h2_{i}",
                                 f"x_{i}_attn")
        f = b.node("MatMul", [h, b.param(f"{p}.ffn.fc_in.weight", transpose=True)], [f"ff_{i}_mm"])
        bias = b.param(f"{p}.ffn.fc_in.bias")
        if c.activation == "gelu_tanh":
            f = b.node("FastGelu", [f, bias] if bias else [f], [f"ff_{i}_act"], domain=MS_DOMAIN)
        else:
            f = b.node("BiasGelu", [f, bias], [f"ff_{i}_act"], domain=MS_DOMAIN) if bias else \
                b.node("Gelu", [f], [f"ff_{i}_act"], domain=MS_DOMAIN)
        f = b.node("MatMul", [f, b.param(f"{p}.ffn.fc_out.weight", transpose=True)], [f"ff_out_{i}"])
        # x += f + b_2; h = the next LayerNorm (ln_1 of the next block, or ln_f), in one pass
        ln = f"blocks.{i + 1}.ln_1" if i + 1 < c.n_layer else "ln_f"
        h, x = b.skip_layer_norm(f, x, f"{p}.ffn.fc_out.bias", ln, c.layer_norm_eps, f"h_{i + 1}", f"x_{i + 1}")
    b.node("MatMul", [h, b.const("lm_head.weight_t", weights["tok_emb.weight"].T)], ["logits"])

    cache = ["batch", c.n_head, "max_seq", c.d_head]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in in_names[4:]]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", c.vocab_size])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in out_names[1:]]
    graph = helper.make_graph(b.nodes, "attnserve_static_cache_decoder", inputs, outputs, b.initializers)
    opsets = [helper.make_opsetid("", STATIC_OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    onnx_model = helper.make_model(graph, opset_imports=opsets, producer_name="attnserve")
    onnx_model.ir_version = 8
    onnx.checker.check_model(onnx_model)
    return onnx_model


def export_static_cache_decoder(model: GPT, path: str | Path) -> Path:
    path = Path(path)
    onnx.save(build_static_cache_graph(model.eval()), str(path))
    return path
