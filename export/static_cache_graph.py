"""The serving graph: a decoder whose KV cache is a fixed buffer updated in place.

The exported graph in `onnx_export.py` grows its cache by Concat, which copies the whole past
every step. This one is built op by op from the model's weights around onnxruntime's
`com.microsoft.GroupQueryAttention`, with kv_num_heads = the model's key/value heads (equal to
num_heads for GPT-2; fewer for grouped-query models, whose cache is that much smaller). For a
Llama-style model the queries and keys are rotated by the attention op itself (do_rotary, from
cos/sin tables built at export by the function the PyTorch model takes its angles from), or where its
kernel does not take the head width by `com.microsoft.RotaryEmbedding` ops at `position_ids` before it.
Partial rotary (the leading rotary_dim
dimensions of each head) is a cos/sin table rotary_dim/2 wide, which the attention op takes when that is a
multiple of 8 and the RotaryEmbedding ops always; a block without rotary positions is not rotated at all;
query/key norms normalise each projected head before either rotation; sliding-window layers with a rotary
base of their own (Gemma 3) take cos/sin tables of their own. The norms are RMSNorms
(`SkipSimplifiedLayerNormalization` fuses each residual add into the next norm) and the
feed-forward is SwiGLU or GeGLU (gate and up in one MatMul). The attention op also takes each layer's
sliding window (`local_window_size`: onnxruntime 1.32's window of W keys is transformers' `sliding_window`
W, measured in tests/export/test_window_graph.py), the attention scale and Gemma 2's soft-capping of
the scores (`softcap`); Gemma's norms after each sublayer are RMSNorms in plain ops, its scaled embeddings
a Mul and its soft-capped logits Div, Tanh, Mul:

    inputs   input_ids              int64 [batch, seq]
             position_ids           int64 [batch, seq]
             seqlens_k              int32 [batch]       each row's length after this step, minus 1
             total_sequence_length  int32 []            max(seqlens_k) + 1
             past_key_values.{i}.key / .value   float [batch, kv_heads, max_seq, d_head]
             logits_index           int64 [batch, logits_seq]   the positions (0 ... seq - 1) to compute logits at
    outputs  logits                 float [batch, logits_seq, vocab]
             present.{i}.key / .value           float [batch, kv_heads, max_seq, d_head]

Each row's tokens sit at the start of its slot; a step writes its `seq` new keys and values at
positions seqlens_k + 1 - seq ... seqlens_k. When past and present are bound to the same buffer
(IO binding), the kernel writes only the new positions and reads only each row's live prefix, so
a step costs the same whatever max_seq is (docs/engine.md has the measurements). The head runs only at
`logits_index`: a prompt's last position (0 for a decode row), or every position where a prompt is scored or
drafts verified; the other positions' logits are never computed (docs/engine.md "Logits where they are read").

`export_static_cache_decoder` writes each weight to the graph's data file as it is made
(`export/external_data.py`), so the graph is built with no second copy of the model's weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from export.external_data import DataFile
from model.gpt import GPT
from model.rotary import rotary_cos_sin
from service.runtime.bundle import LOGITS_INDEX, static_io_names

STATIC_OPSET = 17
MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    def __init__(self, weights: dict[str, np.ndarray], data: DataFile | None = None):
        self.weights = weights
        self.data = data  # where initializers go as they are made; None: inside the graph
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.params: set[str] = set()  # weights already written as initializers (a weight may serve twice)

    def const(self, name: str, array: np.ndarray) -> str:
        make = self.data.tensor if self.data else numpy_helper.from_array
        self.initializers.append(make(np.ascontiguousarray(array), name))
        return name

    def param(self, name: str, transpose: bool = False) -> str | None:
        """The initializer of weight `name` (transposed: `name`_t), written once however often it is used."""
        made = f"{name}_t" if transpose else name
        if made in self.params:
            return made
        if name not in self.weights:
            return None
        self.params.add(made)
        w = self.weights[name]
        return self.const(made, w.T if transpose else w)

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{len(self.nodes)}", domain=domain,
                                           **attrs))
        return outputs[0]

    def linear(self, x: str, prefix: str, out: str) -> str:
        """x @ Wᵀ + b with W stored (out, in) as in nn.Linear."""
        y = self.node("MatMul", [x, self.param(f"{prefix}.weight", transpose=True)], [f"{out}_mm"])
        bias = self.param(f"{prefix}.bias")
        return self.node("Add", [y, bias], [out]) if bias else y

    def skip_norm(self, branch: str, residual: str, bias: str, norm: str, rms: bool, eps: float, out: str,
                  sum_out: str) -> tuple[str, str]:
        """(Norm(residual + branch + bias), residual + branch + bias): the residual add fused into the
        LayerNorm or RMSNorm that follows it."""
        inputs = [branch, residual, self.param(f"{norm}.weight")]  # then LayerNorm's beta; then the bias
        if not rms:
            inputs.append(self.param(f"{norm}.bias") or "")
        bias_name = self.param(bias)
        if bias_name:
            inputs.append(bias_name)
        while inputs[-1] == "":
            inputs.pop()
        op = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
        outputs = [out, "", "", sum_out]
        self.node(op, inputs, outputs, domain=MS_DOMAIN, epsilon=eps)
        return out, sum_out

    def norm(self, x: str, prefix: str, rms: bool, eps: float, out: str) -> str:
        if rms:  # x / sqrt(mean(x²) + eps) · g, in plain ops: it runs once per step, before the first block
            square = self.node("Mul", [x, x], [f"{out}_sq"])
            mean = self.node("ReduceMean", [square], [f"{out}_ms"], axes=[-1], keepdims=1)
            std = self.node("Sqrt", [self.node("Add", [mean, self.const(f"{out}_eps", np.array(eps, np.float32))],
                                               [f"{out}_mse"])], [f"{out}_rms"])
            return self.node("Mul", [self.node("Div", [x, std], [f"{out}_n"]), self.param(f"{prefix}.weight")], [out])
        inputs = [x, self.param(f"{prefix}.weight")]
        bias = self.param(f"{prefix}.bias")
        if bias:
            inputs.append(bias)
        return self.node("LayerNormalization", inputs, [out], axis=-1, epsilon=eps)

    def gelu(self, x: str, bias: str | None, exact: bool, out: str) -> str:
        """GELU (the tanh approximation unless `exact`) of x + bias."""
        if not exact:
            return self.node("FastGelu", [x, bias] if bias else [x], [out], domain=MS_DOMAIN)
        return self.node("BiasGelu", [x, bias], [out], domain=MS_DOMAIN) if bias else \
            self.node("Gelu", [x], [out], domain=MS_DOMAIN)

    def head_norm(self, x: str, prefix: str, heads: int, d_head: int, eps: float, out: str) -> str:
        """RMSNorm over each head of x (B, S, heads·d_head) with the weights `prefix`.weight (d_head,): the query
        and key norms of `MultiHeadAttention`."""
        split = self.node("Reshape", [x, self.const(f"{out}_heads", np.array([0, 0, heads, d_head], np.int64))],
                          [f"{out}_split"])  # (B, S, heads, d_head)
        normed = self.norm(split, prefix, True, eps, f"{out}_normed")
        return self.node("Reshape", [normed, self.const(f"{out}_flat", np.array([0, 0, heads * d_head], np.int64))],
                         [out])  # (B, S, heads·d_head)

    def feed_forward(self, h: str, prefix: str, config, i: int) -> str:
        """GELU MLP, SwiGLU or GeGLU; returns the down projection's output, before its bias."""
        if config.mlp in ("swiglu", "geglu"):  # gate and up in one MatMul, then act(gate) * up
            w = np.concatenate([self.weights[f"{prefix}.fc_gate.weight"], self.weights[f"{prefix}.fc_in.weight"]]).T
            both = self.node("MatMul", [h, self.const(f"{prefix}.gate_up", w)], [f"ff_{i}_gu"])
            gate, up = f"ff_{i}_gate", f"ff_{i}_up"
            self.node("Split", [both, self.const(f"ff_{i}_split", np.array([config.ff_width] * 2, np.int64))],
                      [gate, up], axis=-1)
            if config.mlp == "swiglu":
                act = self.node("Mul", [gate, self.node("Sigmoid", [gate], [f"ff_{i}_sig"])], [f"ff_{i}_silu"])
            else:
                act = self.gelu(gate, None, config.activation == "gelu", f"ff_{i}_gelu")
            f = self.node("Mul", [act, up], [f"ff_{i}_act"])
        else:
            f = self.node("MatMul", [h, self.param(f"{prefix}.fc_in.weight", transpose=True)], [f"ff_{i}_mm"])
            f = self.gelu(f, self.param(f"{prefix}.fc_in.bias"), config.activation == "gelu", f"ff_{i}_act")
        return self.node("MatMul", [f, self.param(f"{prefix}.fc_out.weight", transpose=True)], [f"ff_out_{i}"])


