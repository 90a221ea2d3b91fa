"""Hugging Face `BartForConditionalGeneration` <-> our `EncoderDecoder`, both ways.

BART is the paper's encoder-decoder with learned positions (whose table starts at row 2), a
LayerNorm after the embeddings on both sides, post-LN layers, a bias on the final logits, and one
token embedding shared by the encoder, the decoder and the output head. Its separate q, k and v
projections are stacked into our `qkv_proj` (queries, keys, values); every other tensor maps one to
one (Linear weights are (out, in) on both sides):

    model.shared                                   tok_emb                  (tied: also the decoder's and the head)
    model.{encoder,decoder}.embed_tokens           tok_emb, dec_tok_emb     (untied: each side's own)
    lm_head                                        lm_head                  (untied)
    model.{encoder,decoder}.embed_positions        {enc,dec}_pos_emb        (rows 0-1 unused: position_offset 2)
    model.{encoder,decoder}.layernorm_embedding    {enc,dec}_emb_norm
    model.encoder.layers.i.self_attn.{q,k,v}_proj  encoder.i.self_attn.qkv_proj
    model.encoder.layers.i.self_attn_layer_norm    encoder.i.norms.0
    model.encoder.layers.i.fc1, fc2                encoder.i.ffn.fc_in, fc_out
    model.encoder.layers.i.final_layer_norm        encoder.i.norms.1
    model.decoder.layers.i.self_attn ...           decoder.i.self_attn ...   norms.0
    model.decoder.layers.i.encoder_attn ...        decoder.i.cross_attn ...  norms.1 (encoder_attn_layer_norm)
    model.decoder.layers.i.final_layer_norm        decoder.i.norms.2
    final_logits_bias (1, vocab)                   logits_bias (vocab)

With `tie_word_embeddings` false the head is `lm_head`, its own weight. transformers 5 then unties the
two sides' `embed_tokens` from `shared` as well, and reads each; transformers 4 kept both sides on
`shared` and saved only that, so a side without its own table reads `shared`. Equal tables on the two
sides become our one `tok_emb`, different ones `tok_emb` and `dec_tok_emb`.

Export writes our model the other way when BART can express it: post-LN, an embedding norm, one
shared embedding, the same heads and feed-forward width on both sides. An untied head is written as
`lm_head` with `tie_word_embeddings` false, and the shared table also as both sides' `embed_tokens`,
so that transformers 4 and 5 read the same model. Sinusoidal positions become BART's learned table
holding the sinusoids (rows 2 onwards); a model without a logits bias gets BART's zeros.
"""

from __future__ import annotations

import torch

from model.seq2seq import EncoderDecoder
from model.seq2seq_config import Seq2SeqConfig

ARCHITECTURE = "BartForConditionalGeneration"
OFFSET = 2  # BART's learned position tables start at row 2
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_tanh": "gelu_new"}
NORMS = {"encoder": {"self_attn_layer_norm": 0, "final_layer_norm": 1},  # BART's name -> our norms.<index>
         "decoder": {"self_attn_layer_norm": 0, "encoder_attn_layer_norm": 1, "final_layer_norm": 2}}
LAYER_LINEARS = {"fc1": "ffn.fc_in", "fc2": "ffn.fc_out"}


class Unsupported(ValueError):
    """A checkpoint option, or a model, the other side cannot express; the message names it."""


