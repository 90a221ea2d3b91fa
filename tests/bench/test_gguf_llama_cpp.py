"""`attnserve import-gguf` against llama.cpp itself: GGUF files made by its converter (convert_hf_to_gguf.py)
from random Hugging Face checkpoints and quantized by its llama-quantize, imported, exported and served.

- F32: the served greedy tokens are transformers' own (Llama, Qwen2, Qwen3; a llama3 rope scaling, whose
  rope_freqs.weight becomes the config's scaling again, and yarn; Gemma 3 with its windows, Phi-3 with partial
  rotary and longrope, SmolLM3; Gemma 2, whose converter reads a SentencePiece tokenizer.model, with one
  trained in the converter's virtualenv).
- Q8_0, Q4_0, Q4_K_M: imported weights are the file's numbers dequantized, so the fair comparison is with
  llama.cpp computing on those same numbers: llama-quantize turns the quantized file back into F32 (its own
  dequantization), and llama-server's greedy tokens on that file must equal ours exactly. Against llama.cpp's
  quantized run itself (its activations rounded to 8 bits in every product) the check is top-1 agreement on
  teacher-forced positions: at each position of llama.cpp's own greedy continuation, our fp32 argmax must be
  the token llama.cpp chose, at AGREEMENT of them or more.
- The tokenizer: `llama-tokenize` on mixed text (unicode, digits, whitespace runs, special tokens) gives the
  ids our tokenizer.json gives, for each BPE pre-tokenizer we build and for a SentencePiece vocabulary.

Skipped, with the reason, where llama.cpp is not built or its converter's virtualenv is missing
(`make bench-llama-cpp`).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx2
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from bench.peers import llama_cpp  # noqa: E402
from export.bundle_writer import export_bundle  # noqa: E402
from model.checkpoint import load_model_dir  # noqa: E402
from model.gguf.import_gguf import import_gguf  # noqa: E402
from model.gguf.tokenizer import build_tokenizer  # noqa: E402
from model.training.tokenizer import train_bpe  # noqa: E402
from service.engine.config import EngineConfig  # noqa: E402
from service.engine.core import Engine  # noqa: E402
from service.runtime.tokenizer import Tokenizer  # noqa: E402
from tests.engine.harness import drive, greedy  # noqa: E402
from tests.model.gguf_files import byte_level_fields, sentencepiece_fields, write_gguf  # noqa: E402
from tests.model.hf_models import greedy_hf, greedy_hf_cached, save_random  # noqa: E402

NOT_BUILT = llama_cpp.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NOT_BUILT is not None, reason=f"{NOT_BUILT}")]
PROMPTS = [[52, 275, 12, 272, 292, 12], [120, 3, 3, 64, 250, 17, 9, 200, 41, 5, 88], [7]]
NEW_TOKENS = 24
# top-1 agreement with llama.cpp's quantized run, over 72 positions; measured: Llama 67, 71 and 65 of 72 (Q8_0,
# Q4_0, Q4_K_M), Qwen2 72 and 71 (Q8_0, Q4_0). These random models have near ties (log-probabilities 1e-3 apart)
# that 8-bit activations flip; a wrong weight or row order agrees at about 1 in the vocabulary's 300.
AGREEMENT = {"q8_0": 0.85, "q4_0": 0.85, "q4_k_m": 0.8}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXTS = ["Rom.\nBut soft, what light through yonder window breaks?",
         "  It's the east -- 1234567 tomorrow!\n\n\n   and 3.14159, 1,000,000 (42)",
         "Ünïcödé façade, naïve café: 日本語のテキスト 🙂👍🏽 Ελληνικά русский\t\ttabs   and  spaces  ",
         "don't WE'LL you've I'm\r\nwindows\r\n\r\nlines   ",
         "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n", " leading space<|endoftext|>x",
         "a <tool>call</tool><|eot_id|>  <|eot_id|>\n"]


def run(cmd: list[str], log: Path) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"{cmd[0]} failed; the end of {log}:\n{log.read_text()[-2000:]}"


def quantize(src: Path, kind: str, out: Path, requantize: bool = False) -> Path:
    """llama-quantize `src` to `kind` (a llama.cpp type name: Q8_0, Q4_0, Q4_K_M, F32)."""
    bin_dir, _ = llama_cpp.where()
    run([str(bin_dir / "llama-quantize"), *(["--allow-requantize"] if requantize else []), str(src), str(out), kind,
         "2"], out.with_suffix(".log"))
    return out


def llama_cpp_greedy(gguf_file: Path, prompts: list[list[int]], n: int, log: Path) -> list[list[int]]:
    """llama-server's greedy ids after each prompt (prompt ids as they are: no BOS added), `n` of them: its
    `ignore_eos` takes the end-of-generation tokens out of the choice. Attention and the KV cache in float32,
    so that only the weights' and activations' rounding differ from ours."""
    bin_dir, _ = llama_cpp.where()
    server = llama_cpp.LlamaServer(bin_dir, gguf_file, llama_cpp.SLOTS * 128, 2, log)
    # in float32 throughout: its defaults keep the KV cache in float16 and, with flash attention, round the
    # queries to float16 too
    server.args += ["--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off"]
    with server:
        out = []
        for prompt in prompts:
            r = httpx2.post(f"{server.url}/completion", json=llama_cpp.request_body(prompt, n, stream=False),
                            timeout=120.0)
            r.raise_for_status()
            out.append(r.json()["tokens"])
    return out


def served_greedy(bundle: Path, prompts: list[list[int]], n: int, eos_chosen: bool = True) -> list[list[int]]:
    """Our served greedy ids, `n` after each prompt: EOS chosen and gone past (as transformers does), or,
    with `eos_chosen` False, never chosen (as llama.cpp's `ignore_eos` does it)."""
    stopping = dict(ignore_eos=True) if eos_chosen else dict(min_new_tokens=n)
    requests = [greedy(f"r{i}", p, n, **stopping) for i, p in enumerate(prompts)]
    run_ = drive(Engine(EngineConfig(bundle=bundle, graph="static", max_running=4, max_batch_tokens=64)), requests)
    return [run_.tokens(r.request_id) for r in requests]


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3-rope", "qwen2-yarn", "qwen3"])
def family(request, tiny_tokenizer, tmp_path_factory):
    """(family, transformers model, work folder, the converter's F32 GGUF)."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    overrides = dict(hidden_size=256, intermediate_size=512) if request.param == "llama" else {}
    hf = save_random(root / "hf", tiny_tokenizer, request.param, **overrides)  # llama: rows K-quants can hold
    eos = tiny_tokenizer.hf.id_to_token(tiny_tokenizer.eos_id)
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos, "chat_template": TEMPLATE}))
    return request.param, hf, root, llama_cpp.convert(root / "hf", root, "f32")


# what each family's converter keeps: Gemma's query scale as llama.cpp takes it (1/sqrt(head size)) and its
# layer pattern as llama.cpp's default (every 6th layer full; the converter writes none), SmolLM3's blocks without
# rotary positions where llama.cpp has them (every 4th); Phi-3's converter reads a GPT2Tokenizer's vocabulary
CONVERTED = {"gemma2": dict(query_pre_attn_scalar=16),
             "gemma3": dict(query_pre_attn_scalar=32, sliding_window_pattern=6), "phi3": {},
             "phi4-mini-longrope": {}, "smollm3": dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])}


def add_sentencepiece_model(hf_dir: Path, texts: list[str]) -> None:
    """A SentencePiece tokenizer.model learnt on `texts` (byte fallback), trained by the converter's own
    virtualenv, which has sentencepiece."""
    (hf_dir / "texts.txt").write_text("\n".join(texts))
    train = ("import sentencepiece as spm, sys; spm.SentencePieceTrainer.train(input=sys.argv[1], "
             "model_prefix=sys.argv[2], vocab_size=300, model_type='bpe', byte_fallback=True, hard_vocab_limit=False)")
    run([str(llama_cpp.CONVERTER_PYTHON), "-c", train, str(hf_dir / "texts.txt"), str(hf_dir / "tokenizer")],
        hf_dir / "sentencepiece.log")


@pytest.fixture(scope="module", params=list(CONVERTED))
def newer_family(request, tiny_tokenizer, tmp_path_factory):
    """(family, transformers model, work folder, the converter's F32 GGUF) of the Gemma 2/3, Phi-3 and SmolLM3
    families."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    hf = save_random(root / "hf", tiny_tokenizer, request.param, **CONVERTED[request.param])
    if request.param == "gemma2":  # its converter reads the vocabulary from a SentencePiece model only
        add_sentencepiece_model(root / "hf", TEXTS[:2] * 4)  # ASCII: 256 bytes and its letters fit in 300
    eos = tiny_tokenizer.hf.id_to_token(tiny_tokenizer.eos_id)
    tokenizer_class = "GPT2Tokenizer" if request.param.startswith("phi") else "PreTrainedTokenizerFast"
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "bos_token": eos, "eos_token": eos, "chat_template": TEMPLATE}))
    return request.param, hf, root, llama_cpp.convert(root / "hf", root, "f32")