def build_static_cache_graph(model: GPT, rotary_in_attention: bool | None = None,
                             data: DataFile | None = None) -> onnx.ModelProto:
    """The graph, its weights written to `data` as they are made (None: inside the graph).
    `rotary_in_attention` rotates queries and keys inside GroupQueryAttention (do_rotary, positions from
    seqlens_k, 2 ops per layer fewer) instead of with RotaryEmbedding ops at position_ids; None chooses it
    wherever the op allows it (head width a multiple of 16, as in every Llama-family model; with partial rotary
    also rotary_dim / 2 a multiple of 8, else the RotaryEmbedding ops turn the leading rotary_dim dimensions). Both
    run at the same speed within 3% (docs/onnx.md). A model with query/key norms normalises each head of the
    projected queries and keys before either rotation; a block without rotary positions attends unrotated."""
    c = model.config
    # onnxruntime 1.32's kernel rotates the leading 2·w dimensions of each head for a cos table w wide, when w
    # is a multiple of 8 (Phi-4-mini: 48 of 64 pairs); other partial widths go to RotaryEmbedding ops
    attention_rotates = c.d_head % 16 == 0 and (c.rotary_dim == c.d_head or c.rotary_dim // 2 % 8 == 0)
    if rotary_in_attention is None:
        rotary_in_attention = attention_rotates
    if rotary_in_attention and not attention_rotates:
        raise ValueError(f"GroupQueryAttention cannot rotate rotary_dim={c.rotary_dim} of d_head={c.d_head} "
                         "(it needs a head width a multiple of 16 and rotary_dim / 2 a multiple of 8): "
                         "use rotary_in_attention=False")
    rms, eps, H, H_kv, D = c.norm == "rmsnorm", c.layer_norm_eps, c.n_head, c.kv_heads, c.d_head
    if c.post_norms and (c.bias or c.qkv_bias):
        raise ValueError("norms after the sublayers are built for models without biases (Gemma's)")
    weights = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}  # views of fp32 weights
    if c.pos_encoding == "sinusoidal":
        weights["pos_emb.weight"] = model.pos_table.float().cpu().numpy()
    b = GraphBuilder(weights, data)
    in_names, out_names = static_io_names(c.n_layer)
    x = b.node("Gather", [b.param("tok_emb.weight"), "input_ids"], ["tok_x"])  # (B, S, d)
    if c.scale_embeddings:  # sqrt(d_model) in float32, as the model multiplies
        x = b.node("Mul", [x, b.const("emb_scale", np.array(math.sqrt(c.d_model), np.float32))], ["tok_x_scaled"])
    tables: dict[bool, tuple[str, str]] = {}  # cos/sin of every position's angles, (n_ctx, rotary_dim/2), the
    # PyTorch model's, by whether the layer takes the sliding-window layers' own rotary (Gemma 3)
    if c.pos_encoding == "rotary":
        kinds = {False: ("rope", c.rope_theta, c.rope_scaling)}
        if c.rope_local_theta is not None:
            kinds[True] = ("rope_local", c.rope_local_theta, c.rope_local_scaling)
        for local, (name, theta, scaling) in kinds.items():
            cos, sin = rotary_cos_sin(torch.arange(c.n_ctx), c.rotary_dim, theta, scaling, c.n_ctx)
            tables[local] = b.const(f"{name}_cos", cos.numpy()), b.const(f"{name}_sin", sin.numpy())
    else:
        pos = b.node("Gather", [b.param("pos_emb.weight"), "position_ids"], ["pos_x"])
        x = b.node("Add", [x, pos], ["x_0"])
    partial = {"rotary_embedding_dim": c.rotary_dim} if c.rotary_dim != D else {}
    h = b.norm(x, "blocks.0.ln_1", rms, eps, "h_0")
    for i in range(c.n_layer):
        p = f"blocks.{i}"
        qkv = b.linear(h, f"{p}.attn.qkv_proj", f"qkv_{i}")  # (B, S, (H + 2 H_kv) D): q heads, k heads, v heads
        rotate_here = c.uses_rotary(i)
        if rotate_here:
            cos, sin = tables[c.rope_local_theta is not None and c.window(i) is not None]
        inside = rotate_here and rotary_in_attention
        if c.qk_norm or (rotate_here and not inside):
            q, k, v = f"q_{i}", f"k_{i}", f"v_{i}"
            b.node("Split", [qkv, b.const(f"qkv_split_{i}", np.array([H * D, H_kv * D, H_kv * D], np.int64))],
                   [q, k, v], axis=-1)
            if c.qk_norm:  # per head, before any rotation (GroupQueryAttention's own comes after its inputs)
                q = b.head_norm(q, f"{p}.attn.q_norm", H, D, eps, f"q_norm_{i}")
                k = b.head_norm(k, f"{p}.attn.k_norm", H_kv, D, eps, f"k_norm_{i}")
            if rotate_here and not inside:
                q = b.node("RotaryEmbedding", [q, "position_ids", cos, sin], [f"q_rot_{i}"], domain=MS_DOMAIN,
                           num_heads=H, interleaved=0, **partial)
                k = b.node("RotaryEmbedding", [k, "position_ids", cos, sin], [f"k_rot_{i}"], domain=MS_DOMAIN,
                           num_heads=H_kv, interleaved=0, **partial)
            qkv_inputs = [q, k, v]
        else:
            qkv_inputs = [qkv, "", ""]
        attn = b.node("GroupQueryAttention",
                      [*qkv_inputs, in_names[4 + 2 * i], in_names[5 + 2 * i], "seqlens_k", "total_sequence_length",
                       *([cos, sin] if inside else [])],
                      [f"attn_{i}", out_names[1 + 2 * i], out_names[2 + 2 * i]], domain=MS_DOMAIN,
                      num_heads=H, kv_num_heads=H_kv, scale=c.scale, do_rotary=int(inside), rotary_interleaved=0,
                      local_window_size=c.window(i) or -1, softcap=c.attn_softcap or 0.0)
        o = b.node("MatMul", [attn, b.param(f"{p}.attn.out_proj.weight", transpose=True)], [f"attn_out_{i}"])
        out_bias, ffn_bias = f"{p}.attn.out_proj.bias", f"{p}.ffn.fc_out.bias"
        if c.post_norms:  # the sublayer's output normalised before the residual add (the models have no biases)
            o = b.norm(o, f"{p}.post_attn_norm", rms, eps, f"attn_post_{i}")
        # x += o + b_O; h = Norm_2(x), in one pass
        h, x = b.skip_norm(o, x, out_bias, f"{p}.ln_2", rms, eps, f"h2_{i}", f"x_{i}_attn")
        f = b.feed_forward(h, f"{p}.ffn", c, i)
        if c.post_norms:
            f = b.norm(f, f"{p}.post_ffn_norm", rms, eps, f"ffn_post_{i}")
        # x += f + b_2; h = the next norm (ln_1 of the next block, or ln_f), in one pass
        ln = f"blocks.{i + 1}.ln_1" if i + 1 < c.n_layer else "ln_f"
        h, x = b.skip_norm(f, x, ffn_bias, ln, rms, eps, f"h_{i + 1}", f"x_{i + 1}")
    # the final hidden states of the positions asked for: [batch, logits_seq, d]
    read = b.node("Unsqueeze", [LOGITS_INDEX, b.const("last_axis", np.array([-1], np.int64))], ["logits_index_nd"])
    h = b.node("GatherND", [h, read], ["h_read"], batch_dims=1)
    head = weights["tok_emb.weight"] if c.tie_embeddings else weights["lm_head.weight"]
    logits = "logits_raw" if c.final_softcap else "logits"
    b.node("MatMul", [h, b.const("lm_head.weight_t", head.T)], [logits])
    if c.final_softcap:  # cap · tanh(logits / cap)
        cap = b.const("final_softcap", np.array(c.final_softcap, np.float32))
        b.node("Mul", [b.node("Tanh", [b.node("Div", [logits, cap], ["logits_div"])], ["logits_tanh"]), cap],
               ["logits"])

    cache = ["batch", H_kv, "max_seq", D]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in in_names[4:]]
    inputs.append(helper.make_tensor_value_info(LOGITS_INDEX, TensorProto.INT64, ["batch", "logits_seq"]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "logits_seq", c.vocab_size])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in out_names[1:]]
    graph = helper.make_graph(b.nodes, "attnserve_static_cache_decoder", inputs, outputs, b.initializers)
    opsets = [helper.make_opsetid("", STATIC_OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    onnx_model = helper.make_model(graph, opset_imports=opsets, producer_name="attnserve")
    onnx_model.ir_version = 8
    if data is None:  # else checked once saved, where the checker finds the data file
        onnx.checker.check_model(onnx_model)
    return onnx_model


def export_static_cache_decoder(model: GPT, path: str | Path, rotary_in_attention: bool | None = None) -> Path:
    """Write the graph to `path`, its weights to `path`.data beside it."""
    path = Path(path)
    with DataFile(path) as data:
        graph = build_static_cache_graph(model.eval(), rotary_in_attention, data)
    onnx.save(graph, str(path))
    onnx.checker.check_model(str(path))
    return path
