"""The two serving graphs of an encoder-decoder model, built op by op from its weights.

The encoder graph runs once per source and returns, for every decoder layer, the cross-attention
keys and values of that source; the decoder graph takes them as inputs at every step, beside its own
self-attention cache, which it updates in place as the decoder-only serving graph does
(`static_cache_graph.py`, onnxruntime's GroupQueryAttention):

    encoder  inputs   input_ids               int64 [batch, src_seq]
                      attention_mask          int64 [batch, src_seq]      1 = real token, 0 = padding
             outputs  cross.{i}.key           float [batch, heads, d_head, src_seq]   (keys transposed)
                      cross.{i}.value         float [batch, heads, src_seq, d_head]

    decoder  inputs   input_ids, position_ids int64 [batch, seq]
                      seqlens_k               int32 [batch]   each row's target length after this step, minus 1
                      total_sequence_length   int32 []        max(seqlens_k) + 1
                      past_key_values.{i}.key / .value      float [batch, heads, max_seq, d_head]
                      cross.{i}.key / .value  as the encoder wrote them, src_seq = the slot's max_src
                      encoder_attention_mask  int64 [batch, max_src]   1 = real source token
             outputs  logits                  float [batch, seq, vocab]
                      present.{i}.key / .value              float [batch, heads, max_seq, d_head]

Cross-attention is plain ONNX ops: softmax(Q·Kᵀ/√d + bias)·V, the bias -1e9 at padded source
positions (exp underflows to exactly 0: a padded position gets zero weight). Keys are stored
transposed, [d_head, src_seq], so a step multiplies by them without transposing the cache. The
residual sums and norms are plain Add and LayerNormalization, which onnxruntime fuses when it loads
the graph.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.static_cache_graph import MS_DOMAIN, STATIC_OPSET, GraphBuilder
from model.seq2seq import EncoderDecoder
from service.runtime.bundle import cross_kv_names, self_kv_names

MASKED = -1e9  # the attention bias of a padded source position


class Seq2SeqBuilder(GraphBuilder):
    def __init__(self, model: EncoderDecoder):
        c = self.config = model.config
        weights = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
        if c.pos_encoding == "sinusoidal":
            weights["enc_pos_emb.weight"] = weights["dec_pos_emb.weight"] = model.pos_table.float().cpu().numpy()
        else:  # learned tables start at row position_offset (BART: 2)
            for side in ("enc", "dec"):
                weights[f"{side}_pos_emb.weight"] = weights[f"{side}_pos_emb.weight"][c.position_offset:]
        super().__init__(weights)
        self.H, self.D = c.n_head, c.d_head
        self.pre = c.norm_placement == "pre"
        self.scale = model.embed_scale

    def layer_norm(self, x: str, prefix: str, out: str) -> str:
        return self.norm(x, prefix, rms=False, eps=self.config.layer_norm_eps, out=out)

    def embed(self, ids: str, positions: str, side: str) -> str:
        """Token embedding × scale + position embedding (+ the embedding norm). `positions` is a (seq, d)
        slice (encoder) or a Gather at position_ids (decoder)."""
        table = "tok_emb.weight" if side == "enc" or self.config.share_embeddings else "dec_tok_emb.weight"
        x = self.node("Gather", [self.param(table), ids], [f"{side}_tok"])
        if self.scale != 1.0:
            x = self.node("Mul", [x, self.const(f"{side}_scale", np.array(self.scale, np.float32))], [f"{side}_scaled"])
        x = self.node("Add", [x, positions], [f"{side}_x"])
        if self.config.embedding_norm:
            x = self.layer_norm(x, f"{side}_emb_norm", f"{side}_x_norm")
        return x

    def heads(self, x: str, perm: list[int], out: str) -> str:
        """(B, T, H·D) -> (B, H, T, D) with perm [0, 2, 1, 3], or keys (B, H, D, T) with [0, 2, 3, 1]."""
        split = self.node("Reshape", [x, self.const(f"{out}_shape", np.array([0, 0, self.H, self.D], np.int64))],
                          [f"{out}_split"])
        return self.node("Transpose", [split], [out], perm=perm)

    def attend(self, q: str, k_t: str, v: str, bias: str | None, prefix: str, out: str) -> str:
        """softmax(q·k_t/√d + bias)·v, heads merged, then W_O (+ b_O): q (B, H, T, D), k_t (B, H, D, S)."""
        scores = self.node("MatMul", [q, k_t], [f"{out}_qk"])
        scores = self.node("Mul", [scores, self.const(f"{out}_scale", np.array(1 / math.sqrt(self.D), np.float32))],
                           [f"{out}_scaled"])
        if bias is not None:
            scores = self.node("Add", [scores, bias], [f"{out}_biased"])
        weights = self.node("Softmax", [scores], [f"{out}_w"], axis=-1)
        y = self.node("Transpose", [self.node("MatMul", [weights, v], [f"{out}_wv"])], [f"{out}_t"], perm=[0, 2, 1, 3])
        y = self.node("Reshape", [y, self.const(f"{out}_merge", np.array([0, 0, -1], np.int64))], [f"{out}_merged"])
        return self.linear(y, f"{prefix}.out_proj", out)

    def qkv_heads(self, x: str, prefix: str, part: str, out: str) -> str:
        """The queries ("q"), keys ("k") or values ("v") of x through `prefix`'s fused qkv_proj, as heads:
        (B, H, T, D), keys transposed to (B, H, D, T) for the attention's MatMul."""
        d = self.config.d_model
        rows = slice("qkv".index(part) * d, ("qkv".index(part) + 1) * d)
        w = self.weights[f"{prefix}.qkv_proj.weight"][rows]
        y = self.node("MatMul", [x, self.const(f"{out}_w", np.ascontiguousarray(w.T))], [f"{out}_mm"])
        b = self.weights.get(f"{prefix}.qkv_proj.bias")
        if b is not None:
            y = self.node("Add", [y, self.const(f"{out}_b", b[rows])], [f"{out}_proj"])
        return self.heads(y, [0, 2, 3, 1] if part == "k" else [0, 2, 1, 3], out)

    def sublayer(self, x: str, prefix: str, norm: int, branch, name: str) -> str:
        """Post-LN: Norm(x + F(x)); pre-LN: x + F(Norm(x))."""
        h = self.layer_norm(x, f"{prefix}.norms.{norm}", f"{name}_in") if self.pre else x
        y = self.node("Add", [x, branch(h)], [f"{name}_sum"])
        return y if self.pre else self.layer_norm(y, f"{prefix}.norms.{norm}", f"{name}_out")

    def feed_forward(self, h: str, prefix: str, name: str) -> str:
        f = self.linear(h, f"{prefix}.ffn.fc_in", f"{name}_in")
        act = self.config.activation
        if act == "relu":
            f = self.node("Relu", [f], [f"{name}_act"])
        else:  # onnxruntime's GELUs: opset 17 has none
            f = self.node("FastGelu" if act == "gelu_tanh" else "Gelu", [f], [f"{name}_act"], domain=MS_DOMAIN)
        return self.linear(f, f"{prefix}.ffn.fc_out", name)

    def source_bias(self, mask: str, name: str) -> str:
        """(B, S) int64 mask -> (B, 1, 1, S) float bias: 0 at real tokens, MASKED at padding."""
        m = self.node("Cast", [mask], [f"{name}_f"], to=TensorProto.FLOAT)
        b = self.node("Mul", [self.node("Sub", [m, self.const(f"{name}_one", np.array(1, np.float32))], [f"{name}_m1"]),
                              self.const(f"{name}_big", np.array(-MASKED, np.float32))], [f"{name}_b"])
        return self.node("Unsqueeze", [b, self.const(f"{name}_axes", np.array([1, 2], np.int64))], [name])

    def logits(self, x: str) -> None:
        c = self.config
        if self.pre:
            x = self.layer_norm(x, "dec_norm", "dec_final")
        # the state dict holds the head tied or not: tied, it is the decoder's embedding again
        y = self.node("MatMul", [x, self.param("lm_head.weight", transpose=True)],
                      ["logits" if not c.final_logits_bias else "logits_mm"])
        if c.final_logits_bias:
            self.node("Add", [y, self.param("logits_bias")], ["logits"])


