"""`attnserve import-gguf` without llama.cpp: GGUF files written in the test with gguf.GGUFWriter (names from
gguf's own TensorNameMap, the llama q/k rows permuted as llama.cpp's converter permutes them), imported and
compared with transformers; the q/k un-permutation, the tensor names, the tokenizers built from the metadata,
and what is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model_dir  # noqa: E402
from model.generate import generate  # noqa: E402
from model.gguf import architectures  # noqa: E402
from model.gguf.import_gguf import import_gguf, main  # noqa: E402
from model.gguf.tokenizer import build_tokenizer, spm_merges, tokenizer_files  # noqa: E402
from tests.model.gguf_files import (  # noqa: E402
    BYTE,
    CONTROL,
    NORMAL,
    byte_level_fields,
    checkpoint_tensors,
    llama3_rope_freqs,
    permute,
    write_gguf,
)
from tests.model.hf_models import greedy_hf, greedy_hf_cached, save_random  # noqa: E402

Q = gguf.GGMLQuantizationType
MIXED_TEXTS = ["Rom.\nBut soft, what light through yonder window breaks?", "  It's the east -- 1234567 tomorrow!\n\n",
               "Ünïcödé façade, naïve café: 日本語 🙂👍🏽\t\ttabs   and  spaces  ", "don't WE'LL 3.14159 1,000,000\r\n"]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"


def meta_of(fields: dict) -> dict:
    return {f"tokenizer.ggml.{k}": v for k, v in fields.items()}


@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_unpermute_undoes_the_converters_permute(n_head):
    rng = np.random.default_rng(0)
    for shape in [(n_head * 8, 12), (n_head * 8,)]:
        w = rng.standard_normal(shape).astype(np.float32)
        permuted = permute(w, n_head)
        assert not np.array_equal(permuted, w)  # the rows did move
        np.testing.assert_array_equal(architectures.unpermute(permuted, n_head), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3"])
def test_every_tensor_name_maps_back_to_its_hugging_face_name(arch):
    """gguf's TensorNameMap (what the converter names a tensor) and our table agree both ways."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 3)
    hf = ["model.embed_tokens.weight", "model.norm.weight"]
    if gguf.MODEL_TENSOR.OUTPUT in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]:  # Gemma 2: always tied
        hf.append("lm_head.weight")
    hf += [f"model.layers.2.{n}" for n in architectures.ARCHITECTURES[arch].block_names.values()]
    for name in hf:
        ours = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert architectures.hf_name(arch, ours) == name, (name, ours)


@pytest.mark.parametrize("family,arch", [("llama", "llama"), ("qwen2", "qwen2")])
def test_an_f32_gguf_imports_to_transformers_logits(tiny_tokenizer, tmp_path, family, arch):
    hf = save_random(tmp_path / "hf", tiny_tokenizer, family)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    fields = {**byte_level_fields(tiny_tokenizer), "chat_template": TEMPLATE}
    path = write_gguf(tmp_path / "m.gguf", arch, fields, config, checkpoint_tensors(tmp_path / "hf"))
    assert main([str(path), "-o", str(tmp_path / "ours")]) == 0
    ours, tok = load_model_dir(tmp_path / "ours")
    c = ours.config
    assert (c.n_layer, c.n_head, c.kv_heads, c.d_model, c.ff_width, c.n_ctx, c.tie_embeddings, c.qkv_bias) == (
        2, 4, 2, 64, 96, 128, family == "qwen2", family == "qwen2")
    text = "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace"
    assert tok.encode(text) == tiny_tokenizer.encode(text)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    prompt = ids[0, :6].tolist()
    assert generate(ours, [prompt], 24, temperature=0.0)[0] == greedy_hf(hf, prompt, 24)
    assert json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert json.loads((tmp_path / "ours" / "generation_config.json").read_text())["eos_token_id"] == 0


@pytest.mark.parametrize("family,arch", [("qwen3", "qwen3"), ("qwen2-yarn", "qwen2"), ("llama-linear-rope", "llama")])
def test_head_width_norms_and_rope_scalings_import_to_transformers_logits(tiny_tokenizer, tmp_path, family, arch):
    """Qwen3's head width and query/key norms, and the rope scalings the metadata names (yarn, linear)."""
    hf = save_random(tmp_path / "hf", tiny_tokenizer, family)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    path = write_gguf(tmp_path / "m.gguf", arch, byte_level_fields(tiny_tokenizer), config,
                      checkpoint_tensors(tmp_path / "hf"))
    import_gguf(path, tmp_path / "ours")
    ours, _ = load_model_dir(tmp_path / "ours")
    ids = torch.tensor([list(range(3, 120))])  # past the original context of the scaled ones
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4


