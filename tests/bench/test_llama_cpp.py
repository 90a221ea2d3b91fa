"""llama.cpp as a peer (bench.peers.llama_cpp): the converter's inputs everywhere; with llama.cpp built
(`make bench-llama-cpp`), the tiny lively model through convert and one short server run, whose greedy
ids must be transformers' for the same prompt ids (no BOS, no repetition penalty, exactly N tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.peers import llama_cpp
from bench.peers.llama_cpp_convert import is_gpt2_pre_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_TOKENIZER = ROOT / "models" / "shakespeare" / "tokenizer.json"
NOT_BUILT = llama_cpp.available()
needs_llama_cpp = pytest.mark.skipif(NOT_BUILT is not None, reason=f"{NOT_BUILT}")


def test_gpt2_pre_tokenizer_is_recognised_by_its_shape_alone(tmp_path):
    assert is_gpt2_pre_tokenizer(SHIPPED_TOKENIZER)
    spec = json.loads(SHIPPED_TOKENIZER.read_text())
    for pre in ({**spec["pre_tokenizer"], "add_prefix_space": True}, {**spec["pre_tokenizer"], "use_regex": False},
                {"type": "Sequence", "pretokenizers": [spec["pre_tokenizer"]]}, {"type": "Whitespace"}):
        other = tmp_path / "tokenizer.json"
        other.write_text(json.dumps({**spec, "pre_tokenizer": pre}))
        assert not is_gpt2_pre_tokenizer(other), pre
    assert not is_gpt2_pre_tokenizer(tmp_path / "missing.json")


def test_a_gpt2_config_without_n_ctx_is_converted_from_a_local_copy_that_has_it(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64, "n_embd": 32}))
    (hf / "model.safetensors").write_bytes(b"weights")
    local = llama_cpp.converter_input(hf, tmp_path / "work")
    assert local != hf
    assert json.loads((local / "config.json").read_text()) == {"model_type": "gpt2", "n_positions": 64,
                                                               "n_embd": 32, "n_ctx": 64}
    assert (local / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((hf / "config.json").read_text()).get("n_ctx") is None  # the original is left alone
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64, "n_ctx": 64}))
    assert llama_cpp.converter_input(hf, tmp_path / "work") == hf


def test_a_tokenizer_json_alone_is_read_as_the_plain_fast_tokenizer_by_the_converter(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"model_type": "llama", "vocab_size": 32}
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "tokenizer.json").write_text("{}")
    local = llama_cpp.converter_input(hf, tmp_path / "work")
    assert json.loads((local / "tokenizer_config.json").read_text()) == {"tokenizer_class": "PreTrainedTokenizerFast"}
    assert json.loads((local / "config.json").read_text()) == config
    assert (local / "tokenizer.json").read_text() == "{}"
    assert not (hf / "tokenizer_config.json").exists()  # the original is left alone
    (hf / "tokenizer_config.json").write_text("{}")
    assert llama_cpp.converter_input(hf, tmp_path / "work") == hf


def test_precisions_map_to_llama_cpp_types_and_the_protocol_names():
    assert llama_cpp.llama_type("fp32") == llama_cpp.llama_type("f32") == "f32"
    assert [llama_cpp.PRECISIONS[p][1] for p in ("f32", "f16", "q8_0", "q4_0")] == ["fp32", "f16", "q8_0", "q4_0"]
    with pytest.raises(ValueError, match="int8"):
        llama_cpp.llama_type("int8")


@pytest.fixture(scope="module")
def lively_hf(lively_model_dir, tmp_path_factory) -> Path:
    from model.hf.export_hf import export_hf

    return export_hf(lively_model_dir, tmp_path_factory.mktemp("llama_cpp") / "hf")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Where the GGUFs are kept: each is converted once for the module (convert() caches by path)."""
    return tmp_path_factory.mktemp("llama_cpp_work")


def greedy_transformers(hf_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                                       max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            out.append(generated[0, len(prompt):].tolist())
    return out


@needs_llama_cpp
@pytest.mark.slow
def test_convert_writes_each_gguf_once(lively_hf, work):
    for precision in ("f32", "q8_0"):
        gguf = llama_cpp.convert(lively_hf, work, precision)
        assert gguf.read_bytes()[:4] == b"GGUF"
        made = gguf.stat().st_mtime_ns
        assert llama_cpp.convert(lively_hf, work, precision) == gguf
        assert gguf.stat().st_mtime_ns == made
    assert (work / "hf-q8_0.gguf").stat().st_size < (work / "hf-f32.gguf").stat().st_size


@needs_llama_cpp
@pytest.mark.slow
def test_server_greedy_tokens_are_transformers_greedy_tokens(lively_hf, work):
    prompts = [[5, 17, 42, 99, 7, 250], [120, 3, 3, 64]]
    spec = {"new_tokens": 4, "single": prompts[:1], "streams": prompts, "repeats": 1}
    result = llama_cpp.measure(lively_hf, work, "f32", spec, "server")
    want = greedy_transformers(lively_hf, prompts, 4)
    assert result["tokens"] == want and result["single_tokens"] == want[:1]  # among 2, and the first alone
    assert result["system"] == "llama.cpp server" and result["precision"] == "fp32"
    assert result["streams"]["n"] == 2
    for figures in (result["single"]["tokens_per_s"], result["single"]["ttft_s"], result["streams"]["tokens_per_s"],
                    result["streams"]["ttft_p50_s"], result["streams"]["ttft_p99_s"]):
        assert len(figures) == 1 and figures[0] > 0
    assert result["peak_rss_bytes"] > 0
    assert result["settings"]["parallel"] == 32 and result["settings"]["request"]["repeat_penalty"] == 1.0
    assert "llama.cpp" in result["versions"]


@needs_llama_cpp
@pytest.mark.slow
def test_llama_cpp_tokenizes_text_as_ours(lively_hf, work, tmp_path):
    """The pre-tokenizer named 'gpt-2' by bench/peers/llama_cpp_convert.py splits text as our tokenizer does."""
    import httpx2

    from service.runtime.tokenizer import Tokenizer

    gguf = llama_cpp.convert(lively_hf, work, "f32")
    bin_dir, _ = llama_cpp.where()
    ours = Tokenizer.from_file(lively_hf / "tokenizer.json")
    texts = ["Rom.\nBut soft, what light through yonder window breaks?", "  It's the east -- 1234 tomorrow!\n\n"]
    with llama_cpp.LlamaServer(bin_dir, gguf, 1024, 1, tmp_path / "server.log") as server:
        for text in texts:
            got = httpx2.post(f"{server.url}/tokenize", json={"content": text, "add_special": False}).json()
            assert got["tokens"] == ours.encode(text), text


@needs_llama_cpp
@pytest.mark.slow
def test_batched_bench_reports_batch_1_and_all_streams(lively_hf, work):
    spec = {"new_tokens": 4, "single": [[1, 2, 3, 4]], "streams": [[5, 6, 7, 8], [9, 10, 11, 12]], "repeats": 1}
    result = llama_cpp.measure(lively_hf, work, "q8_0", spec, "batched-bench")
    assert result["system"] == "llama.cpp batched-bench" and result["precision"] == "q8_0"
    assert result["tokens"] is None and result["single_tokens"] is None and result["single"]["ttft_s"] is None
    assert result["single"]["tokens_per_s"][0] > 0 and result["streams"]["tokens_per_s"][0] > 0
    assert result["streams"]["n"] == 2 and result["settings"]["ntg"] == 3 and result["peak_rss_bytes"] > 0