def imported_bundle(gguf_file: Path, root: Path) -> tuple[Path, Path]:
    name = gguf_file.stem
    import_gguf(gguf_file, root / f"{name}-model")
    export_bundle(root / f"{name}-model", root / f"{name}-bundle", name=name)
    return root / f"{name}-model", root / f"{name}-bundle"


def test_an_f32_gguf_is_served_as_transformers_generates(family):
    name, hf, root, f32 = family
    model_dir, bundle = imported_bundle(f32, root)
    assert served_greedy(bundle, PROMPTS, NEW_TOKENS) == [greedy_hf(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert json.loads((bundle / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE


def test_an_f32_gguf_of_the_newer_families_is_served_as_transformers_generates(newer_family):
    """Prompts and continuations cross Gemma's windows of 8 and the longrope original context of 32 (where a
    cached generation keeps the keys it rotated with the short factors, as transformers' cached one does)."""
    name, hf, root, f32 = newer_family
    model_dir, bundle = imported_bundle(f32, root)
    c, _ = load_model_dir(model_dir)
    assert (c.config.sliding_window, c.config.no_rotary_layers, c.config.rotary_dim) == {
        "gemma2": (8, None, 16), "gemma3": (8, None, 32), "phi3": (None, None, 12), "phi4-mini-longrope": (None, None, 12),
        "smollm3": (None, [3], 16)}[name]
    reference = greedy_hf_cached if "longrope" in name else greedy_hf
    assert served_greedy(bundle, PROMPTS, NEW_TOKENS) == [reference(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_k_m"])
def test_a_quantized_gguf_is_served_as_llama_cpp_computes_on_its_numbers(family, kind):
    name, hf, root, f32 = family
    if name not in ("llama", "qwen2"):
        pytest.skip("rope scalings and Qwen3 are checked at F32; their weights quantize as the llama and qwen2 ones")
    if kind == "q4_k_m" and name != "llama":
        pytest.skip("K-quants need rows of 256: the llama model only")
    quantized = quantize(f32, kind.upper(), root / f"{name}-{kind}.gguf")
    held = {t.tensor_type.name for t in gguf.GGUFReader(quantized).tensors}
    assert {"q8_0": {"Q8_0"}, "q4_0": {"Q4_0"}, "q4_k_m": {"Q4_K", "Q6_K"}}[kind] <= held
    model_dir, bundle = imported_bundle(quantized, root)
    ours = served_greedy(bundle, PROMPTS, NEW_TOKENS, eos_chosen=False)

    dequantized = quantize(quantized, "F32", root / f"{name}-{kind}-as-f32.gguf", requantize=True)
    assert ours == llama_cpp_greedy(dequantized, PROMPTS, NEW_TOKENS, root / f"{name}-{kind}-f32-server.log")

    theirs = llama_cpp_greedy(quantized, PROMPTS, NEW_TOKENS, root / f"{name}-{kind}-server.log")
    model, _ = load_model_dir(model_dir)
    agree = total = 0
    for prompt, continuation in zip(PROMPTS, theirs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + continuation]))[0, len(prompt) - 1:-1]
        logits[:, model.config.eos_token_id] = -torch.inf  # as llama.cpp's ignore_eos
        agree += int((logits.argmax(-1) == torch.tensor(continuation)).sum())
        total += len(continuation)
    assert agree / total >= AGREEMENT[kind], f"{kind}: top-1 agreement {agree}/{total}"


def llama_tokenize(gguf_file: Path, text: str, tmp: Path) -> list[int]:
    bin_dir, _ = llama_cpp.where()
    (tmp / "text.txt").write_bytes(text.encode())
    done = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf_file), "-f", str(tmp / "text.txt"), "--ids",
                           "--no-escape", "--log-disable"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llama_tokenize_built():
    bin_dir, _ = llama_cpp.where()
    if not (bin_dir / "llama-tokenize").is_file():
        pytest.skip("llama-tokenize not built: make bench-llama-cpp")


@pytest.fixture(scope="module")
def mixed_tokenizer() -> Tokenizer:
    """A byte-level BPE learnt on the mixed texts, so that digits, accents and whitespace runs have merges."""
    return Tokenizer(train_bpe(TEXTS * 4, vocab_size=600, min_frequency=1))


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "default", "smollm"])
def test_byte_level_tokenization_is_llama_tokenizes(llama_tokenize_built, mixed_tokenizer, tmp_path, pre):
    fields = byte_level_fields(mixed_tokenizer, pre=pre, control=("<|im_start|>", "<|im_end|>"),
                               user_defined=("<tool>", "<|eot_id|>"))  # llama.cpp makes the second control
    path = write_gguf(tmp_path / "vocab.gguf", "llama", fields)
    ours = build_tokenizer(gguf_metadata(path))
    for text in TEXTS + [t.upper() for t in TEXTS]:
        assert ours.encode(text).ids == llama_tokenize(path, text, tmp_path), (pre, text)


def test_sentencepiece_tokenization_is_llama_tokenizes(llama_tokenize_built, tmp_path):
    fields = sentencepiece_fields([t.replace("<|im_start|>", "").replace("<|im_end|>", "") for t in TEXTS] * 4)
    path = write_gguf(tmp_path / "vocab.gguf", "llama", fields)
    ours = build_tokenizer(gguf_metadata(path))
    for text in TEXTS + ["<s>ab</s> cd", "", " ", "plain"]:
        want = llama_tokenize(path, text, tmp_path)
        assert ours.encode(text).ids == want, text
        assert want[0] == 1  # llama.cpp's SentencePiece default: the BOS first


def test_the_converters_tokenizer_is_llama_tokenizes(llama_tokenize_built, family, tmp_path):
    name, hf, root, f32 = family
    model_dir = root / f"{f32.stem}-model"
    if not model_dir.is_dir():
        import_gguf(f32, model_dir)
    ours = Tokenizer.from_file(model_dir / "tokenizer.json")
    for text in TEXTS:
        assert ours.encode(text) == llama_tokenize(f32, text, tmp_path), text


def gguf_metadata(path: Path) -> dict:
    from model.gguf.import_gguf import metadata

    return metadata(gguf.GGUFReader(path))
