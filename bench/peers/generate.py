"""The peers that run Hugging Face's `generate`: transformers, optimum (onnxruntime) and OpenVINO (optimum-intel).

    python bench/peers/generate.py --backend transformers --hf-dir runs/hf --spec spec.json
    .venv-peers/bin/python bench/peers/generate.py --backend optimum --hf-dir runs/hf --model-dir runs/ort --convert
    .venv-peers/bin/python bench/peers/generate.py --backend optimum --hf-dir runs/hf --model-dir runs/ort --spec s.json
    .venv-openvino/bin/python bench/peers/generate.py --backend openvino --precision int8 --hf-dir runs/hf \
        --model-dir runs/ov-int8 --convert     # then again with --spec

It runs in the peer's own interpreter, so it imports nothing from this project but `protocol` (the
peer protocol, standard library only, beside this file). `--convert` exports the Hugging Face directory
to the backend's format into --model-dir and exits, so that the measuring process holds only the model
(its peak RSS is the model's, not the exporter's). With `--spec` it prints the protocol's result.

How each backend is called and set up: docs/BENCHMARKS.md#how-the-hugging-face-peers-are-run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from protocol import Recorder, emit, read_spec

BACKENDS = ("transformers", "optimum", "openvino")


def convert(backend: str, precision: str, hf_dir: str, model_dir: Path) -> None:
    if backend == "optimum":
        from optimum.onnxruntime import ORTModelForCausalLM

        ORTModelForCausalLM.from_pretrained(hf_dir, export=True, use_cache=True).save_pretrained(model_dir)
    elif backend == "openvino":
        from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

        extra = ({"quantization_config": OVWeightQuantizationConfig(bits=8)} if precision == "int8"
                 else {"load_in_8bit": False})
        OVModelForCausalLM.from_pretrained(hf_dir, export=True, compile=False, **extra).save_pretrained(model_dir)
    else:
        raise SystemExit(f"{backend} loads the Hugging Face directory as it is; nothing to convert")


def ov_config(precision: str) -> dict:
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "INFERENCE_PRECISION_HINT": "f32"}
    if precision == "fp32":
        config["KV_CACHE_PRECISION"] = "f32"
    return config


def load(backend: str, precision: str, hf_dir: str, model_dir: Path | None):
    if backend == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if model_dir is None or not model_dir.is_dir():
        raise SystemExit(f"{backend}: no converted model in {model_dir} (run with --convert first)")
    if backend == "optimum":
        from optimum.onnxruntime import ORTModelForCausalLM

        return ORTModelForCausalLM.from_pretrained(model_dir, use_cache=True, provider="CPUExecutionProvider")
    from optimum.intel import OVModelForCausalLM

    return OVModelForCausalLM.from_pretrained(model_dir, ov_config=ov_config(precision))


def settings(backend: str, precision: str, model) -> dict:
    import torch

    out = {"api": "generate (static batch for the streams)", "ttft": "streamer: first new tokens",
           "greedy": "do_sample=False, min_new_tokens = max_new_tokens"}
    if backend == "transformers":
        out |= {"threads": torch.get_num_threads(), "dtype": "float32",
                "attention": getattr(model.config, "_attn_implementation", None)}
    elif backend == "optimum":
        out |= {"provider": "CPUExecutionProvider", "threads": "onnxruntime default (one per physical core)",
                "use_cache": True}
    else:
        out |= {"ov_config": ov_config(precision),
                "weights": "int8 (nncf weight-only, OVWeightQuantizationConfig(bits=8))" if precision == "int8"
                else "fp32 (load_in_8bit=False)",
                "threads": "OpenVINO default (LATENCY hint: the cores of one socket)"}
    return out


def versions(backend: str) -> dict:
    from importlib.metadata import version

    names = {"transformers": ["torch", "transformers"],
             "optimum": ["torch", "transformers", "optimum", "optimum-onnx", "onnxruntime"],
             "openvino": ["torch", "transformers", "optimum", "optimum-intel", "openvino", "nncf"]}[backend]
    out = {"python": sys.version.split()[0]}
    for name in names:
        try:
            out[name] = version(name)
        except Exception:  # an optional package the backend runs without
            pass
    return out


class FirstTokens:
    """A `generate` streamer that notes when the first new tokens arrive (its first put is the prompt)."""

    def __init__(self):
        self.puts = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def generate(model, prompts: list[list[int]], new_tokens: int, eos) -> tuple[list[list[int]], float, float]:
    """Greedy generation of exactly `new_tokens` for `prompts` (one static batch):
    (new ids per row, seconds to the last token, seconds to the first)."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    streamer = FirstTokens()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=eos, streamer=streamer)
    elapsed = time.perf_counter() - start
    new = out[:, ids.shape[1]:].tolist()
    if any(len(row) != new_tokens for row in new):
        raise SystemExit(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected {new_tokens}")
    return new, elapsed, streamer.first - start


def measure(model, spec: dict) -> tuple[Recorder, list[list[int]]]:
    import torch

    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    new = spec["new_tokens"]
    rec = Recorder(spec)
    with torch.inference_mode():
        generate(model, spec["single"][:1], min(new, 4), eos)  # warm-up at both shapes
        tokens, _, _ = generate(model, spec["streams"], new, eos)  # the greedy ids, and a full warm-up
        for _ in range(spec["repeats"]):
            times, ttfts, alone = [], [], []
            for prompt in spec["single"]:
                ids, seconds, ttft = generate(model, [prompt], new, eos)
                times.append(seconds)
                ttfts.append(ttft)
                alone.append(ids[0])
            rec.add_single(times, ttfts, alone)
            _, seconds, ttft = generate(model, spec["streams"], new, eos)
            rec.add_streams(seconds, [ttft] * len(spec["streams"]))
    return rec, tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--precision", choices=["fp32", "int8"], default="fp32", help="openvino: int8 weights")
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--model-dir", type=Path, help="optimum, openvino: the converted model")
    p.add_argument("--convert", action="store_true", help="convert into --model-dir and exit")
    p.add_argument("--spec", help="the run spec (peer protocol)")
    args = p.parse_args(argv)
    if args.precision != "fp32" and args.backend != "openvino":
        p.error(f"{args.backend} runs fp32 only here")
    if args.convert:
        convert(args.backend, args.precision, args.hf_dir, args.model_dir)
        return 0
    if not args.spec:
        p.error("--spec or --convert")
    spec = read_spec(args.spec)
    model = load(args.backend, args.precision, args.hf_dir, args.model_dir)
    rec, tokens = measure(model, spec)
    name = {"transformers": "transformers", "optimum": "optimum (onnxruntime)", "openvino": "OpenVINO"}[args.backend]
    emit(rec.result(name, args.precision, settings(args.backend, args.precision, model), versions(args.backend),
                    tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