def config_from_hf(hf: dict, hf_state: dict[str, torch.Tensor]) -> Seq2SeqConfig:
    """The config of a BART: from its config.json, and from its weights whether the two sides' token
    embeddings are one table."""
    for ours, theirs in (("heads", ("encoder_attention_heads", "decoder_attention_heads")),
                         ("feed-forward widths", ("encoder_ffn_dim", "decoder_ffn_dim"))):
        if hf[theirs[0]] != hf[theirs[1]]:
            raise Unsupported(f"the encoder and decoder differ in {ours} ({hf[theirs[0]]} and {hf[theirs[1]]})")
    act = hf.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        raise Unsupported(f"activation_function {act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    if hf.get("normalize_before") or hf.get("add_final_layer_norm"):
        raise Unsupported("pre-LN BART variants (mBART's normalize_before, add_final_layer_norm) are not supported")
    tied = bool(hf.get("tie_word_embeddings", True))
    s = unprefixed(hf_state)
    if not tied and "lm_head.weight" not in s:
        raise ValueError("tie_word_embeddings is false, yet the checkpoint has no lm_head.weight")
    enc, dec = token_embeddings(s, tied)
    return Seq2SeqConfig(
        vocab_size=hf["vocab_size"], n_src_ctx=hf["max_position_embeddings"], n_tgt_ctx=hf["max_position_embeddings"],
        n_encoder_layer=hf["encoder_layers"], n_decoder_layer=hf["decoder_layers"],
        n_head=hf["encoder_attention_heads"], d_model=hf["d_model"], d_ff=hf["encoder_ffn_dim"],
        norm_placement="post", pos_encoding="learned", position_offset=OFFSET, activation=ACTIVATIONS[act],
        share_embeddings=torch.equal(enc, dec), tie_embeddings=tied,
        scale_embedding=bool(hf.get("scale_embedding", False)), embedding_norm=True, final_logits_bias=True,
        pad_token_id=hf.get("pad_token_id", 1),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id", 2),
        decoder_start_token_id=hf.get("decoder_start_token_id", 2), architecture="bart")


def layer_pairs(c: Seq2SeqConfig) -> list[tuple[str, str]]:
    """(BART name, ours) of every tensor that maps one to one, the embedding norms and the layers' (BART
    names without the "model." prefix)."""
    names = [(f"{side}.layernorm_embedding", f"{ours}_emb_norm") for side, ours in (("encoder", "enc"),
                                                                                  ("decoder", "dec"))]
    for side, n in (("encoder", c.n_encoder_layer), ("decoder", c.n_decoder_layer)):
        for i in range(n):
            theirs, ours = f"{side}.layers.{i}", f"{side}.{i}"
            names += [(f"{theirs}.{hf_attn}.out_proj", f"{ours}.{attn}.out_proj") for hf_attn, attn in attentions(side)]
            names += [(f"{theirs}.{hf_norm}", f"{ours}.norms.{index}") for hf_norm, index in NORMS[side].items()]
            names += [(f"{theirs}.{hf_linear}", f"{ours}.{linear}") for hf_linear, linear in LAYER_LINEARS.items()]
    return [(f"{theirs}.{p}", f"{ours}.{p}") for theirs, ours in names for p in ("weight", "bias")]


def qkv_triples(c: Seq2SeqConfig) -> list[tuple[list[str], str]]:
    """([BART's q, k and v projection names], our stacked qkv_proj name), weights and biases."""
    out = []
    for side, n in (("encoder", c.n_encoder_layer), ("decoder", c.n_decoder_layer)):
        for i in range(n):
            for hf_attn, attn in attentions(side):
                theirs = f"{side}.layers.{i}.{hf_attn}"
                out += [([f"{theirs}.{x}_proj.{p}" for x in "qkv"], f"{side}.{i}.{attn}.qkv_proj.{p}")
                        for p in ("weight", "bias")]
    return out


def attentions(side: str) -> list[tuple[str, str]]:
    return [("self_attn", "self_attn")] + ([("encoder_attn", "cross_attn")] if side == "decoder" else [])


def unprefixed(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in hf_state.items()}


def token_embeddings(s: dict[str, torch.Tensor], tied: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's and the decoder's token tables: `shared` when tied (transformers ties the others to
    it); untied, each side's own `embed_tokens`, or `shared` where the checkpoint stores only that."""
    shared = s["shared.weight"] if "shared.weight" in s else s["encoder.embed_tokens.weight"]
    if tied:
        return shared, shared
    return s.get("encoder.embed_tokens.weight", shared), s.get("decoder.embed_tokens.weight", shared)


def convert_state_dict(hf_state: dict[str, torch.Tensor], c: Seq2SeqConfig) -> dict[str, torch.Tensor]:
    s = unprefixed(hf_state)
    enc, dec = token_embeddings(s, c.tie_embeddings)
    out = {"tok_emb.weight": enc,
           "logits_bias": s.get("final_logits_bias", torch.zeros(1, c.vocab_size)).reshape(-1),
           "enc_pos_emb.weight": s["encoder.embed_positions.weight"],
           "dec_pos_emb.weight": s["decoder.embed_positions.weight"]}
    out |= {ours: s[theirs] for theirs, ours in layer_pairs(c)}
    out |= {ours: torch.cat([s[name] for name in theirs]) for theirs, ours in qkv_triples(c)}
    if not c.share_embeddings:
        out["dec_tok_emb.weight"] = dec
    out["lm_head.weight"] = dec if c.tie_embeddings else s["lm_head.weight"]
    return {k: v.float() for k, v in out.items()}


# ---- ours -> BART ----------------------------------------------------------------------------------


def check_expressible(c: Seq2SeqConfig) -> None:
    needs = {"post-LN": c.norm_placement == "post", "a LayerNorm after the embeddings": c.embedding_norm,
             "one token embedding shared by both sides": c.share_embeddings, "biases": c.bias,
             "learned positions starting at row 2, or sinusoidal ones": c.pos_encoding == "sinusoidal"
             or c.position_offset == OFFSET}
    missing = [name for name, ok in needs.items() if not ok]
    if missing:
        raise Unsupported(f"BART cannot express this model: it needs {', '.join(missing)}")


def hf_config(c: Seq2SeqConfig) -> dict:
    check_expressible(c)
    positions = max(c.n_src_ctx, c.n_tgt_ctx)
    return {"architectures": [ARCHITECTURE], "model_type": "bart", "vocab_size": c.vocab_size, "d_model": c.d_model,
            "encoder_layers": c.n_encoder_layer, "decoder_layers": c.n_decoder_layer,
            "encoder_attention_heads": c.n_head, "decoder_attention_heads": c.n_head,
            "encoder_ffn_dim": c.d_ff, "decoder_ffn_dim": c.d_ff, "activation_function": HF_ACTIVATIONS[c.activation],
            "max_position_embeddings": positions, "scale_embedding": c.scale_embedding,
            "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "encoder_layerdrop": 0.0,
            "decoder_layerdrop": 0.0, "init_std": 0.02, "use_cache": True, "is_encoder_decoder": True,
            "pad_token_id": c.pad_token_id, "bos_token_id": c.bos_token_id if c.bos_token_id is not None
            else c.decoder_start_token_id, "eos_token_id": c.eos_token_id,
            "decoder_start_token_id": c.decoder_start_token_id, "forced_eos_token_id": None,
            "tie_word_embeddings": c.tie_embeddings, "torch_dtype": "float32",
            # the layout keys facebook/bart-* configs carry, which CTranslate2's converter reads
            "normalize_before": False, "normalize_embedding": True, "add_final_layer_norm": False,
            "static_position_embeddings": False, "add_bias_logits": False, "extra_pos_embeddings": OFFSET}


def hf_state_dict(model: EncoderDecoder) -> dict[str, torch.Tensor]:
    """Our weights under BART's names: the shared embedding once when the head is tied (transformers ties
    the rest); untied, the head as `lm_head` and copies of the shared table as both sides' `embed_tokens`."""
    c = model.config
    check_expressible(c)
    ours = {k: v.detach().float() for k, v in model.state_dict().items()}
    positions = max(c.n_src_ctx, c.n_tgt_ctx) + OFFSET
    out = {"model.shared.weight": ours["tok_emb.weight"],
           "final_logits_bias": ours["logits_bias"].reshape(1, -1) if c.final_logits_bias
           else torch.zeros(1, c.vocab_size)}
    if not c.tie_embeddings:  # copies: safetensors refuses tensors that share memory
        out |= {f"model.{side}.embed_tokens.weight": ours["tok_emb.weight"].clone() for side in ("encoder", "decoder")}
        out["lm_head.weight"] = ours["lm_head.weight"]
    for side, mine in (("encoder", "enc"), ("decoder", "dec")):
        table = torch.zeros(positions, c.d_model)
        if c.pos_encoding == "sinusoidal":
            rows = model.pos_table.float()
            table[OFFSET:OFFSET + len(rows)] = rows
        else:
            rows = ours[f"{mine}_pos_emb.weight"]
            table[:len(rows)] = rows
        out[f"model.{side}.embed_positions.weight"] = table
    out |= {f"model.{theirs}": ours[mine] for theirs, mine in layer_pairs(c)}
    for theirs, mine in qkv_triples(c):
        out |= {f"model.{name}": part for name, part in zip(theirs, ours[mine].split(c.d_model), strict=True)}
    return {k: v.contiguous() for k, v in out.items()}
