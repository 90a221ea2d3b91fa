"""The server's tokenization and streamed text equal transformers', for the kinds of tokenizer the
Llama family uses: SentencePiece-style BPE with byte fallback (Llama 2, TinyLlama, Phi-3: `▁` word prefixes,
`<0xE2>` byte pieces; Gemma's variant: spaces as `▁` with no prefix added or stripped) and byte-level BPE
(Llama 3, SmolLM2, SmolLM3), each adding a BOS token, and transformers' own `Qwen2Tokenizer` (Qwen2, Qwen3: NFC, Qwen's split pattern, byte-level, no BOS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from service.engine.detokenizer import TextStream  # noqa: E402
from service.runtime.tokenizer import Tokenizer  # noqa: E402

CORPUS = ["Hello world, this is a test of the tokenizer.", "To be, or not to be: that is the question.",
          "But soft, what light through yonder window breaks?"] * 20
TEXTS = ["Hello world", "naïve café, 東京 😀!", "  leading spaces and\ttabs\nnewlines", "x", "<s> literal"]


def sentencepiece_style(tmp_path: Path, gemma: bool = False) -> HFTokenizer:
    """BPE over `▁`-prefixed words whose vocabulary also holds the 256 byte pieces `<0x00>`...`<0xFF>` as
    ordinary tokens (not special ones), for the characters its merges do not cover: Llama 2's layout. With
    `gemma`, Gemma's: spaces become `▁` but no `▁` is prepended nor stripped, `<pad> <eos> <bos> <unk>` first."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] if gemma else ["<unk>", "<s>", "</s>"]
    bos = specials[2] if gemma else "<s>"
    trained = HFTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁") if gemma else \
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=specials,
                                                            show_progress=False))
    vocab_file, merges_file = trained.model.save(str(tmp_path))
    vocab = json.loads(Path(vocab_file).read_text())
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(line.split()) for line in Path(merges_file).read_text().splitlines()[1:] if line.strip()]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = trained.normalizer
    strip = [] if gemma else [decoders.Strip(" ", 1, 0)]
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return tok


def byte_level(tmp_path: Path) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])])
    return tok


def qwen_class(tmp_path: Path):
    """transformers' Qwen2Tokenizer (Qwen3's too) over a vocabulary and merges trained here, saved as that class."""
    trained = byte_level(tmp_path)
    vocab_file, merges_file = trained.model.save(str(tmp_path))
    merges = [tuple(line.split()) for line in Path(merges_file).read_text().splitlines()[1:] if line.strip()]
    vocab = {"<|endoftext|>": 0, **{t: i for t, i in json.loads(Path(vocab_file).read_text()).items() if i > 1}}
    return transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>")


KINDS = {"sentencepiece-byte-fallback": (sentencepiece_style, "<s>", "</s>"),
         "gemma": (lambda path: sentencepiece_style(path, gemma=True), "<bos>", "<eos>"),
         "byte-level": (byte_level, "<|begin_of_text|>", "<|end_of_text|>"),
         "qwen2-tokenizer": (qwen_class, None, "<|endoftext|>")}


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request, tmp_path_factory):
    """(ours, transformers' AutoTokenizer) over one tokenizer.json, saved as transformers saves it."""
    build, bos, eos = KINDS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    made = build(path)
    if isinstance(made, HFTokenizer):  # a bare tokenizers object: saved through the generic class
        made = transformers.PreTrainedTokenizerFast(tokenizer_object=made, bos_token=bos, eos_token=eos)
    made.save_pretrained(path)
    auto = transformers.AutoTokenizer.from_pretrained(path)
    return Tokenizer.from_file(path / "tokenizer.json", eos_id=auto.eos_token_id), auto


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_equals_transformers_with_the_bos(pair, text):
    ours, auto = pair
    assert ours.encode(text) == auto(text).input_ids
    if auto.bos_token_id is not None:
        assert ours.encode(text)[0] == auto.bos_token_id


def completion(auto, text: str) -> list[int]:
    """The ids of `text` as a model would generate them: without the BOS the tokenizer adds, if any."""
    ids = auto(text).input_ids
    return ids[1:] if auto.bos_token_id is not None else ids


def stream(ours: Tokenizer, ids: list[int], stop: list[str] | None = None) -> tuple[str, bool]:
    text = TextStream(ours, stop)
    deltas, stopped = [], False
    for i in ids:
        delta, stopped = text.push(i)
        deltas.append(delta)
        if stopped:
            return "".join(deltas), True
    tail, stopped = text.finish()
    return "".join(deltas) + tail, stopped


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_transformers_decode(pair, text):
    ours, auto = pair
    ids = completion(auto, text)
    assert stream(ours, ids)[0] == auto.decode(ids, skip_special_tokens=True)


def test_byte_pieces_split_across_tokens_and_invalid_bytes(pair):
    ours, auto = pair
    ids = completion(auto, "東京 😀")
    for cut in range(1, len(ids)):  # every prefix of a completion, complete characters or not
        assert stream(ours, ids[:cut])[0] == auto.decode(ids[:cut], skip_special_tokens=True)
    if ours.hf.token_to_id("<0xE2>") is not None:  # an invalid run of byte pieces: U+FFFD per byte, as transformers
        lone = [ours.hf.token_to_id("<0xE2>"), ours.hf.token_to_id("<0x41>"), ours.hf.token_to_id("▁the")]
        assert stream(ours, lone)[0] == auto.decode(lone) == "\ufffd\ufffd the"


def test_a_stop_string_across_byte_pieces(pair):
    ours, auto = pair
    ids = completion(auto, "say 東京 now")
    text, stopped = stream(ours, ids, stop=["京 n"])
    assert stopped and text == "say 東"
