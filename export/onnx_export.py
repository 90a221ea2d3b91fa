"""Export a GPT to ONNX with its KV cache as graph inputs and outputs.

The graph follows the names optimum and onnxruntime-genai use:

    inputs   input_ids             int64 [batch, seq]
             attention_mask        int64 [batch, past_seq + seq]   1 = attend, 0 = padding
             position_ids          int64 [batch, seq]
             past_key_values.{i}.key / .value   float [batch, n_head, past_seq, d_head]
    outputs  logits                float [batch, seq, vocab]
             present.{i}.key / .value           float [batch, n_head, past_seq + seq, d_head]

One graph serves prefill (past_seq = 0) and decode (past_seq > 0). The cache grows by
concatenation here; the attention is the explicit formula, traced from the same `GPT.forward`
the tests pin against the textbook maths.

The weights go to `<graph>.data` beside the graph (`export/external_data.py`). torch's exporter would
serialise them into the graph, then parse that back (the bytes and the proto: two copies more of the
model), so the graph is traced without them and its initializers, as the exporter settles them (constant
folded, deduplicated), are written one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from export.external_data import DataFile
from model.gpt import GPT
from service.runtime.bundle import decoder_io_names

DEFAULT_OPSET = 17


class ConcatKVCache:
    """A `BatchKVCache` stand-in for export: past tensors in, concatenated present tensors out."""

    def __init__(self, past: list[tuple[Tensor, Tensor]]):
        self.past = past
        self.present: list[tuple[Tensor, Tensor]] = []

    @property
    def length(self) -> int:
        return self.past[0][0].shape[2]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        past_k, past_v = self.past[layer]
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)  # (B, H, past + T, D)
        self.present.append((k, v))
        return k, v

    def advance(self, n: int) -> None:
        pass  # the graph's outputs carry the new length


class DecoderWithPast(nn.Module):
    """(input_ids, attention_mask, position_ids, *past) -> (logits, *present), flat for ONNX."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *past_flat: Tensor):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        cache = ConcatKVCache(past)
        logits = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids, kv_cache=cache)
        return (logits, *[t for kv in cache.present for t in kv])


def sample_inputs(model: GPT, batch: int = 2, seq: int = 3, past: int = 4) -> tuple[Tensor, ...]:
    c = model.config
    ids = torch.randint(0, c.vocab_size, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv = [torch.randn(batch, c.kv_heads, past, c.d_head) for _ in range(2 * c.n_layer)]
    return (ids, mask, pos, *kv)


@contextmanager
def exported_initializers() -> Iterator[dict[str, Tensor]]:
    """The initializers of a TorchScript export run inside the block, by name, as its serialiser receives them
    (after constant folding and deduplication), even with export_params=False. The exporter has no public way
    to hand them over, so the last pass before serialisation is wrapped; `export_decoder` checks that it ran."""
    captured: dict[str, Tensor] = {}
    deduplicate = torch._C._jit_pass_onnx_deduplicate_initializers

    def capture(*args, **kwargs):
        params = deduplicate(*args, **kwargs)
        captured.update(params)
        return params

    torch._C._jit_pass_onnx_deduplicate_initializers = capture
    try:
        yield captured
    finally:
        torch._C._jit_pass_onnx_deduplicate_initializers = deduplicate


def attach_initializers(path: Path, initializers: dict[str, Tensor], inputs: list[str]) -> None:
    """The graph at `path`, exported without its parameters (they are graph inputs beyond `inputs`), with
    them as initializers instead, written to its data file one at a time (each freed once written)."""
    graph = onnx.load(str(path))
    params = [i for i in graph.graph.input if i.name not in inputs]
    if {i.name for i in params} != set(initializers):
        raise RuntimeError(f"the exported graph's parameters {sorted(i.name for i in params)[:5]}... are not the "
                           f"initializers torch's exporter settled on {sorted(initializers)[:5]}...: this torch "
                           f"{torch.__version__} exports otherwise")
    for i in params:
        graph.graph.input.remove(i)
    with DataFile(path) as data:
        for name in list(initializers):
            graph.graph.initializer.append(data.tensor(initializers.pop(name).detach().numpy(), name))
    onnx.save(graph, str(path))


def export_options(model: GPT, opset: int = DEFAULT_OPSET) -> dict:
    """torch.onnx.export's arguments for the decoder graph (its names, dynamic axes and opset), but the weights'."""
    inputs, outputs = decoder_io_names(model.config.n_layer)
    dynamic_axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total_seq"},
                    "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    for name in inputs[3:]:
        dynamic_axes[name] = {0: "batch", 2: "past_seq"}
    for name in outputs[1:]:
        dynamic_axes[name] = {0: "batch", 2: "total_seq"}
    return dict(input_names=inputs, output_names=outputs, dynamic_axes=dynamic_axes, opset_version=opset,
                do_constant_folding=True, dynamo=False)


def export_decoder(model: GPT, path: str | Path, opset: int = DEFAULT_OPSET) -> Path:
    """Write the decoder graph to `path`, its weights to `path`.data beside it."""
    model = model.eval()
    for block in model.blocks:
        block.attn.use_sdpa = False  # the explicit formula exports to plain, portable ops
    options = export_options(model, opset)
    path = Path(path)
    with torch.no_grad(), exported_initializers() as initializers:
        torch.onnx.export(DecoderWithPast(model), sample_inputs(model), str(path), export_params=False, **options)
    attach_initializers(path, initializers, options["input_names"])
    return path
