"""The two serving graphs of an encoder-decoder model, built op by op from its weights.

The encoder graph runs once per source and returns, for every decoder layer, the cross-attention
keys and values of that source; the decoder graph takes them as inputs at every step, beside its own
self-attention cache, which it updates in place as the decoder-only serving graph does
(`static_cache_graph.py`, onnxruntime's GroupQueryAttention):

    encoder  inputs   input_ids               int64 [batch, src_seq]
                      attention_mask          int64 [batch, src_seq]      1 = real token, 0 = padding
             outputs  cross.{i}.key / .value  float [batch, heads, src_seq, d_head]

    decoder  inputs   input_ids, position_ids int64 [batch, seq]
                      seqlens_k               int32 [batch]   each row's target length after this step, minus 1
                      total_sequence_length   int32 []        max(seqlens_k) + 1
                      past_key_values.{i}.key / .value      float [batch, heads, max_seq, d_head]
                      cross.{i}.key / .value  as the encoder wrote them, src_seq = the slot's max_src
                      encoder_attention_mask  int64 [batch, max_src]   1 = real source token
             outputs  logits                  float [batch, seq, vocab]
                      present.{i}.key / .value              float [batch, heads, max_seq, d_head]

Attention is onnxruntime's fused operators throughout: the encoder's self-attention is `Attention`
(the query, key and value projections and the attention in one op), the decoder's cross-attention
`MultiHeadAttention` over the source's keys and values as the encoder laid them out, with the source
mask as its key padding mask (a padded position gets exactly zero weight). The encoder projects the
source into every decoder layer's keys and values with one MatMul and splits them. Each residual sum
and the norm after (post-LN) or before the next sublayer (pre-LN) is one `SkipLayerNormalization`.
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
        self.eps = c.layer_norm_eps
        self.scale = model.embed_scale

    def layer_norm(self, x: str, prefix: str, out: str) -> str:
        return self.norm(x, prefix, rms=False, eps=self.eps, out=out)

    def embed(self, ids: str, positions: str, side: str) -> str:
        """Token embedding × scale + position embedding (+ the embedding norm, fused with the sum).
        `positions` is a (seq, d) slice (encoder) or a Gather at position_ids (decoder)."""
        table = "tok_emb.weight" if side == "enc" or self.config.share_embeddings else "dec_tok_emb.weight"
        x = self.node("Gather", [self.param(table), ids], [f"{side}_tok"])
        if self.scale != 1.0:
            x = self.node("Mul", [x, self.const(f"{side}_scale", np.array(self.scale, np.float32))], [f"{side}_scaled"])
        if not self.config.embedding_norm:
            return self.node("Add", [x, positions], [f"{side}_x"])
        return self.residual(x, positions, None, f"{side}_emb_norm", f"{side}_x")[0]

    def residual(self, branch: str, x: str, bias: str | None, norm: str, out: str) -> tuple[str, str]:
        """(Norm(x + branch + bias), x + branch + bias) in one SkipLayerNormalization."""
        return self.skip_norm(branch, x, bias or "", norm, rms=False, eps=self.eps, out=out, sum_out=f"{out}_sum")

    def sublayer(self, x: str, h: str, prefix: str, branch, norm: str, next_norm: str, name: str
                 ) -> tuple[str, str]:
        """One residual sublayer: returns (the next sublayer's input h, the residual stream x).

        Post-LN: x' = norm(x + F(x)) and h' = x'. Pre-LN: x' = x + F(h) and h' = next_norm(x'), the next
        sublayer's norm or the stack's final one. F returns its output before its last bias,
        `prefix`.bias, which the fused sum adds."""
        y = branch(h)
        if self.pre:
            return self.residual(y, x, f"{prefix}.bias", next_norm, name)
        out = self.residual(y, x, f"{prefix}.bias", norm, name)[0]
        return out, out

    def matmul(self, x: str, prefix: str, out: str) -> str:
        """x @ Wᵀ, the bias left to the caller."""
        return self.node("MatMul", [x, self.param(f"{prefix}.weight", transpose=True)], [out])

    def feed_forward(self, h: str, prefix: str, name: str) -> str:
        """The feed-forward layer up to fc_out's bias."""
        f = self.linear(h, f"{prefix}.ffn.fc_in", f"{name}_in")
        act = self.config.activation
        if act == "relu":
            f = self.node("Relu", [f], [f"{name}_act"])
        else:  # onnxruntime's GELUs: opset 17 has none
            f = self.node("FastGelu" if act == "gelu_tanh" else "Gelu", [f], [f"{name}_act"], domain=MS_DOMAIN)
        return self.matmul(f, f"{prefix}.ffn.fc_out", f"{name}_out")

    def self_attention(self, h: str, prefix: str, mask: str, name: str) -> str:
        """The encoder's self-attention up to out_proj's bias: `Attention` projects q, k and v and attends."""
        d = self.config.d_model
        bias = self.param(f"{prefix}.qkv_proj.bias")
        if bias is None:
            bias = self.const(f"{prefix}.qkv_proj.zero_bias", np.zeros(3 * d, np.float32))
        attn = self.node("Attention", [h, self.param(f"{prefix}.qkv_proj.weight", transpose=True), bias, mask],
                         [f"{name}_attn"], domain=MS_DOMAIN, num_heads=self.H, scale=1.0 / math.sqrt(self.D))
        return self.matmul(attn, f"{prefix}.out_proj", f"{name}_out")

    def cross_attention(self, h: str, prefix: str, key: str, value: str, mask: str, name: str) -> str:
        """The decoder's cross-attention up to out_proj's bias: the query projection, then
        `MultiHeadAttention` over the source's keys and values (batch, heads, src, d_head)."""
        d = self.config.d_model
        q = self.node("MatMul", [h, self.const(f"{prefix}.q_w", np.ascontiguousarray(
            self.weights[f"{prefix}.qkv_proj.weight"][:d].T))], [f"{name}_q_mm"])
        b = self.weights.get(f"{prefix}.qkv_proj.bias")
        if b is not None:
            q = self.node("Add", [q, self.const(f"{prefix}.q_b", b[:d])], [f"{name}_q"])
        attn = self.node("MultiHeadAttention", [q, key, value, "", mask], [f"{name}_attn"], domain=MS_DOMAIN,
                         num_heads=self.H, scale=1.0 / math.sqrt(self.D))
        return self.matmul(attn, f"{prefix}.out_proj", f"{name}_out")

    def cross_keys_values(self, memory: str, names: list[str]) -> None:
        """Every decoder layer's cross-attention keys and values of `memory` in one MatMul, split by layer into
        (batch, heads, src_seq, d_head)."""
        c, d = self.config, self.config.d_model
        rows = [self.weights[f"decoder.{i}.cross_attn.qkv_proj.weight"][d:] for i in range(c.n_decoder_layer)]
        y = self.node("MatMul", [memory, self.const("cross_kv_w", np.ascontiguousarray(np.concatenate(rows).T))],
                      ["cross_kv_mm"])
        if "decoder.0.cross_attn.qkv_proj.bias" in self.weights:
            b = np.concatenate([self.weights[f"decoder.{i}.cross_attn.qkv_proj.bias"][d:]
                                for i in range(c.n_decoder_layer)])
            y = self.node("Add", [y, self.const("cross_kv_b", b)], ["cross_kv"])
        heads = 2 * c.n_decoder_layer * self.H
        split = self.node("Reshape", [y, self.const("cross_kv_shape", np.array([0, 0, heads, self.D], np.int64))],
                          ["cross_kv_heads"])
        t = self.node("Transpose", [split], ["cross_kv_t"], perm=[0, 2, 1, 3])
        self.node("Split", [t, self.const("cross_kv_split", np.array([self.H] * len(names), np.int64))], names, axis=1)

    def source_mask(self, mask: str, name: str) -> str:
        """The int64 source mask as the int32 the attention operators take."""
        return self.node("Cast", [mask], [name], to=TensorProto.INT32)

    def logits(self, x: str) -> None:
        c = self.config
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
    mask = b.source_mask("attention_mask", "src_mask")
    h = b.layer_norm(x, "encoder.0.norms.0", "e0_in") if b.pre else x
    for i in range(c.n_encoder_layer):
        p = f"encoder.{i}"
        after = f"encoder.{i + 1}.norms.0" if i + 1 < c.n_encoder_layer else "enc_norm"
        h, x = b.sublayer(x, h, f"{p}.self_attn.out_proj", lambda h, p=p, i=i: b.self_attention(
            h, f"{p}.self_attn", mask, f"e{i}_a"), f"{p}.norms.0", f"{p}.norms.1", f"e{i}_a")
        h, x = b.sublayer(x, h, f"{p}.ffn.fc_out", lambda h, p=p, i=i: b.feed_forward(h, p, f"e{i}_ff"),
                          f"{p}.norms.1", after, f"e{i}_f")
    b.cross_keys_values(h, cross_out)  # pre-LN: h is enc_norm(x), the memory; post-LN: h is x
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "src_seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "src_seq"])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", b.H, "src_seq", b.D])
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
    mask = b.source_mask("encoder_attention_mask", "cross_mask")
    h = b.layer_norm(x, "decoder.0.norms.0", "d0_in") if b.pre else x
    for i in range(c.n_decoder_layer):
        p = f"decoder.{i}"
        after = f"decoder.{i + 1}.norms.0" if i + 1 < c.n_decoder_layer else "dec_norm"

        def self_attention(h: str, p=p, i=i) -> str:
            qkv = b.linear(h, f"{p}.self_attn.qkv_proj", f"d{i}_qkv")
            attn = b.node("GroupQueryAttention",
                          [qkv, "", "", self_in[2 * i], self_in[2 * i + 1], "seqlens_k", "total_sequence_length"],
                          [f"d{i}_sa", self_out[2 * i], self_out[2 * i + 1]], domain=MS_DOMAIN,
                          num_heads=H, kv_num_heads=H, scale=1.0 / math.sqrt(D))
            return b.matmul(attn, f"{p}.self_attn.out_proj", f"d{i}_sa_out")

        h, x = b.sublayer(x, h, f"{p}.self_attn.out_proj", self_attention, f"{p}.norms.0", f"{p}.norms.1", f"d{i}_a")
        h, x = b.sublayer(x, h, f"{p}.cross_attn.out_proj", lambda h, p=p, i=i: b.cross_attention(
            h, f"{p}.cross_attn", cross_in[2 * i], cross_in[2 * i + 1], mask, f"d{i}_c"),
            f"{p}.norms.1", f"{p}.norms.2", f"d{i}_c")
        h, x = b.sublayer(x, h, f"{p}.ffn.fc_out", lambda h, p=p, i=i: b.feed_forward(h, p, f"d{i}_ff"),
                          f"{p}.norms.2", after, f"d{i}_f")
    b.logits(h)
    cache = ["batch", H, "max_seq", D]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in self_in]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", H, "max_src", D]) for n in cross_in]
    inputs.append(helper.make_tensor_value_info("encoder_attention_mask", TensorProto.INT64, ["batch", "max_src"]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", c.vocab_size])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in self_out]
    return finish(b, "attnserve_decoder", inputs, outputs)


def export_seq2seq(model: EncoderDecoder, encoder_path: str | Path, decoder_path: str | Path) -> None:
    model = model.eval()
    onnx.save(build_encoder_graph(model), str(encoder_path))
    onnx.save(build_decoder_graph(model), str(decoder_path))
