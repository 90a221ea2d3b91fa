"""The configuration of an encoder-decoder Transformer ("Attention Is All You Need", and BART).

`Seq2SeqConfig` is written next to the weights as `config.json`, like `GPTConfig`, with
`"kind": "encoder-decoder"` so a model directory says which of the two it holds. The fields choose
what the paper and its descendants vary: sinusoidal or learned positions, post-LN (the paper, BART)
or pre-LN, one token embedding for both sides or two, an output head tied to the decoder's
embedding, embeddings scaled by √d_model (the paper) or not (BART), a norm after the embeddings
(BART's `layernorm_embedding`), and a bias on the final logits (BART's `final_logits_bias`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from model.json_config import JsonConfig

KIND = "encoder-decoder"


@dataclass
class Seq2SeqConfig(JsonConfig):
    vocab_size: int = 128  # token ids of both sides: one vocabulary, so ids mean the same in source and target
    n_src_ctx: int = 64  # longest source sequence the encoder reads
    n_tgt_ctx: int = 64  # longest target sequence, the decoder start token included
    n_encoder_layer: int = 3
    n_decoder_layer: int = 3
    n_head: int = 4  # attention heads of every attention (self and cross)
    d_model: int = 256  # width of the residual streams
    d_ff: int = 1024  # hidden width of the feed-forward
    dropout: float = 0.0  # on the embeddings, each residual branch and the feed-forward's hidden layer
    attn_dropout: float = 0.0  # on the attention weights
    bias: bool = True  # biases in the linear layers and the norms
    layer_norm_eps: float = 1e-5
    norm_placement: Literal["post", "pre"] = "post"  # post: x = Norm(x + F(x)), the paper; pre: x + F(Norm(x))
    pos_encoding: Literal["sinusoidal", "learned"] = "sinusoidal"
    position_offset: int = 0  # learned tables start at this row (BART's start at 2)
    activation: Literal["relu", "gelu", "gelu_tanh"] = "relu"  # the feed-forward's (the paper: ReLU)
    share_embeddings: bool = True  # the encoder and the decoder read one token embedding
    tie_embeddings: bool = True  # the output head is the decoder's token embedding
    scale_embedding: bool = True  # token embeddings × √d_model, as in the paper
    embedding_norm: bool = False  # a LayerNorm after token + position embeddings (BART)
    final_logits_bias: bool = False  # a learned bias on the logits (BART)
    pad_token_id: int = 0  # the id that pads a batch of sources
    bos_token_id: int | None = None  # beginning of sequence, when the tokenizer adds one to sources
    eos_token_id: int = 2  # ends a target (and a source, when the tokenizer appends one)
    decoder_start_token_id: int = 1  # the first decoder input of every target
    architecture: str = "transformer"  # what it is, for clients: "transformer" (the paper's layout) or "bart"
    kind: str = KIND

    def __post_init__(self) -> None:
        if self.kind != KIND:
            raise ValueError(f"a Seq2SeqConfig has kind {KIND!r}, got {self.kind!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        for name, allowed in (("norm_placement", ("post", "pre")), ("pos_encoding", ("sinusoidal", "learned")),
                              ("activation", ("relu", "gelu", "gelu_tanh"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} is outside the vocabulary of {self.vocab_size}")
        if self.pos_encoding == "sinusoidal" and self.position_offset:
            raise ValueError("position_offset applies to learned positions only")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head


def is_seq2seq(config_path: str | Path) -> bool:
    """Does this config.json describe an encoder-decoder model?"""
    return json.loads(Path(config_path).read_text()).get("kind") == KIND
