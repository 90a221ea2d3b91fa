"""The serving graph with its KV cache kept in fewer bytes: float16, or int8 with a scale per channel.

    model = with_kv_cache(onnx.load(static), "float16")
    model = with_kv_cache(onnx.load(static), "int8", scales=kv_scales(static, ...))

Only the cache changes; the weights, and every op outside the attention, stay as they are. onnxruntime's
CPU `GroupQueryAttention` (1.32) is registered for these pairs of T (query, output) and T_CACHE (past,
present): (float, float|int8|uint8) and (float16, float16|int8|uint8); its k_scale/v_scale are float.
So:
- **float16**: the op runs in float16. Its query/key/value (and rotary cos/sin) are Cast to float16
  before it and its output Cast back to float after it; the cache inputs and outputs are float16. A
  step's new keys and values are rounded to float16 once, when they are written, and so are the query
  and the attention's output.
- **int8**: the op stays in float; the cache is int8 and the op quantizes each new key and value as
  round(x / scale) (half to even, saturating to -128...127), with fixed scales per layer, KV head and channel
  (`k_quant_type` / `v_quant_type` PER_CHANNEL), stored in the graph. The scales come from the keys and
  values the fp32 graph writes for text it samples itself (`kv_scales`), with headroom. The op reads
  every position back from the cache, its own new ones included, so a prompt cut into chunks reads what
  it reads whole.

Both keep a row's numbers to itself: the rounding is elementwise and the scales are constants, so a
row's cache and logits do not depend on the other rows of its batch (the self-check probes it).
docs/engine.md has what each costs in quality and speed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.external_data import array_of
from service.runtime.bundle import LOGITS_INDEX, KvDtype
from service.runtime.probes import sample_tokens

ELEMENT_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int8": TensorProto.INT8}
INT8_MAX = 127
# scales leave this much room above the largest |value| the calibration text wrote, for text it did not see
SCALE_HEADROOM = 1.25
CALIBRATION_ROWS, CALIBRATION_TOKENS = 8, 256  # what kv_scales samples: rows of at most this many tokens
# GroupQueryAttention's inputs by position (onnxruntime 1.32's schema)
QUERY, KEY, VALUE, PAST_KEY, PAST_VALUE = 0, 1, 2, 3, 4
COS, SIN = 7, 8
K_SCALE, V_SCALE = 12, 13


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


def with_kv_cache(model: onnx.ModelProto, dtype: KvDtype, scales: list[tuple[np.ndarray, np.ndarray]] | None = None,
                  graph_dir: Path | None = None) -> onnx.ModelProto:
    """`model` (a serving graph whose cache is float) with its KV cache in `dtype`. `scales`: for int8, per
    GroupQueryAttention node in graph order, the key and the value scales, each [kv_heads, d_head]. `graph_dir`:
    where the data file of a graph loaded without its weights is (`export.external_data.load_graph`)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = attention_nodes(out)
    if dtype == "float32":
        return out
    if dtype == "int8" and (scales is None or len(scales) != len(nodes)):
        raise ValueError(f"an int8 KV cache needs a key and a value scale for each of the {len(nodes)} attention "
                         f"nodes (got {0 if scales is None else len(scales)})")
    cache_names, rewritten = set(), []
    layer = 0
    for node in out.graph.node:
        node = _copy(node)
        if node.op_type != "GroupQueryAttention":
            rewritten.append(node)
            continue
        cache_names.update([*node.input[PAST_KEY:PAST_VALUE + 1], *node.output[1:3]])
        if dtype == "float16":
            rewritten += _run_in_float16(out.graph, node, graph_dir)
        else:
            _quantized_cache(out.graph, node, layer, *scales[layer])
            rewritten.append(node)
        layer += 1
    del out.graph.node[:]
    out.graph.node.extend(rewritten)
    used = {name for node in rewritten for name in node.input}
    unused = [t for t in out.graph.initializer if t.name not in used]  # the float rotary tables, replaced
    for t in unused:
        out.graph.initializer.remove(t)
    for value in [*out.graph.input, *out.graph.output]:
        if value.name in cache_names:
            value.type.tensor_type.elem_type = ELEMENT_TYPE[dtype]
    if graph_dir is None:  # a graph whose weights are elsewhere is checked where it is written, by its path
        onnx.checker.check_model(out)
    return out


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy


def _run_in_float16(graph: onnx.GraphProto, node: onnx.NodeProto, graph_dir: Path | None) -> list[onnx.NodeProto]:
    """[Casts to float16, the node, the Cast back]: its query, key, value and cos/sin in float16, its output
    back in float."""
    initializers = {t.name: t for t in graph.initializer}
    casts = []
    for index in (QUERY, KEY, VALUE, COS, SIN):
        name = node.input[index] if index < len(node.input) else ""
        if not name:
            continue
        half = f"{name}_fp16"
        if name in initializers:  # the rotary tables: one float16 copy, shared by every layer
            if half not in initializers:
                table = array_of(initializers[name], graph_dir or Path()).astype(np.float16)
                graph.initializer.append(numpy_helper.from_array(table, half))
                initializers[half] = graph.initializer[-1]
        else:
            casts.append(helper.make_node("Cast", [name], [half], name=f"Cast_{half}", to=TensorProto.FLOAT16))
        node.input[index] = half
    output = node.output[0]
    node.output[0] = f"{output}_fp16"
    back = helper.make_node("Cast", [node.output[0]], [output], name=f"Cast_{output}", to=TensorProto.FLOAT)
    return [*casts, node, back]


def _quantized_cache(graph: onnx.GraphProto, node: onnx.NodeProto, layer: int, k_scale: np.ndarray,
                     v_scale: np.ndarray) -> None:
    """Give the node its int8 cache's scales, [1, kv_heads, 1, d_head], and the attributes that read them."""
    names = []
    for kind, scale in (("k", k_scale), ("v", v_scale)):
        scale = np.asarray(scale, dtype=np.float32)
        names.append(f"kv_cache.{layer}.{kind}_scale")
        graph.initializer.append(numpy_helper.from_array(scale.reshape(1, scale.shape[0], 1, scale.shape[1]),
                                                         names[-1]))
    while len(node.input) < K_SCALE:
        node.input.append("")
    node.input[K_SCALE:V_SCALE + 1] = names
    node.attribute.extend([helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                           helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                           helper.make_attribute("kv_cache_bit_width", 8)])


def scales_of(largest: np.ndarray, headroom: float = SCALE_HEADROOM) -> np.ndarray:
    """int8 scales for a channel whose largest |value| is `largest`: `headroom` times it maps to 127."""
    scale = largest * headroom / INT8_MAX
    return np.where(scale > 0, scale, 1.0).astype(np.float32)


def kv_scales(static: Path, n_layer: int, tokens: int, start_id: int, vocab: int, rows: int = CALIBRATION_ROWS,
              seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, the int8 key and value scales [kv_heads, d_head] from `rows` sequences of `tokens` tokens
    that the fp32 serving graph at `static` samples itself (temperature 1) from `start_id`, one decode step
    at a time: the largest |value| each channel held over every written position, with `SCALE_HEADROOM`. No
    text is needed."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(static), providers=["CPUExecutionProvider"])
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    reads_index = any(i.name == LOGITS_INDEX for i in session.get_inputs())
    heads, d_head = past[0].shape[1], past[0].shape[3]
    cache = [np.zeros((rows, heads, tokens, d_head), np.float32) for _ in past]
    rng = np.random.default_rng(seed)
    ids = np.full((rows, 1), start_id, dtype=np.int64)
    for t in range(tokens):
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("position_ids", np.full((rows, 1), t, dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", np.full(rows, t, dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(t + 1, dtype=np.int32))
        if reads_index:
            binding.bind_cpu_input(LOGITS_INDEX, np.zeros((rows, 1), dtype=np.int64))
        binding.bind_output("logits", "cpu")
        for spec, buf in zip(past, cache, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            binding.bind_ortvalue_input(spec.name, value)
            binding.bind_ortvalue_output(spec.name.replace("past_key_values", "present"), value)
        session.run_with_iobinding(binding)
        ids = sample_tokens(binding.get_outputs()[0].numpy()[:, -1, :vocab], rng)[:, None].astype(np.int64)
    largest = [np.abs(buf).max(axis=(0, 2)) for buf in cache]  # [kv_heads, d_head] per buffer
    assert len(largest) == 2 * n_layer, f"{static} has {len(largest)} cache buffers, expected {2 * n_layer}"
    return [(scales_of(largest[2 * i]), scales_of(largest[2 * i + 1])) for i in range(n_layer)]
