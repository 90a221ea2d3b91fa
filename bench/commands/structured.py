"""`attnserve bench structured`: structured output (JSON schema, regex, choice) on this CPU.

    attnserve bench structured                           # every part
    attnserve bench structured --part library            # llguidance alone: compile, masks, walks
    attnserve bench structured --part server             # the engine, HTTP and llama.cpp's server, generating
    attnserve bench structured --vocabs 4096 --sp-vocab 2000 --code-chars 0 --rounds 1 --walks 4 --out /tmp/x
    attnserve bench structured --part server --streams 4 --server-rounds 1 --no-llama-cpp --out /tmp/x   # a minute

The library part measures llguidance, the library the engine constrains its output with, at three
byte-level vocabularies (the shipped tokenizer's 4096 ids, GPT-2's 50257, Qwen2's 151665; how the larger two
are built: `bench.vocabularies`), in interleaved rounds:
- `LLTokenizer` construction (once per vocabulary in serving), a cold compile of the 20-field schema of
  `bench.structured_cases` (a new `LLMatcher`) and its first mask, and `deep_copy()` of a compiled matcher
  (what a cache of compiled grammars hands each sequence);
- the mask per token along the canonical tokenization of valid documents: one matcher
  (`fill_next_token_bitmask`), and 32 at once on an `LLExecutor` with a thread per core
  (`fill_next_token_bitmask_par`), per step and per sequence.
Then correctness, on every byte-level vocabulary and on a Llama-2 style SentencePiece BPE with byte fallback:
random walks under each constraint (tokens drawn uniformly among those the mask allows, until the matcher
stops, end of sequence is drawn, or the token budget runs out), decoded with `service.runtime.tokenizer` and
checked (`jsonschema`, `re.fullmatch`, membership). End of sequence must be allowed only where the
matcher accepts. Times are medians and p99 over every sample of every round.

The server part (`bench.structured_server`) generates under a JSON schema with the shipped model against
the same requests unconstrained, in the engine, over `attnserve serve`'s HTTP front and in llama.cpp's
server on the same weights, and times the engine's masks and compiles. A part that is run replaces its own
entry of docs/bench/structured.json and keeps the others'.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, ROOT, describe, machine_line, publish, shown
from bench.peers.protocol import percentile
from bench.sizes import SIZES
from bench.structured_cases import CONSTRAINTS, JSON_OPTIONS, documents, is_valid, leaf_fields
from bench.vocabularies import CODE_CHARS, byte_level_bpe, local_texts, sentencepiece_bpe

PARTS = ("library", "server")
VOCABS = (4096, 50257, 151665)  # the shipped tokenizer's, GPT-2's, Qwen2's (151643 + 22 special tokens)
SP_VOCAB = 32000  # Llama-2's


def grammar(kind: str) -> str:
    import llguidance

    fmt, text = CONSTRAINTS[kind]
    if fmt == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    return llguidance.grammar_from(fmt, text)


def ll_tokenizer(tokenizer):
    """The llguidance view of a `service.runtime.tokenizer.Tokenizer` (its tokenizer.json and end of sequence)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.hf.to_str(), eos_token=tokenizer.eos_id)


def matcher(lltok, grammar_text: str):
    import llguidance

    m = llguidance.LLMatcher(lltok, grammar_text)
    if m.is_error():
        raise RuntimeError(f"llguidance refused the grammar: {m.get_error()}")
    return m


def _us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "p99": percentile(samples, 99), "n": len(samples)}


