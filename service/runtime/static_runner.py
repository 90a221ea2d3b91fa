"""The model runner: the static-cache graph on onnxruntime, bound once to the KV cache. numpy only.

    decode(ids, positions)              one new token for each of slots [0, n) -> logits [n, vocab]
    prefill(slot, ids, start)           `ids` for one slot, written from position `start` -> the last one's logits
    prefill_batch(first_slot, prompts)  whole prompts for slots first_slot ... first_slot + k - 1 -> each
                                        prompt's last logits (`every_position=True`: every position's, both)

Past and present of every layer are bound, through IO binding, to the same views of the cache
buffers, so onnxruntime's GroupQueryAttention writes the new keys and values in place and reads
only each row's live prefix. Decode bindings are built once per batch size and reused: a decode
step only writes the small input arrays in place and runs. Prefill binds per call. A graph that takes
`logits_index` computes the vocabulary-wide head only at the positions asked for; one exported before it
computes every position's, and the runner picks the asked ones out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.runtime.bundle import LOGITS_INDEX, BundleError
from service.runtime.memory import lazy_zeros
from service.runtime.session import GraphRunner, Provider

# onnxruntime's GroupQueryAttention computes a call's queries in tiles of this many; a last tile of one
# query rounds differently from the same query inside a tile (measured: docs/engine.md)
QUERY_TILE = 16
ONNX_TYPES = {"float32": "float"}  # numpy dtype names that onnxruntime spells otherwise


@dataclass(frozen=True)
class CacheShape:
    """The graph's KV cache tensors: per layer a key and a value buffer of this shape per slot."""

    n_layer: int
    n_head: int  # key/value heads: a grouped-query model caches fewer than it has query heads
    d_head: int
    max_seq: int  # positions per slot: the model context
    dtype: str = "float32"  # what the graph's cache holds: float32, float16 or int8 (docs/engine.md#kv-precision)

    def buffers(self, n_slots: int) -> list[np.ndarray]:
        """Zeroed key and value buffers [n_slots, n_head, max_seq, d_head], in graph order (layer 0 key,
        layer 0 value, layer 1 key, ...): address space whose pages are taken as positions are written, never
        as huge pages (a probe that writes a few positions of each row takes a few pages, not 2 MiB a row)."""
        dims = (n_slots, self.n_head, self.max_seq, self.d_head)
        return [lazy_zeros(dims, self.dtype) for _ in range(2 * self.n_layer)]

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.n_layer * self.n_head * self.max_seq * self.d_head * np.dtype(self.dtype).itemsize