def finish(b: GraphBuilder, name: str, inputs: list, outputs: list) -> onnx.ModelProto:
    graph = helper.make_graph(b.nodes, name, inputs, outputs, b.initializers)
    opsets = [helper.make_opsetid("", STATIC_OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    onnx_model = helper.make_model(graph, opset_imports=opsets, producer_name="attnserve")
    onnx_model.ir_version = 8
    onnx.checker.check_model(onnx_model)
    return onnx_model


def build_encoder_graph(model: EncoderDecoder) -> onnx.ModelProto:
    b = Seq2SeqBuilder(model)
    c = model.config
    cross_out = cross_kv_names(c.n_decoder_layer)
    end = b.node("Shape", ["input_ids"], ["src_len"], start=1, end=2)  # [src_seq]
    positions = b.node("Slice", [b.param("enc_pos_emb.weight"), b.const("zero_start", np.array([0], np.int64)), end],
                       ["enc_positions"])  # rows 0 .. src_seq - 1 of the table
    x = b.embed("input_ids", positions, "enc")
    bias = b.source_bias("attention_mask", "src_bias")
    for i in range(c.n_encoder_layer):
        p = f"encoder.{i}"

        def self_attention(h: str, p=p, i=i) -> str:
            q, k, v = (b.qkv_heads(h, f"{p}.self_attn", part, f"e{i}_{part}h") for part in "qkv")
            return b.attend(q, k, v, bias, f"{p}.self_attn", f"e{i}_attn")

        x = b.sublayer(x, p, 0, self_attention, f"e{i}_a")
        x = b.sublayer(x, p, 1, lambda h, p=p, i=i: b.feed_forward(h, p, f"e{i}_ff"), f"e{i}_f")
    if b.pre:
        x = b.layer_norm(x, "enc_norm", "memory")
    for i in range(c.n_decoder_layer):  # every decoder layer's keys (transposed) and values of the source
        p = f"decoder.{i}.cross_attn"
        b.qkv_heads(x, p, "k", cross_out[2 * i])
        b.qkv_heads(x, p, "v", cross_out[2 * i + 1])
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "src_seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "src_seq"])]
    key, value = ["batch", b.H, b.D, "src_seq"], ["batch", b.H, "src_seq", b.D]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, value if name.endswith("value") else key)
               for name in cross_out]
    return finish(b, "attnserve_encoder", inputs, outputs)


