"""`attnserve generate`: text from an ONNX bundle through the serving engine, streamed. No torch.

    attnserve generate "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-p 0.95 --seed 1
    attnserve generate "To be" -n 3 --stop "\\n\\n" --bundle models/shakespeare-onnx

With n = 1 the text streams as it is generated; with n > 1 each completion is printed whole.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from service.async_engine import AsyncEngine
from service.config import EngineConfig
from service.errors import EngineError
from service.request import GenerationRequest, SamplingParams, StoppingCriteria

DEFAULT_BUNDLE = Path(__file__).resolve().parents[1] / "models" / "shakespeare-onnx"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnserve generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt")
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    p.add_argument("--graph", default=None, help="graph variant (default: the bundle's serving graph)")
    p.add_argument("-n", type=int, default=1, help="completions from the one prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    return p


async def run(args: argparse.Namespace) -> int:
    engine = AsyncEngine(EngineConfig(bundle=args.bundle, graph=args.graph, max_running=max(args.n, 1) + 1))
    engine.start()
    tokenizer = engine.engine.tokenizer
    request = GenerationRequest(
        "cli", tokenizer.encode(args.prompt),
        SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                       args.presence_penalty, args.frequency_penalty, args.seed),
        StoppingCriteria(args.max_new_tokens, args.min_new_tokens, args.stop, [], args.ignore_eos), n=args.n)
    texts = [""] * args.n
    try:
        stream = engine.submit(request)
        if args.n == 1:
            print(args.prompt, end="", flush=True)
        async for event in stream:
            texts[event.index] += event.text
            if args.n == 1:
                print(event.text, end="", flush=True)
            if event.finish_reason is not None and args.n == 1:
                print(f"\n[{event.finish_reason.value}]", file=sys.stderr)
    except EngineError as e:
        print(f"\nattnserve generate: {e}", file=sys.stderr)
        return 2
    finally:
        await engine.shutdown()
    if args.n > 1:
        for i, text in enumerate(texts):
            print(f"--- {i}\n{args.prompt}{text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