# (family, GGUF architecture, overrides): Gemma's query scale as llama.cpp takes it (1/sqrt(head size)), SmolLM3's
# blocks without rotary positions where llama.cpp has them (every 4th)
CONVERTED_FAMILIES = [
    ("gemma2", "gemma2", dict(query_pre_attn_scalar=16)),
    ("gemma3", "gemma3", dict(query_pre_attn_scalar=32)),
    ("phi3", "phi3", {}),
    ("phi4-mini-longrope", "phi3", {}),
    ("smollm3", "smollm3", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])),
]


@pytest.mark.parametrize("family,arch,overrides", CONVERTED_FAMILIES, ids=[f[0] for f in CONVERTED_FAMILIES])
def test_gemma_phi3_and_smollm3_ggufs_import_to_transformers_logits(tiny_tokenizer, tmp_path, family, arch,
                                                                     overrides):
    """Gemma's +1 norms, windows, softcaps and local rotary base; Phi-3's fused projections, partial rotary and
    longrope factor tensors; SmolLM3's blocks without rotary positions; generation past the windows of 8 and
    the longrope original context of 32."""
    hf = save_random(tmp_path / "hf", tiny_tokenizer, family, **overrides)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    path = write_gguf(tmp_path / "m.gguf", arch, byte_level_fields(tiny_tokenizer), config,
                      checkpoint_tensors(tmp_path / "hf"))
    import_gguf(path, tmp_path / "ours")
    ours, _ = load_model_dir(tmp_path / "ours")
    c = ours.config
    assert (c.sliding_window, c.layer_types) == (config.get("sliding_window") if arch.startswith("gemma") else None,
                                                 config.get("layer_types") if arch.startswith("gemma") else None)
    assert c.no_rotary_layers == ([3] if arch == "smollm3" else None)
    # transformers rotates every position of a call past longrope's original context with the long factors
    ids = torch.tensor([list(range(3, 35 if "longrope" in family else 120))])
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    prompt = ids[0, :6].tolist()
    # past longrope's switch, a cached generation keeps the keys it rotated with the short factors, as ours does
    reference = greedy_hf_cached if "longrope" in family else greedy_hf
    assert generate(ours, [prompt], 32, temperature=0.0)[0] == reference(hf, prompt, 32)