def build_decoder_graph(model: EncoderDecoder) -> onnx.ModelProto:
    b = Seq2SeqBuilder(model)
    c = model.config
    H, D = b.H, b.D
    self_in, self_out = self_kv_names(c.n_decoder_layer)
    cross_in = cross_kv_names(c.n_decoder_layer)
    positions = b.node("Gather", [b.param("dec_pos_emb.weight"), "position_ids"], ["dec_positions"])
    x = b.embed("input_ids", positions, "dec")
    bias = b.source_bias("encoder_attention_mask", "cross_bias")
    for i in range(c.n_decoder_layer):
        p = f"decoder.{i}"

        def self_attention(h: str, p=p, i=i) -> str:
            qkv = b.linear(h, f"{p}.self_attn.qkv_proj", f"d{i}_qkv")
            attn = b.node("GroupQueryAttention",
                          [qkv, "", "", self_in[2 * i], self_in[2 * i + 1], "seqlens_k", "total_sequence_length"],
                          [f"d{i}_sa", self_out[2 * i], self_out[2 * i + 1]], domain=MS_DOMAIN,
                          num_heads=H, kv_num_heads=H, scale=1.0 / math.sqrt(D))
            return b.linear(attn, f"{p}.self_attn.out_proj", f"d{i}_sa_out")

        def cross_attention(h: str, p=p, i=i) -> str:
            q = b.qkv_heads(h, f"{p}.cross_attn", "q", f"d{i}_cqh")
            return b.attend(q, cross_in[2 * i], cross_in[2 * i + 1], bias, f"{p}.cross_attn", f"d{i}_ca")

        x = b.sublayer(x, p, 0, self_attention, f"d{i}_a")
        x = b.sublayer(x, p, 1, cross_attention, f"d{i}_c")
        x = b.sublayer(x, p, 2, lambda h, p=p, i=i: b.feed_forward(h, p, f"d{i}_ff"), f"d{i}_f")
    b.logits(x)
    cache = ["batch", H, "max_seq", D]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in self_in]
    for i in range(c.n_decoder_layer):
        inputs += [helper.make_tensor_value_info(cross_in[2 * i], TensorProto.FLOAT, ["batch", H, D, "max_src"]),
                   helper.make_tensor_value_info(cross_in[2 * i + 1], TensorProto.FLOAT, ["batch", H, "max_src", D])]
    inputs.append(helper.make_tensor_value_info("encoder_attention_mask", TensorProto.INT64, ["batch", "max_src"]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", c.vocab_size])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in self_out]
    return finish(b, "attnserve_decoder", inputs, outputs)


def export_seq2seq(model: EncoderDecoder, encoder_path: str | Path, decoder_path: str | Path) -> None:
    model = model.eval()
    onnx.save(build_encoder_graph(model), str(encoder_path))
    onnx.save(build_decoder_graph(model), str(decoder_path))
