"""llama.cpp's own `convert_hf_to_gguf.py`, run unchanged on an `attnserve export-hf` directory.

    .venv-llama-cpp/bin/python bench/peers/llama_cpp_convert.py <llama.cpp source> <hf dir> --outfile F --outtype f16

It runs in the converter's virtualenv (`make bench-llama-cpp`), imports nothing from this project, and
passes every argument after the source folder to the converter as they are. It adds one thing: the name
of the BPE pre-tokenizer, when the converter cannot name it.

The converter names a BPE pre-tokenizer by the sha256 of the token ids its tokenizer gives a fixed test
string, looked up in a table of published Hugging Face models; an unknown hash is refused
("BPE pre-tokenizer was not recognized"). The ids depend on the vocabulary as much as on the
pre-tokenizer, so a tokenizer trained here (ours: GPT-2's byte-level pre-tokenizer over a vocabulary of
our own) can never match the table, however its pre-tokenizer is set. The converter's documented remedy
(convert_hf_to_gguf_update.py) downloads the listed models from the Hugging Face hub and rewrites the
converter's source; neither is open to us. So: the converter's own lookup runs first and wins when it
knows the hash; only when it refuses, and only when tokenizer.json's pre-tokenizer is exactly GPT-2's
(`ByteLevel`, its regex on, no prefix space, no normaliser), the name is "gpt-2", the llama.cpp
pre-tokenizer with the same regex. Anything else stays refused. The benchmark sends token ids, so the
name touches only text (the server's /tokenize and the text in its replies); the tests check that
llama.cpp's tokenizer splits text into the same ids as ours.
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

log = logging.getLogger("llama_cpp_convert")


def is_gpt2_pre_tokenizer(tokenizer_json: Path) -> bool:
    """True when the tokenizer pre-tokenizes as GPT-2 does: byte-level with GPT-2's regex, nothing else."""
    if not tokenizer_json.is_file():
        return False
    spec = json.loads(tokenizer_json.read_text())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and spec.get("model", {}).get("type") == "BPE"
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))


def name_known_pre_tokenizers(base) -> None:
    """`TextModel.get_vocab_base_pre`, which answers "gpt-2" where the hash lookup refuses a GPT-2 one."""
    lookup = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:
            if not is_gpt2_pre_tokenizer(Path(self.dir_model) / "tokenizer.json"):
                raise
            log.warning("the hash above names no published model; tokenizer.json's pre-tokenizer is GPT-2's "
                        "byte-level one, so tokenizer.ggml.pre = 'gpt-2'")
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not (Path(argv[0]) / "convert_hf_to_gguf.py").is_file():
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    source = Path(argv[0]).resolve()
    sys.path[:0] = [str(source), str(source / "gguf-py")]  # the converter's own package and its gguf-py
    from conversion import base

    name_known_pre_tokenizers(base)
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")  # the same `conversion` module, so the lookup above holds
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
