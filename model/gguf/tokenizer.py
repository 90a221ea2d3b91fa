"""A GGUF file's `tokenizer.ggml.*` metadata -> a Hugging Face `tokenizer.json` that splits text as
llama.cpp does, and the files beside it (special tokens, chat template, the ids that end generation).

Two tokenizer models are read:

    "gpt2"   byte-level BPE: `tokens`, `merges`, `token_type`; `pre` names llama.cpp's pre-tokenizer,
             whose regexes (src/llama-vocab.cpp) become a Sequence of `Split(isolated)` pre-tokenizers
             before the byte-level mapping, with no normaliser (llama.cpp has none).
    "llama"  SentencePiece BPE: `tokens`, `scores`, `token_type`. llama.cpp merges the adjacent pair
             whose joined piece has the highest score; BPE merges ranked by that score do the same.
             Spaces become "▁", a "▁" is prepended to every stretch of text (llama.cpp's
             add_space_prefix, after the start and after each special token), and a character with no
             piece falls back to its `<0xXX>` byte pieces.

Control and unknown tokens are special (matched in text, as `llama-tokenize` matches them), and so are the
tokens llama.cpp makes control tokens by their text (EOG_TEXTS: `<|im_end|>`, `<|eot_id|>`, ...), which also
end generation; user-defined tokens are matched in text too, but are not special. The BOS (and EOS) is added to every
encoding as `tokenizer.ggml.add_bos_token` (`add_eos_token`) says, or as llama.cpp defaults it when the
file does not say. A tokenizer model or pre-tokenizer name not listed here is refused by name.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


class PreTokenizer:
    """A llama.cpp pre-tokenizer: its regexes, applied one after another, and its BPE switches."""

    def __init__(self, regexes: list[str], ignore_merges: bool = False, add_bos: bool = False):
        self.regexes = regexes  # each splits the pieces the one before left, keeping matches and the rest
        self.ignore_merges = ignore_merges  # a piece that is a whole token is taken as it is, merges skipped
        self.add_bos = add_bos  # llama.cpp's default for add_bos_token when the file does not say


# tokenizer.ggml.pre -> llama.cpp's pre-tokenizer of that name (src/llama-vocab.cpp, llm_tokenizer_bpe)
PRE_TOKENIZERS = {
    "default": PreTokenizer([r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"]),
    "gpt-2": PreTokenizer([GPT2_REGEX]),
    "llama-bpe": PreTokenizer([LLAMA3_REGEX], ignore_merges=True, add_bos=True),
    "llama3": PreTokenizer([LLAMA3_REGEX], ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenizer([LLAMA3_REGEX], ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizer([QWEN2_REGEX]),
    "smollm": PreTokenizer([r"\p{N}", GPT2_REGEX]),
}
TOKENIZER_MODELS = ("gpt2", "llama")
# tokens that end generation by their text, whatever the file names its EOS (llama.cpp's llama-vocab.cpp list)
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                       "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                       "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                       "<｜end▁of▁sentence｜>", "[e~["})


class UnsupportedTokenizer(ValueError):
    """A tokenizer model or pre-tokenizer this importer does not build; the message names it."""


def ggml(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    return meta.get(f"tokenizer.ggml.{key}", default)


def token_types(meta: dict[str, Any]) -> list[int]:
    """tokenizer.ggml.token_type, with the tokens of EOG_TEXTS made control tokens (as llama.cpp makes them)."""
    tokens = ggml(meta, "tokens")
    types = ggml(meta, "token_type") or [NORMAL] * len(tokens)
    return [CONTROL if text in EOG_TEXTS else kind for text, kind in zip(tokens, types, strict=True)]


def build_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """The `tokenizers.Tokenizer` of a GGUF file's metadata (keys as written, values as Python values)."""
    kind = ggml(meta, "model")
    tokens: list[str] = ggml(meta, "tokens")
    if not tokens:
        raise UnsupportedTokenizer("the file has no vocabulary (tokenizer.ggml.tokens)")
    types = token_types(meta)
    if kind == "gpt2":
        hf, add_bos = byte_level_bpe(meta, tokens)
    elif kind == "llama":
        hf, add_bos = sentencepiece_bpe(meta, tokens, types)
    else:
        raise UnsupportedTokenizer(f"tokenizer.ggml.model {kind!r} is not supported (supported: "
                                   f"{', '.join(TOKENIZER_MODELS)})")
    hf.add_tokens([AddedToken(tokens[i], special=types[i] in (CONTROL, UNKNOWN), normalized=False)
                   for i in range(len(tokens)) if types[i] in (CONTROL, UNKNOWN, USER_DEFINED)])
    hf.post_processor = post_processor(meta, tokens, bool(ggml(meta, "add_bos_token", add_bos)),
                                       bool(ggml(meta, "add_eos_token", False)))
    return hf


def byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[HFTokenizer, bool]:
    pre_name = ggml(meta, "pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(f"tokenizer.ggml.pre {pre_name!r} (llama.cpp's BPE pre-tokenizer) is not supported "
                                   f"(supported: {', '.join(PRE_TOKENIZERS)})")
    pre = PRE_TOKENIZERS[pre_name]
    merges = [tuple(m.split(" ", 1)) for m in ggml(meta, "merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf, pre.add_bos


def sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[HFTokenizer, bool]:
    scores: list[float] = ggml(meta, "scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = ggml(meta, "unknown_token_id")
    hf = HFTokenizer(models.BPE(vocab, spm_merges(tokens, scores), unk_token=tokens[unk] if unk is not None else None,
                                fuse_unk=True, byte_fallback=BYTE in types))
    steps = [normalizers.Replace(" ", "▁")]
    if ggml(meta, "add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    hf.normalizer = normalizers.Sequence(steps)
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return hf, True


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the best-scored joined piece first (llama.cpp's order)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for joined, i in ids.items():
        for cut in range(1, len(joined)):
            left, right = joined[:cut], joined[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], i, ids[left], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def post_processor(meta: dict[str, Any], tokens: list[str], add_bos: bool, add_eos: bool):
    """BOS and EOS around every encoding, as the file asks (None when it adds neither)."""
    ends = [key for key, add in (("bos", add_bos), ("eos", add_eos)) if add]
    if not ends:
        return None
    for key in ends:
        if ggml(meta, f"{key}_token_id") is None:
            raise UnsupportedTokenizer(f"tokenizer.ggml.add_{key}_token is set but tokenizer.ggml.{key}_token_id "
                                       "is missing")
    named = {key: (tokens[ggml(meta, f"{key}_token_id")], ggml(meta, f"{key}_token_id")) for key in ends}
    bos = f"{named['bos'][0]}:0 " if add_bos else ""
    eos = f" {named['eos'][0]}:0" if add_eos else ""
    return processors.TemplateProcessing(single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos}$B:1{eos}".strip(),
                                         special_tokens=list(named.values()))


def tokenizer_files(meta: dict[str, Any]) -> dict[str, dict]:
    """tokenizer_config.json (the special tokens by name, the chat template) and generation_config.json (the
    ids that end generation, as llama.cpp's: EOS, end-of-turn / end-of-message where the file names them, and
    every control token of EOG_TEXTS)."""
    tokens = ggml(meta, "tokens")
    config: dict[str, Any] = {}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        if (i := ggml(meta, f"{key}_token_id")) is not None:
            config[name] = tokens[i]
    if (template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    eos = [i for key in ("eos", "eot", "eom") if (i := ggml(meta, f"{key}_token_id")) is not None]
    eos += [i for i, text in enumerate(tokens) if text in EOG_TEXTS]
    eos = list(dict.fromkeys(eos))
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos} if eos else {}
    if (bos := ggml(meta, "bos_token_id")) is not None:
        generation["bos_token_id"] = bos
    return {"tokenizer_config.json": config, "generation_config.json": generation}
