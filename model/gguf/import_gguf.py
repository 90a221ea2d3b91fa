"""Import a GGUF file (llama.cpp's and Ollama's model format) into an attnserve model directory.

    attnserve import-gguf <file.gguf> -o <model dir>     # or: python -m model.gguf.import_gguf ...

The file is read with the `gguf` package (`GGUFReader`) and written, in a temporary folder, as the
Hugging Face directory it describes: config.json from its `<arch>.*` metadata, model.safetensors with
its tensors dequantized to float32 and renamed back (architectures.py), tokenizer.json and the files
beside it from its `tokenizer.ggml.*` metadata and `tokenizer.chat_template` (tokenizer.py). That
directory is then imported by `import_hf`, as `attnserve import-hf` would import it.

Weights of the kinds in DEQUANTIZED are dequantized to float32 with `gguf.quants.dequantize`: the
numbers are exactly the ones llama.cpp computes with. `attnserve export --int8/--int4` then makes the
bundle's own reduced-precision graphs. Any other kind, architecture or tokenizer is refused by name.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file

from model.gguf import architectures, tokenizer
from model.hf.cli import conversion_main
from model.hf.import_hf import import_hf

Q = GGMLQuantizationType
DEQUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K)


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file as a Python value (a list for an array); the GGUF. header fields
    are left out."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def check_kind(t: ReaderTensor) -> None:
    if t.tensor_type not in DEQUANTIZED:
        raise architectures.UnsupportedGGUF(
            f"tensor {t.name} is {t.tensor_type.name}, which is not read (read: "
            f"{', '.join(q.name for q in DEQUANTIZED)}); requantize the model to one of those with llama-quantize")


def float32_tensor(t: ReaderTensor) -> np.ndarray:
    """A tensor of the file as float32 in numpy's row-major shape (GGUF lists dimensions innermost first)."""
    check_kind(t)
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def write_hf_dir(reader: GGUFReader, out: Path) -> str:
    """The Hugging Face directory the file describes, written into `out`; returns the GGUF architecture."""
    meta = metadata(reader)
    arch, _ = architectures.architecture(meta)
    hf_tokenizer = tokenizer.build_tokenizer(meta)
    for t in reader.tensors:  # every refusal before the first weight is dequantized
        check_kind(t)
        if t.name not in architectures.CONFIG_TENSORS:
            architectures.hf_name(arch, t.name)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    config_tensors = {t.name: float32_tensor(t) for t in reader.tensors if t.name in architectures.CONFIG_TENSORS}
    config = architectures.hf_config(arch, meta, shapes, config_tensors)
    tensors = dict(architectures.hf_tensor(arch, t.name, float32_tensor(t), config) for t in reader.tensors
                   if t.name not in architectures.CONFIG_TENSORS)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    hf_tokenizer.save(str(out / "tokenizer.json"))
    for name, content in tokenizer.tokenizer_files(meta).items():
        if content:
            (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False))
    return arch


def import_gguf(src: str | Path, out: str | Path) -> Path:
    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found")
    reader = GGUFReader(src)
    with tempfile.TemporaryDirectory(prefix="attnserve-gguf-") as hf_dir:
        arch = write_hf_dir(reader, Path(hf_dir))
        return import_hf(hf_dir, out, source=f"gguf-{arch}")


def main(argv: list[str] | None = None) -> int:
    return conversion_main(argv, "attnserve import-gguf", __doc__.split("\n\n")[0],
                           f"GGUF file (architectures: {', '.join(architectures.importable())})",
                           "attnserve model directory to write", import_gguf, (ValueError, FileNotFoundError, KeyError))


if __name__ == "__main__":
    raise SystemExit(main())