def time_setup(tokenizer, grammar_text: str, times: dict, compiles: int, copies: int) -> None:
    """Append one round's samples (µs) of LLTokenizer construction, cold compile, first mask and deep_copy."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    start = time.perf_counter()
    lltok = ll_tokenizer(tokenizer)
    times["tokenizer"].append((time.perf_counter() - start) * 1e6)
    mask = allocate_token_bitmask(1, lltok.vocab_size)
    for _ in range(compiles):
        start = time.perf_counter()
        m = matcher(lltok, grammar_text)
        times["compile"].append((time.perf_counter() - start) * 1e6)
        times["first_mask"].append(_us(lambda: fill_next_token_bitmask(m, mask)))  # noqa: B023
    times["deep_copy"].extend(_us(m.deep_copy) for _ in range(copies))


def time_masks(lltok, compiled, docs: list[list[int]], times: dict, executor) -> None:
    """Append one round's mask samples (µs): one matcher along docs[0]; len(docs) matchers at once along all."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    one = compiled.deep_copy()
    mask = allocate_token_bitmask(1, lltok.vocab_size)
    for token in docs[0]:
        times["mask"].append(_us(lambda: fill_next_token_bitmask(one, mask)))  # noqa: B023
        _consume(one, token)
    batch = [(compiled.deep_copy(), i) for i in range(len(docs))]
    masks = allocate_token_bitmask(len(docs), lltok.vocab_size)
    for step in range(min(map(len, docs))):
        times["mask_batch"].append(_us(lambda: fill_next_token_bitmask_par(executor, batch, masks)))
        for (m, i) in batch:
            _consume(m, docs[i][step])


def _consume(m, token: int) -> None:
    if not m.consume_token(token):
        raise RuntimeError(f"the matcher refused token {token} of a valid document: {m.get_error()}")


