"""Time a peer's `generate` on fixed prompts: Hugging Face transformers or optimum's onnxruntime model.

    python bench/peers/generate.py --backend transformers --hf-dir runs/hf --prompts prompts.json
    .venv-peers/bin/python bench/peers/generate.py --backend optimum --hf-dir runs/hf --onnx-dir runs/optimum ...

It runs in the peer's own interpreter (optimum needs its own virtualenv), so it imports nothing
from this project: only the standard library, torch, transformers and optimum. `prompts.json`
holds {"batches": {"<b>": [[ids], ...]}, "new_tokens": N, "repeats": R}; every batch is generated
greedily for exactly N new tokens (min_new_tokens = max_new_tokens, so the end-of-text token
cannot stop it early), after one untimed warm-up call at that batch size. It prints one JSON
object: tokens/s per batch size (every repeat) and the library versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def load(backend: str, hf_dir: str, onnx_dir: str | None):
    if backend == "transformers":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    from optimum.onnxruntime import ORTModelForCausalLM

    onnx = Path(onnx_dir)
    if not (onnx / "model.onnx").is_file():  # export once; later runs load the saved graph
        model = ORTModelForCausalLM.from_pretrained(hf_dir, export=True, use_cache=True)
        model.save_pretrained(onnx)
    return ORTModelForCausalLM.from_pretrained(onnx, use_cache=True, provider="CPUExecutionProvider")


def versions(backend: str) -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    if backend == "optimum":
        import onnxruntime
        import optimum.version

        out |= {"optimum": optimum.version.__version__, "onnxruntime": onnxruntime.__version__}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["transformers", "optimum"], required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--onnx-dir", help="optimum: where the exported graph is kept")
    p.add_argument("--prompts", required=True)
    args = p.parse_args(argv)
    import torch

    spec = json.loads(Path(args.prompts).read_text())
    model = load(args.backend, args.hf_dir, args.onnx_dir)
    eos = model.config.eos_token_id
    new = spec["new_tokens"]
    result = {"backend": args.backend, "versions": versions(args.backend), "threads": torch.get_num_threads(),
              "tokens_per_s": {}}
    with torch.inference_mode():
        for b, prompts in spec["batches"].items():
            ids = torch.tensor(prompts, dtype=torch.long)
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=eos)
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up at this shape
            runs = []
            for _ in range(spec["repeats"]):
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
                elapsed = time.perf_counter() - start
                generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
                if generated != new * ids.shape[0]:
                    raise SystemExit(f"{args.backend} generated {generated} tokens, expected {new * ids.shape[0]}")
                runs.append(generated / elapsed)
            result["tokens_per_s"][b] = runs
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