def gguf_meta(arch: str, **keys) -> dict:
    """The `<arch>.*` metadata of a tiny model with `keys` (under `<arch>.`) added."""
    base = {"block_count": 3, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
            "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-6}
    return {f"{arch}.{k}": v for k, v in {**base, **keys}.items()}


def test_windows_follow_the_files_pattern_and_llama_cpps_defaults():
    shapes = {"token_embd.weight": (50, 32)}
    sliding, full = "sliding_attention", "full_attention"
    config = architectures.hf_config("gemma3", gguf_meta("gemma3", **{"attention.sliding_window": 8}), shapes)
    assert (config["sliding_window"], config["layer_types"]) == (8, [sliding] * 3)  # all but every 6th
    assert config["rope_local_base_freq"] == 10000.0 and config["query_pre_attn_scalar"] == 16
    config = architectures.hf_config("gemma3", gguf_meta("gemma3", **{
        "attention.sliding_window": 8, "attention.sliding_window_pattern": [False, True, False]}), shapes)
    assert config["layer_types"] == [full, sliding, full]
    config = architectures.hf_config("gemma2", gguf_meta("gemma2"), shapes)  # llama.cpp's window when none is set
    assert (config["sliding_window"], config["layer_types"]) == (4096, [sliding, full, sliding])
    assert "sliding_window" not in architectures.hf_config("gemma3", gguf_meta("gemma3"), shapes)
    assert "sliding_window" not in architectures.hf_config(
        "phi3", gguf_meta("phi3", **{"attention.sliding_window": 0}), shapes)


@pytest.mark.parametrize("arch,keys,message", [
    ("llama", {"attention.sliding_window": 8}, "llama.attention.sliding_window 8 is not supported"),
    ("qwen2", {"attention.sliding_window": 8}, "qwen2.attention.sliding_window 8 is not supported"),
    ("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False]},
     "gemma3.attention.sliding_window_pattern has 2 entries for 3 layers"),
    ("gemma2", {"rope.freq_base_swa": 500.0}, "gemma2.rope.freq_base_swa 500 differs from rope.freq_base"),
    ("llama", {"rope.dimension_count": 8}, "llama.rope.dimension_count 8 is not the head size 16"),
])
def test_options_the_import_cannot_reproduce_are_refused_by_name(arch, keys, message):
    with pytest.raises(architectures.UnsupportedGGUF, match=message):
        architectures.hf_config(arch, gguf_meta(arch, **keys), {"token_embd.weight": (50, 32)})


def test_phi3_longrope_needs_both_factor_tensors_and_the_attention_factor_transformers_derives():
    meta = gguf_meta("phi3", **{"rope.scaling.original_context_length": 16, "rope.dimension_count": 16})
    factors = {name: np.ones(8, np.float32) for name in architectures.LONGROPE}
    config = architectures.hf_config("phi3", meta, {"token_embd.weight": (50, 32)}, factors)
    assert config["rope_scaling"]["rope_type"] == "longrope"
    assert config["rope_scaling"]["original_max_position_embeddings"] == 16
    with pytest.raises(architectures.UnsupportedGGUF, match="without rope_factors_short.weight"):
        architectures.hf_config("phi3", meta, {"token_embd.weight": (50, 32)},
                                {architectures.LONGROPE[0]: factors[architectures.LONGROPE[0]]})
    with pytest.raises(architectures.UnsupportedGGUF, match="phi3.rope.scaling.attn_factor 2 is not the longrope"):
        architectures.hf_config("phi3", {**meta, "phi3.rope.scaling.attn_factor": 2.0},
                                {"token_embd.weight": (50, 32)}, factors)


@pytest.mark.parametrize("scaling", [
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # Llama 3.1
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # Llama 3.2
    dict(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=4096),
])
def test_rope_freqs_give_back_a_llama3_scaling_with_the_same_factors(scaling):
    config = dict(hidden_size=128 * 4, num_attention_heads=4, rope_parameters={"rope_theta": 500000.0, **scaling})
    factors = llama3_rope_freqs(config)
    got = architectures.llama3_scaling(factors, 500000.0, 128)
    assert got["rope_type"] == "llama3" and got["factor"] == scaling["factor"]
    assert got["high_freq_factor"] / got["low_freq_factor"] == pytest.approx(
        scaling["high_freq_factor"] / scaling["low_freq_factor"], rel=1e-6)
    np.testing.assert_allclose(llama3_rope_freqs({**config, "rope_parameters": {"rope_theta": 500000.0, **got}}),
                               factors, rtol=1e-6)
    with pytest.raises(architectures.UnsupportedGGUF, match="no llama3 rope scaling gives these factors"):
        architectures.llama3_scaling(factors[::-1].copy(), 500000.0, 128)


def test_a_llama3_rope_gguf_imports_to_transformers_logits(tiny_tokenizer, tmp_path):
    """The rotary factors of the file (rope_freqs.weight, none of them between 1 and the factor at this size)
    become a llama3 rope scaling that gives the same frequencies."""
    hf = save_random(tmp_path / "hf", tiny_tokenizer, "llama3-rope")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    tensors = {**checkpoint_tensors(tmp_path / "hf"), "rope_freqs.weight": llama3_rope_freqs(config)}
    import_gguf(write_gguf(tmp_path / "m.gguf", "llama", byte_level_fields(tiny_tokenizer), config, tensors),
                tmp_path / "ours")
    ours, _ = load_model_dir(tmp_path / "ours")
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    ids = torch.tensor([list(range(3, 120))])  # past the original context of 32 positions
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
def test_stored_weights_are_the_dequantized_numbers(tiny_tokenizer, tmp_path, qtype):
    save_random(tmp_path / "hf", tiny_tokenizer, "llama")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    state = checkpoint_tensors(tmp_path / "hf")
    path = write_gguf(tmp_path / "m.gguf", "llama", byte_level_fields(tiny_tokenizer), config, state, qtype)
    import_gguf(path, tmp_path / "ours")
    ours, _ = load_model_dir(tmp_path / "ours")

    def held(w):  # what the file holds for w, dequantized
        return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)

    q = held(permute(state["model.layers.1.self_attn.q_proj.weight"], 4))
    k = held(permute(state["model.layers.1.self_attn.k_proj.weight"], 2))
    v = held(state["model.layers.1.self_attn.v_proj.weight"])
    want = np.concatenate([architectures.unpermute(q, 4), architectures.unpermute(k, 2), v])
    got = ours.state_dict()["blocks.1.attn.qkv_proj.weight"].numpy()
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, np.concatenate([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    np.testing.assert_array_equal(ours.state_dict()["ln_f.weight"].numpy(), state["model.norm.weight"])  # F32 kept


def test_byte_level_tokenizer_splits_text_as_the_source(tiny_tokenizer):
    hf = build_tokenizer(meta_of(byte_level_fields(tiny_tokenizer)))
    for text in MIXED_TEXTS + ["<|endoftext|>Mac.<|endoftext|>"]:
        assert hf.encode(text).ids == tiny_tokenizer.encode(text), text
        assert hf.decode(hf.encode(text).ids, skip_special_tokens=False) == text


def test_special_and_user_defined_tokens_are_matched_and_bos_added_as_the_file_asks(tiny_tokenizer):
    fields = byte_level_fields(tiny_tokenizer, pre="llama-bpe", user_defined=("<tool>",))
    hf = build_tokenizer(meta_of(fields))  # llama-bpe: llama.cpp adds the BOS unless the file says otherwise
    tool = len(fields["tokens"]) - 1
    ids = hf.encode("Rom.<|endoftext|> a<tool>b").ids
    assert ids[0] == 0 and ids.count(0) == 2 and tool in ids
    assert hf.encode("Rom.", add_special_tokens=False).ids[0] != 0
    no_bos = build_tokenizer(meta_of({**fields, "add_bos_token": False}))
    assert no_bos.encode("Rom.").ids == hf.encode("Rom.", add_special_tokens=False).ids
    assert no_bos.get_added_tokens_decoder()[0].special
    assert not no_bos.get_added_tokens_decoder()[tool].special


@pytest.mark.parametrize("pre,pieces", [
    ("gpt-2", ["Ġ1234567"]),  # one piece of digits
    ("llama-bpe", ["Ġ", "123", "456", "7"]),  # digits in threes, the space alone
    ("qwen2", ["Ġ", "1", "2", "3", "4", "5", "6", "7"]),  # digit by digit
])
def test_pre_tokenizers_split_digits_as_llama_cpps_regexes(tiny_tokenizer, pre, pieces):
    hf = build_tokenizer(meta_of({**byte_level_fields(tiny_tokenizer, pre=pre), "add_bos_token": False}))
    got = hf.pre_tokenizer.pre_tokenize_str(" 1234567")
    assert [p for p, _ in got] == pieces


def spm_fields() -> dict:
    """A SentencePiece vocabulary small enough to work by hand: bytes, single characters and a few merges."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for piece, score in [("▁", -10), ("a", -10), ("b", -10), ("c", -10), ("ab", -1), ("▁a", -2), ("▁ab", -3),
                         ("bc", -0.5), ("abc", -4)]:
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(score)
    return {"model": "llama", "tokens": tokens, "scores": scores, "token_type": types, "bos_token_id": 1,
            "eos_token_id": 2, "unknown_token_id": 0}


def test_sentencepiece_merges_the_best_scored_pair_first_and_falls_back_to_bytes():
    fields = spm_fields()
    ids = {t: i for i, t in enumerate(fields["tokens"])}
    hf = build_tokenizer(meta_of(fields))
    assert hf.encode("ab").ids == [1, ids["▁ab"]]  # ab (-1) first, then ▁ + ab
    assert hf.encode("abc").ids == [1, ids["▁a"], ids["bc"]]  # bc (-0.5) before ab (-1): ▁a + bc, no ▁abc
    assert hf.encode("é", add_special_tokens=False).ids == [ids["▁"], 3 + 0xC3, 3 + 0xA9]  # UTF-8 bytes
    assert hf.encode("ab</s>ab", add_special_tokens=False).ids == [ids["▁ab"], 2, ids["▁ab"]]  # ▁ after special
    assert hf.decode(hf.encode("ab abc é").ids, skip_special_tokens=True) == "ab abc é"
    assert spm_merges(["a", "b", "ab", "x", "abx"], [0, 0, -1, 0, -0.5])[0] == ("ab", "x")


def test_tokens_llama_cpp_ends_generation_on_by_their_text_are_special_and_end_generation(tiny_tokenizer):
    fields = byte_level_fields(tiny_tokenizer, user_defined=("<|im_end|>", "<tool>"))
    im_end, tool = len(fields["tokens"]) - 2, len(fields["tokens"]) - 1
    hf = build_tokenizer(meta_of(fields))
    assert hf.get_added_tokens_decoder()[im_end].special and not hf.get_added_tokens_decoder()[tool].special
    assert tokenizer_files(meta_of(fields))["generation_config.json"]["eos_token_id"] == [0, im_end]


def test_tokenizer_files_keep_the_chat_template_and_every_end_of_generation_id():
    fields = {**spm_fields(), "eot_token_id": 5, "chat_template": "{{ bos_token }}"}
    meta = {**meta_of({k: v for k, v in fields.items() if k != "chat_template"}),
            "tokenizer.chat_template": fields["chat_template"]}
    files = tokenizer_files(meta)
    assert files["tokenizer_config.json"] == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                              "chat_template": "{{ bos_token }}"}
    assert files["generation_config.json"] == {"eos_token_id": [2, 5], "bos_token_id": 1}


def refused(tmp_path, capsys, path) -> str:
    assert main([str(path), "-o", str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "ours").exists()
    return err


@pytest.mark.parametrize("change,message", [
    (dict(arch="falcon"), "architecture 'falcon' is not supported"),
    (dict(extra={"blk.0.ffn_gate_inp.weight": np.zeros((2, 32), np.float32)}),
     "tensor 'blk.0.ffn_gate_inp.weight' has no Hugging Face name in the llama architecture"),
    (dict(extra={"rope_freqs.weight": np.ones(2, np.float32)}), "rope_freqs.weight holds 2 factors up to 1"),
    (dict(fields={"pre": "deepseek-coder"}), "tokenizer.ggml.pre 'deepseek-coder'"),
    (dict(fields={"model": "t5"}), "tokenizer.ggml.model 't5' is not supported"),
    (dict(fields={"tokens": None}), "the file has no vocabulary (tokenizer.ggml.tokens)"),
    (dict(qtype=Q.Q4_1), "tensor token_embd.weight is Q4_1, which is not read"),
])
def test_what_is_not_supported_is_refused_by_name(tiny_tokenizer, tmp_path, capsys, change, message):
    config = dict(num_hidden_layers=1, max_position_embeddings=64, hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0)
    rng = np.random.default_rng(0)
    D, F = 32, 64  # rows of 32: a block of the quantized kinds
    shapes = {"model.embed_tokens.weight": (tiny_tokenizer.vocab_size, D), "model.norm.weight": (D,),
              **{f"model.layers.0.{n}": s for n, s in [
                  ("input_layernorm.weight", (D,)), ("post_attention_layernorm.weight", (D,)),
                  ("self_attn.q_proj.weight", (D, D)), ("self_attn.k_proj.weight", (D, D)),
                  ("self_attn.v_proj.weight", (D, D)), ("self_attn.o_proj.weight", (D, D)),
                  ("mlp.gate_proj.weight", (F, D)), ("mlp.up_proj.weight", (F, D)),
                  ("mlp.down_proj.weight", (D, F))]}}
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    fields = {**byte_level_fields(tiny_tokenizer), **change.get("fields", {})}
    path = write_gguf(tmp_path / "m.gguf", change.get("arch", "llama"), fields, config,
                      {**tensors, **change.get("extra", {})}, change.get("qtype", Q.F32))
    assert message in refused(tmp_path, capsys, path)


def test_a_quantization_kind_not_read_is_refused_by_name(tiny_tokenizer, tmp_path, capsys):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    rows = np.zeros((tiny_tokenizer.vocab_size, gguf.GGML_QUANT_SIZES[Q.Q5_K][1]), np.uint8)  # one block a row
    w.add_tensor("token_embd.weight", rows, raw_dtype=Q.Q5_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from model.gguf.import_gguf import float32_tensor

    (tensor,) = gguf.GGUFReader(tmp_path / "m.gguf").tensors
    with pytest.raises(architectures.UnsupportedGGUF, match="token_embd.weight is Q5_K, which is not read"):
        float32_tensor(tensor)


def test_a_file_that_is_not_gguf_is_refused(tmp_path, capsys):
    (tmp_path / "m.gguf").write_bytes(b"not a gguf file at all")
    assert "m.gguf" in refused(tmp_path, capsys, tmp_path / "m.gguf")