class StaticRunner(GraphRunner):
    CACHE = "static"

    def __init__(self, bundle_dir: str | Path, graph: str | None = None, provider: Provider = "auto",
                 intra_op_threads: int = 0, inter_op_threads: int = 1, spin: bool = True):
        super().__init__(bundle_dir, graph, provider, intra_op_threads, inter_op_threads, spin)
        m = self.manifest.model
        if m.encoder_decoder and type(self) is StaticRunner:
            raise BundleError(f"{self.bundle_dir} holds an encoder-decoder model: its decoder graph needs the "
                              "source state that Seq2SeqRunner keeps")
        self.vocab_size = m.vocab_size
        self.cache_shape = CacheShape(m.n_layer, m.kv_heads, m.d_head, m.n_ctx, self.spec.cache_dtype)
        self._buffers: list[np.ndarray] = []  # the attached cache
        inputs, outputs = self.session.get_inputs(), [o.name for o in self.session.get_outputs()]
        self.reads_logits_index = any(i.name == LOGITS_INDEX for i in inputs)  # else: every position's logits
        self._past_names = [i.name for i in inputs[4:] if i.name != LOGITS_INDEX]
        self._present_names = outputs[1:]
        cache_type = f"tensor({ONNX_TYPES.get(self.cache_shape.dtype, self.cache_shape.dtype)})"
        if len(inputs) > 4 and inputs[4].type != cache_type:
            raise BundleError(f"{self.spec.file} keeps its KV cache as {inputs[4].type}, but bundle.json says "
                              f"{self.cache_shape.dtype}: they do not belong together")
        self.provider = self.session.get_providers()[0]

    def slot_state(self, n_slots: int) -> list[np.ndarray]:
        """What each slot holds besides its keys and values: nothing for a decoder-only model."""
        return []

    def slot_state_bytes(self) -> int:
        return 0

    def attach(self, buffers: list[np.ndarray], state: list[np.ndarray] | None = None) -> None:
        """Use `buffers` (from `CacheShape.buffers`) as the cache; decode buffers are sized for all of its
        slots, once. A cache may hold fewer positions per slot than the context (probes need only a few)."""
        assert not state, "a decoder-only graph keeps no per-slot state"
        s = self.cache_shape
        n, positions = buffers[0].shape[0], buffers[0].shape[2]
        fits = positions <= s.max_seq and len(buffers) == 2 * s.n_layer and all(
            b.shape == (n, s.n_head, positions, s.d_head) and b.dtype == s.dtype for b in buffers)
        assert fits, f"a cache of {len(buffers)} x {buffers[0].shape} {buffers[0].dtype} does not fit the graph {s}"
        self._buffers = buffers
        self._ids = np.zeros((n, 1), dtype=np.int64)
        self._pos = np.zeros((n, 1), dtype=np.int64)
        self._seqlens = np.zeros(n, dtype=np.int32)
        self._total = np.zeros((), dtype=np.int32)
        self._read = np.zeros((n, 1), dtype=np.int64)  # logits_index of a decode row: its one position
        self._logits = np.zeros((n, 1, self.vocab_size), dtype=np.float32)
        self._decode_bindings: dict[int, ort.IOBinding] = {}

    def _bind_cache(self, binding: ort.IOBinding, first: int, count: int) -> None:
        for past, present, buf in zip(self._past_names, self._present_names, self._buffers, strict=True):
            view = ort.OrtValue.ortvalue_from_numpy(buf[first:first + count])  # shares memory, no copy
            binding.bind_ortvalue_input(past, view)
            binding.bind_ortvalue_output(present, view)

    def _decode_binding(self, n: int) -> ort.IOBinding:
        binding = self._decode_bindings.get(n)
        if binding is None:
            binding = self._session_for(n).io_binding()
            for name, array in (("input_ids", self._ids[:n]), ("position_ids", self._pos[:n]),
                                ("seqlens_k", self._seqlens[:n]), ("total_sequence_length", self._total)):
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
            if self.reads_logits_index:
                binding.bind_ortvalue_input(LOGITS_INDEX, ort.OrtValue.ortvalue_from_numpy(self._read[:n]))
            binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(self._logits[:n]))
            self._bind_cache(binding, 0, n)
            self._decode_bindings[n] = binding
        return binding

    def decode(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Feed ids[i] at position positions[i] of slot i, for slots [0, n). Returns logits [n, vocab].

        The returned array is a view that the next decode overwrites.
        """
        n = len(ids)
        self._ids[:n, 0] = ids
        self._pos[:n, 0] = positions
        self._seqlens[:n] = positions
        self._total[()] = int(positions.max()) + 1
        self._session_for(n).run_with_iobinding(self._decode_binding(n))
        return self._logits[:n, 0]

    def _session_for(self, rows: int) -> ort.InferenceSession:
        """The session a decode call of `rows` rows runs on."""
        return self.session

    @property
    def attached(self) -> bool:
        return bool(self._buffers)

    @contextmanager
    def scratch_cache(self, rows: int, positions: int | None = None) -> Iterator[None]:
        """A cache of its own for probes and timings: `rows` slots of `positions` (default: the context),
        attached for the `with` block. The runner must not be serving meanwhile."""
        self.attach(replace(self.cache_shape, max_seq=positions or self.cache_shape.max_seq).buffers(rows))
        try:
            yield
        finally:
            self._buffers = []
            self._decode_bindings = {}

    def decode_widest(self, rows: int) -> None:
        """Decode once at `rows` rows, into position 0 of slots [0, rows).

        onnxruntime's first run at a batch size allocates buffers sized to it, which narrower batches then
        reuse (docs/engine.md): without this, the requests that widen the batch pay for it. Call it before any
        sequence holds a slot: it writes position 0 of slots that a prefill then overwrites."""
        self.decode(np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64))

    def prefill(self, slot: int, ids: list[int], start: int, every_position: bool = False) -> np.ndarray:
        """Write `ids` into `slot` from position `start` (a prompt or a chunk of one). Returns the last position's
        logits [vocab], or with `every_position` every position's [len, vocab] (scoring, verifying drafts)."""
        n = len(ids)
        s = self._call_length(n, start)
        padded = np.zeros((1, s), dtype=np.int64)  # padding is written past the chunk's end, and overwritten
        padded[0, :n] = ids
        read = np.arange(n)[None] if every_position else np.array([[n - 1]])
        # the padding counts in the row's length: a continued row's start is its length minus the call's
        logits = self._prefill(slot, padded, np.arange(start, start + s)[None],
                               np.array([start + s - 1], dtype=np.int32), start + s, read)
        return logits[0] if every_position else logits[0, 0]

    def _call_length(self, n: int, start: int) -> int:
        """The query length to run `n` new tokens at: n, or n + 1 where onnxruntime's attention would take
        the last of n ≡ 1 (mod 16) queries (a continued one alone included) on another path, whose rounding
        differs. With it, a row's logits and cache are the same bits however its prompt is batched, padded
        or cut into chunks (docs/engine.md). The extra position lies past the row's end, inside its slot."""
        room = self._buffers[0].shape[2] - start
        return n + 1 if n % QUERY_TILE == 1 and (n > 1 or start > 0) and n < room else n

    def prefill_batch(self, first_slot: int, prompts: list[list[int]], every_position: bool = False) -> np.ndarray:
        """Whole prompts into consecutive slots. Returns each prompt's last-position logits [k, vocab],
        or with `every_position` the logits of every position [k, longest, vocab] (for scoring)."""
        k, longest = len(prompts), max(len(p) for p in prompts)
        s = self._call_length(longest, 0)
        ids = np.zeros((k, s), dtype=np.int64)  # right-padded; padding is written past each row's end
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p
        lengths = np.array([len(p) for p in prompts])
        read = np.tile(np.arange(longest), (k, 1)) if every_position else (lengths - 1)[:, None]
        logits = self._prefill(first_slot, ids, np.tile(np.arange(s), (k, 1)), (lengths - 1).astype(np.int32), s,
                               read)
        return logits if every_position else logits[:, 0]

    def _prefill(self, first: int, ids: np.ndarray, pos: np.ndarray, seqlens: np.ndarray, total: int,
                 read: np.ndarray) -> np.ndarray:
        """One prefill call; the logits at positions `read` of each row, [rows, positions read, vocab]."""
        binding = self.session.io_binding()
        for name, array in (("input_ids", ids), ("position_ids", pos.astype(np.int64)), ("seqlens_k", seqlens),
                            ("total_sequence_length", np.array(total, dtype=np.int32))):
            binding.bind_cpu_input(name, array)
        if self.reads_logits_index:
            binding.bind_cpu_input(LOGITS_INDEX, read.astype(np.int64))
        binding.bind_output("logits", "cpu")
        self._bind_cache(binding, first, len(ids))
        self.session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()
        return logits if self.reads_logits_index else np.take_along_axis(logits, read[:, :, None], axis=1)
