"""Beam search: the rule against transformers' `generate(num_beams=k)` on the same logits."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.beam_search import BeamSearch
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bart():
    config = transformers.BartConfig(vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                                     forced_bos_token_id=None, no_repeat_ngram_size=0)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.6)  # sharper distributions than the default init: the beams part ways
    return model


def ours(model, source: list[int], width: int, max_new: int, length_penalty: float, early_stopping, n: int):
    """Our search, fed by the model's logits for each running beam (the whole target, no cache)."""
    search = BeamSearch(width, frozenset([model.config.eos_token_id]), max_new, length_penalty, early_stopping)
    src = torch.tensor([source] * width)
    start = model.config.decoder_start_token_id
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=src)
        while not search.done:
            target = torch.tensor([[start] + beam for beam in search.running])
            logits = model(encoder_outputs=encoded, decoder_input_ids=target).logits[:, -1].float().numpy()
            search.step(logits)
    return [(h.tokens, h.score) for h in search.best(n)]


def theirs(model, source: list[int], width: int, max_new: int, length_penalty: float, early_stopping, n: int):
    out = model.generate(torch.tensor([source]), num_beams=width, num_return_sequences=n, max_new_tokens=max_new,
                         length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, no_repeat_ngram_size=0, min_length=0)
    result = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        tokens = seq[1:]  # after the decoder start
        eos = model.config.eos_token_id
        if eos in tokens:
            tokens = tokens[:tokens.index(eos) + 1]
        else:  # padded with the pad id after a shorter hypothesis ended? no end: it ran to the limit
            tokens = [t for t in tokens if t != model.config.pad_token_id][:max_new]
        result.append((tokens, score))
    return result


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"),
                         [(4, 1.0, False), (3, 0.0, True), (5, 2.0, "never"), (2, -0.5, False)])
def test_the_same_hypotheses_and_scores_as_transformers(bart, width, length_penalty, early_stopping):
    rng = np.random.default_rng(width)
    for _ in range(4):
        source = rng.integers(3, 40, int(rng.integers(3, 9))).tolist() + [2]
        for max_new in (6, 20):
            a = ours(bart, source, width, max_new, length_penalty, early_stopping, n=width)
            b = theirs(bart, source, width, max_new, length_penalty, early_stopping, n=width)
            assert [t for t, _ in a] == [t for t, _ in b], (source, max_new)
            assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=1e-4)


# ---- the engine: an imported BART's beams against transformers', alone and beside other requests ---------


@pytest.fixture(scope="module")
def bart_bundle(tmp_path_factory):
    """(transformers model, its tokenizer, our exported bundle of it)."""
    from export.cli import main as export_main
    from model.checkpoint import load_seq2seq_dir
    from model.hf.import_hf import import_hf
    from tests.model.test_hf_bart import save_random_bart

    root = tmp_path_factory.mktemp("beam_bart")
    (root / "hf").mkdir()
    hf = save_random_bart(root / "hf")
    import_hf(root / "hf", root / "ours")
    assert export_main([str(root / "ours"), "-o", str(root / "bundle")]) == 0
    _, tok = load_seq2seq_dir(root / "ours")
    return hf, tok, root / "bundle"


def hf_beams(hf, source: list[int], width: int, n: int, max_new: int, length_penalty: float, early_stopping):
    out = hf.generate(input_ids=torch.tensor([source]), num_beams=width, num_return_sequences=n, max_new_tokens=max_new,
                      length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False, min_length=0,
                      no_repeat_ngram_size=0, forced_bos_token_id=None, forced_eos_token_id=None,
                      output_scores=True, return_dict_in_generate=True)
    rows = []
    for row, score in zip(out.sequences[:, 1:].tolist(), out.sequences_scores.tolist(), strict=True):
        rows.append((row[:row.index(2) + 1] if 2 in row else [t for t in row if t != 1][:max_new], score))
    return rows


def beam_request(rid: str, source: list[int], width: int, n: int, max_new: int, length_penalty: float, early_stopping):
    from service.engine.request import BeamParams

    return GenerationRequest(rid, source, SamplingParams(temperature=0.0), StoppingCriteria(max_new_tokens=max_new),
                             n=n, beam=BeamParams(width, length_penalty, early_stopping))


CASES = [(4, 2, 1.0, False), (3, 3, 0.0, True), (5, 1, 2.0, "never")]