def allowed(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a (1, words) int32 bitmask allows."""
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size])


def walk(m, lltok, rng: random.Random, budget: int) -> tuple[list[int], str, int]:
    """A random walk: (tokens without the end of sequence, how it ended: "stopped", "eos", "budget" or
    "error", steps whose mask allowed the end of sequence where the matcher did not accept)."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    mask = allocate_token_bitmask(1, lltok.vocab_size)
    tokens, early_eos = [], 0
    while len(tokens) < budget:
        if m.is_stopped():
            return tokens, "stopped", early_eos
        fill_next_token_bitmask(m, mask)
        ids = allowed(mask, lltok.vocab_size)
        if ids.size == 0:
            return tokens, "error", early_eos
        early_eos += int(lltok.eos_token in ids and not m.is_accepting())
        token = int(ids[rng.randrange(ids.size)])
        if token == lltok.eos_token:
            return tokens, "eos", early_eos
        if not m.consume_token(token):
            return tokens, "error", early_eos
        tokens.append(token)
    return tokens, "budget", early_eos


def check_walks(tokenizer, walks: int, budget: int, seed: int = 0) -> dict:
    """{constraint kind: counts} of `walks` random walks under each constraint, checked as decoded text."""
    lltok = ll_tokenizer(tokenizer)
    rng = random.Random(seed)
    out = {}
    for kind in CONSTRAINTS:
        compiled = matcher(lltok, grammar(kind))
        counts = {"walks": walks, "finished": 0, "valid": 0, "budget": 0, "errors": 0, "early_eos": 0, "tokens": 0}
        for _ in range(walks):
            tokens, end, early_eos = walk(compiled.deep_copy(), lltok, rng, budget)
            counts["early_eos"] += early_eos
            counts["tokens"] += len(tokens)
            if end in ("stopped", "eos"):
                counts["finished"] += 1
                counts["valid"] += is_valid(kind, tokenizer.decode(tokens))
            else:
                counts["budget" if end == "budget" else "errors"] += 1
        out[kind] = counts
    return out


def library_part(vocabs=VOCABS, sp_vocab: int = SP_VOCAB, rounds: int = 3, compiles: int = 5, copies: int = 20,
                 batch: int = 32, walks: int = 20, budget: int = 2000, texts: list[str] | None = None,
                 code_chars: int = CODE_CHARS) -> dict:
    """llguidance alone (see the module docstring): the `library` entry of the result. The tokenizers are
    trained on `texts`, by default `local_texts(code_chars)`."""
    import llguidance

    texts = texts if texts is not None else local_texts(code_chars)
    built = {v: byte_level_bpe(v, texts) for v in vocabs}
    tokenizers = {v: tokenizer for v, (tokenizer, _) in built.items()}
    schema = grammar("json_schema")
    docs = documents(batch)
    if not all(is_valid("json_schema", d) for d in docs):
        raise RuntimeError("a benchmark document does not satisfy the schema")
    threads = os.cpu_count() or 1
    executor = llguidance.LLExecutor(num_threads=threads)
    times = {v: {k: [] for k in ("tokenizer", "compile", "first_mask", "deep_copy", "mask", "mask_batch")}
             for v in vocabs}
    for _ in range(rounds):  # interleaved: a slow moment of a shared machine falls on every vocabulary
        for v, tokenizer in tokenizers.items():
            time_setup(tokenizer, schema, times[v], compiles, copies)
            lltok = ll_tokenizer(tokenizer)
            doc_tokens = [tokenizer.encode(d, add_special_tokens=False) for d in docs]
            time_masks(lltok, matcher(lltok, schema), doc_tokens, times[v], executor)
    sp = sentencepiece_bpe(sp_vocab, texts)
    correctness = {f"byte-level {v}": check_walks(t, walks, budget) for v, t in tokenizers.items()}
    correctness[f"sentencepiece {sp.vocab_size}"] = check_walks(sp, walks, budget)
    doc_tokens = {v: statistics.mean(len(t.encode(d, add_special_tokens=False)) for d in docs)
                  for v, t in tokenizers.items()}
    return {
        "llguidance": llguidance.__version__, "rounds": rounds, "batch": batch, "threads": threads,
        "schema_fields": leaf_fields(), "trained_ids": {v: trained for v, (_, trained) in built.items()},
        "document_tokens": doc_tokens,
        "times_us": {v: {k: summary(s) for k, s in ts.items()} for v, ts in times.items()},
        "walks": walks, "budget": budget, "correctness": correctness,
    }


def markdown(result: dict, command: str) -> str:
    """The structured section of BENCHMARKS.md: each part in the result, with the command that ran it."""
    lines = ["## Structured output", ""]
    if "library" in result:
        lib = result["library"]
        lines += [f"`{lib.get('command', command)}` on {machine_line(lib.get('machine', result['machine']))}.", "",
                  *library_lines(lib)]
    for key in sorted(k for k in result if k.startswith("server")):  # "server" (the shipped model), "server <size>"
        from bench.structured_server import server_markdown

        srv = result[key]
        lines += ["", *server_markdown(srv, srv.get("command", command),
                                       machine_line(srv.get("machine", result["machine"])))]
    return "\n".join(lines)


def library_lines(lib: dict) -> list[str]:
    lines = [f"llguidance {lib['llguidance']} alone (`bench/commands/structured.py`), the {lib['schema_fields']}-field "
             f"JSON schema of `bench/structured_cases.py` compiled without free whitespace; median and p99 over "
             f"{lib['rounds']} interleaved rounds. Vocabularies: the shipped tokenizer, and byte-level BPEs of "
             "GPT-2's and Qwen2's sizes trained on local text and extended by synthetic merges "
             f"(`bench/vocabularies.py`; ids from training: {_trained(lib)}). Masks are timed along the tokens of "
             f"valid documents (mean tokens each: {_doc_tokens(lib)}), one matcher along the first, the batch along "
             f"{lib['batch']} of them. The batch is "
             f"{lib['batch']} matchers on an `LLExecutor` of {lib['threads']} threads; per sequence = step / "
             f"{lib['batch']}.", "",
             "| vocabulary | LLTokenizer ms | compile ms | first mask µs | deep_copy µs | mask µs (p99) | "
             f"batch {lib['batch']} step µs (p99) | per sequence µs |", "|---|---|---|---|---|---|---|---|"]
    for v, t in lib["times_us"].items():
        lines.append(f"| {int(v):,} | {t['tokenizer']['median'] / 1e3:.0f} | {t['compile']['median'] / 1e3:.2f} | "
                     f"{t['first_mask']['median']:.0f} | {t['deep_copy']['median']:.1f} | "
                     f"{t['mask']['median']:.0f} ({t['mask']['p99']:.0f}) | {t['mask_batch']['median']:.0f} "
                     f"({t['mask_batch']['p99']:.0f}) | {t['mask_batch']['median'] / lib['batch']:.0f} |")
    lines += ["", f"Random walks ({lib['walks']} per constraint, tokens drawn uniformly among those allowed, at most "
              f"{lib['budget']} tokens), decoded with `service.runtime.tokenizer` and checked; valid / finished, and "
              "walks that ran out of budget:", "",
              "| tokenizer | json_schema | regex | choice | end of sequence allowed before accepting |",
              "|---|---|---|---|---|"]
    for name, kinds in lib["correctness"].items():
        cells = [f"{c['valid']}/{c['finished']}" + (f" ({c['budget']} budget)" if c["budget"] else "")
                 + (f" ({c['errors']} errors)" if c["errors"] else "") for c in kinds.values()]
        lines.append(f"| {name} | {' | '.join(cells)} | {sum(c['early_eos'] for c in kinds.values())} |")
    return lines


def _trained(lib: dict) -> str:
    return ", ".join(f"{int(t):,} of {int(v):,}" for v, t in lib["trained_ids"].items())


def _doc_tokens(lib: dict) -> str:
    return ", ".join(f"{t:.0f} at {int(v):,}" for v, t in lib["document_tokens"].items())


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=PARTS, action="append", help="a part to run (repeatable); default: all")
    p.add_argument("--vocabs", default=",".join(map(str, VOCABS)), help="byte-level vocabulary sizes, comma-separated")
    p.add_argument("--sp-vocab", type=int, default=SP_VOCAB, help="size of the SentencePiece-style vocabulary")
    p.add_argument("--code-chars", type=int, default=CODE_CHARS, help="characters of Python standard-library "
                   "sources the tokenizers are trained on beside the plays")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the library timings")
    p.add_argument("--walks", type=int, default=20, help="random walks per constraint and tokenizer")
    p.add_argument("--budget", type=int, default=2000, help="most tokens of a random walk")
    p.add_argument("--server-rounds", type=int, default=11, help="interleaved rounds of the server part")
    p.add_argument("--streams", type=int, default=32, help="server part: concurrent requests")
    p.add_argument("--singles", type=int, default=3, help="server part: prompts run one after another (batch 1)")
    p.add_argument("--max-tokens", type=int, default=240, help="server part: most tokens of a constrained request")
    p.add_argument("--no-llama-cpp", action="store_true", help="server part: leave llama.cpp's server out")
    p.add_argument("--size", choices=SIZES, default="shipped", help="server part: the model (a size other than the "
                   "shipped model has random weights, and its result is kept beside the shipped model's)")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "structured", help="the prepared model and GGUF")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where structured.json goes (docs/bench: and its "
                                                                  "section of BENCHMARKS.md)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    command = shown(" ".join(["attnserve bench structured", *argv]))
    machine = describe()
    earlier = args.out / "structured.json"
    previous = json.loads(earlier.read_text()) if earlier.is_file() else {}
    for part in previous:  # a part kept from an earlier run keeps the machine it ran on
        if part.startswith(PARTS):
            previous[part].setdefault("machine", previous["machine"])
    result = {**previous, "machine": machine}
    if "library" in (args.part or PARTS):
        result["library"] = {**library_part(tuple(int(v) for v in args.vocabs.split(",")), args.sp_vocab,
                                            args.rounds, walks=args.walks, budget=args.budget,
                                            code_chars=args.code_chars), "command": command, "machine": machine}
    if "server" in (args.part or PARTS):
        from bench.sizes import prepare
        from bench.structured_server import server_part

        prepared = prepare(args.size, args.work, int4=False)
        key = "server" if args.size == "shipped" else f"server {args.size}"
        result[key] = {**server_part(prepared.bundle, prepared.hf_dir, args.work / args.size / "peers",
                                     streams=args.streams, singles=args.singles, budget=args.max_tokens,
                                     rounds=args.server_rounds, llama=not args.no_llama_cpp),
                       "size": args.size, "command": command, "machine": machine}
    text = markdown(result, command)
    print(text)
    publish("structured", result, text, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