def test_an_imported_barts_beams_are_transformers_alone_and_batched(bart_bundle):
    from service.engine.config import EngineConfig
    from service.engine.core import Engine
    from tests.engine.harness import drive, greedy
    from tests.model.test_hf_bart import SENTENCES

    hf, tok, bundle = bart_bundle
    sources = [tok.encode(t) for t in SENTENCES]
    config = dict(bundle=bundle, max_running=16, max_batch_tokens=128, threads=1)
    for width, n, lp, es in CASES:
        want = {i: hf_beams(hf, src, width, n, 16, lp, es) for i, src in enumerate(sources)}
        requests = [beam_request(f"b{i}", src, width, n, 16, lp, es) for i, src in enumerate(sources)]
        together = drive(Engine(EngineConfig(**config)), requests + [greedy("g", sources[0], 10)])
        for i, r in enumerate(requests):
            alone = drive(Engine(EngineConfig(**config)), [r])
            for run in (together, alone):
                got = [(run.tokens(r.request_id, j), run.events[(r.request_id, j)][-1].beam_score) for j in range(n)]
                assert [t for t, _ in got] == [t for t, _ in want[i]], (width, i)
                assert [s for _, s in got] == pytest.approx([s for _, s in want[i]], rel=5e-5, abs=1e-4)


def test_the_shipped_g2p_models_beams_are_transformers_alone_and_batched(tmp_path):
    """The G2P model exported as BART (`export-hf`) decodes in transformers; its shipped bundle in the engine."""
    from model.checkpoint import load_seq2seq_dir
    from model.hf.export_hf import export_hf
    from service.engine.config import EngineConfig
    from service.engine.core import Engine
    from tests.conftest import ROOT, SHIPPED_G2P_BUNDLE
    from tests.engine.harness import drive, greedy

    export_hf(ROOT / "models" / "g2p-cmudict", tmp_path / "hf")
    hf = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    _, tok = load_seq2seq_dir(ROOT / "models" / "g2p-cmudict")
    eos, pad = hf.config.eos_token_id, hf.config.pad_token_id
    words = ["transformer", "attention", "cat", "kubernetes", "onnxruntime", "shakespeare"]
    sources = [tok.encode(w) for w in words]
    config = dict(bundle=SHIPPED_G2P_BUNDLE, graph="static", max_running=32, max_batch_tokens=256, threads=1)
    for width, n, lp, es in [(4, 2, 1.0, False), (5, 1, 0.0, True)]:
        requests = [beam_request(f"w{i}", s, width, n, 30, lp, es) for i, s in enumerate(sources)]
        together = drive(Engine(EngineConfig(**config)), requests + [greedy("g", sources[0], 20)])
        for i, (src, r) in enumerate(zip(sources, requests, strict=True)):
            out = hf.generate(input_ids=torch.tensor([src]), num_beams=width, num_return_sequences=n, max_new_tokens=30,
                              length_penalty=lp, early_stopping=es, do_sample=False, min_length=0,
                              no_repeat_ngram_size=0, output_scores=True, return_dict_in_generate=True)
            want = [(row[:row.index(eos) + 1] if eos in row else [t for t in row if t != pad], score)
                    for row, score in zip(out.sequences[:, 1:].tolist(), out.sequences_scores.tolist(), strict=True)]
            alone = drive(Engine(EngineConfig(**config)), [r])
            for run in (together, alone):
                got = [(run.tokens(r.request_id, j), run.events[(r.request_id, j)][-1].beam_score) for j in range(n)]
                assert [t for t, _ in got] == [t for t, _ in want], (words[i], width)
                assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=5e-5, abs=1e-4)


def test_the_shipped_decoders_beams_are_transformers_alone_and_batched(tmp_path):
    """The default model exported to transformers (Llama) against its shipped bundle: a decoder's beams."""
    from model.checkpoint import load_model_dir
    from model.hf.export_hf import export_hf
    from service.engine.config import EngineConfig
    from service.engine.core import Engine
    from tests.conftest import ROOT, SHIPPED_BUNDLE
    from tests.engine.harness import drive, sampled

    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(ROOT / "models" / "shakespeare", tmp_path / "hf"))
    hf = hf.eval()
    _, tok = load_model_dir(ROOT / "models" / "shakespeare")
    prompts = [tok.encode(t) for t in ("ROMEO:\n", "To be, or not to be", "KING.\nWhat says")]
    config = dict(bundle=SHIPPED_BUNDLE, graph="static", max_running=16, max_batch_tokens=128, threads=1)
    width, n, lp = 3, 2, 1.0
    requests = [beam_request(f"p{i}", p, width, n, 12, lp, False) for i, p in enumerate(prompts)]
    together = drive(Engine(EngineConfig(**config)), requests + [sampled("s", prompts[0], 8, seed=1)])
    for p, r in zip(prompts, requests, strict=True):
        out = hf.generate(torch.tensor([p]), num_beams=width, num_return_sequences=n, max_new_tokens=12,
                          length_penalty=lp, early_stopping=False, do_sample=False, min_length=0,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        want = [(row[len(p):], score) for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(),
                                                            strict=True)]
        want = [(t[:t.index(0) + 1] if 0 in t else t, s) for t, s in want]
        alone = drive(Engine(EngineConfig(**config)), [r])
        for run in (together, alone):
            got = [(run.tokens(r.request_id, j), run.events[(r.request_id, j)][-1].beam_score) for j in range(n)]
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=5e-5, abs=1e-4)
