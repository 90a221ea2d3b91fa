"""The encoder-decoder runner: the encoder graph once per source, the decoder graph every step. numpy only.

    runner.prefill_batch(first_slot, sources)   encode the sources into slots first_slot ..., then decode
                                                each one's decoder start token: logits [k, vocab]
    runner.decode(ids, positions)               one target token for each of slots [0, n)

It is the static runner (`static_runner.py`) with one more kind of state per slot: besides the
decoder's self-attention cache, which grows by a position a step and is bound as past and present
exactly as a decoder-only model's, each slot holds its source's cross-attention keys and values and
its source mask, written once by the encoder and read by every decoder step:

    cross key    [slots, heads, max_source, d_head]   (bundles exported before the fused attention
                                                       operators: [slots, heads, d_head, max_source])
    cross value  [slots, heads, max_source, d_head]
    source mask  [slots, max_source]                  1 = a real source token

`slot_state(n)` allocates them; the KV cache keeps them with its slots (a slot that moves takes its
source along). A source shorter than max_source leaves the rest of its slot masked.

A small model's calls run on one thread. Its steps are so short that onnxruntime's second thread costs
more than it brings: served in-process, the G2P model was faster on one thread than on two at every
batch size up to 32, alone and 32 at a time (interleaved comparisons in separate processes).
So when onnxruntime may use every core (`intra_op_threads` 0) and the pair's
files are at most `SMALL_GRAPH_BYTES`, each graph is opened a second time on one thread, and a decode
call of at most `SMALL_ROWS` rows, or an encoding of at most `SMALL_SOURCES` sources, runs on it (larger
calls, and larger models, on every core). A row's logits are the same bits on either session: the
matmuls split their outputs across threads, never a sum, and the start-up self-check's invariance
probe compares a row alone with the same row in a batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.runtime.bundle import BundleError, cross_kv_names
from service.runtime.cpu import cpu_info
from service.runtime.session import Provider, check_io, create_session
from service.runtime.static_runner import StaticRunner

SMALL_ROWS = 32  # decode calls of at most this many rows run on the one-thread session
SMALL_SOURCES = 32  # encodings of at most this many sources run on the one-thread encoder
SMALL_GRAPH_BYTES = 64 << 20  # the pair is opened a second time only if its files are this small


class Seq2SeqRunner(StaticRunner):
    def __init__(self, bundle_dir: str | Path, graph: str | None = None, provider: Provider = "auto",
                 intra_op_threads: int = 0, inter_op_threads: int = 1, max_source: int | None = None,
                 spin: bool = True):
        super().__init__(bundle_dir, graph, provider, intra_op_threads, inter_op_threads, spin)
        m = self.manifest.model
        if not m.encoder_decoder:
            raise BundleError(f"{self.bundle_dir} holds a decoder-only model, not an encoder-decoder")
        spec = self.manifest.encoder_for(self.graph_name)
        self.encoder = create_session(self.bundle_dir / spec.file, provider, intra_op_threads, inter_op_threads, spin)
        check_io(self.encoder, spec, m.n_layer, m.kind, encoder=True)
        files = [self.bundle_dir / spec.file, self.bundle_dir / self.spec.file]
        self.one_thread: tuple[ort.InferenceSession, ort.InferenceSession] | None = None  # (encoder, decoder)
        small = sum(f.stat().st_size for f in files) <= SMALL_GRAPH_BYTES
        on_cpu = self.session.get_providers()[0] == "CPUExecutionProvider"
        if intra_op_threads == 0 and cpu_info().cores > 1 and small and on_cpu:
            self.one_thread = tuple(create_session(f, "cpu", 1, inter_op_threads) for f in files)
        if max_source is not None and not 1 <= max_source <= m.n_src_ctx:
            raise ValueError(f"max_source={max_source} is outside [1, {m.n_src_ctx}] (the model's longest source)")
        self.max_source = max_source or m.n_src_ctx  # source positions each slot holds
        self.start_id = m.decoder_start_token_id
        self.pad_id = m.pad_token_id
        self._past_names = self._past_names[:2 * m.n_layer]  # the inputs after them are the cross state
        self._cross_names = cross_kv_names(m.n_layer)
        self.keys_transposed = spec.outputs[0].shape[2] == "d_head"  # the layout of older bundles
        self.source_state: list[np.ndarray] = []  # the attached cross keys and values (graph order), then the mask

    # ---- per-slot source state --------------------------------------------------------------------

    def slot_state(self, n_slots: int, max_source: int | None = None) -> list[np.ndarray]:
        """Zeroed cross keys and values (graph order) and the source mask, for `n_slots` slots."""
        s, S = self.cache_shape, max_source or self.max_source
        state = []
        for _ in range(s.n_layer):
            key = (n_slots, s.n_head, s.d_head, S) if self.keys_transposed else (n_slots, s.n_head, S, s.d_head)
            state += [np.zeros(key, dtype=s.dtype), np.zeros((n_slots, s.n_head, S, s.d_head), dtype=s.dtype)]
        return state + [np.zeros((n_slots, S), dtype=np.int64)]

    def _session_for(self, rows: int) -> ort.InferenceSession:
        return self.one_thread[1] if self.one_thread and rows <= SMALL_ROWS else self.session

    def decode_widest(self, rows: int) -> None:
        """As the decoder-only runner's, for each session a decode of at most `rows` rows runs on."""
        super().decode_widest(rows)
        if self.one_thread and rows > SMALL_ROWS:
            super().decode_widest(SMALL_ROWS)

    def slot_state_bytes(self) -> int:
        return sum(a.nbytes for a in self.slot_state(1))

    def attach(self, buffers: list[np.ndarray], state: list[np.ndarray] | None = None) -> None:
        super().attach(buffers)
        self.source_state = state if state is not None else self.slot_state(buffers[0].shape[0])
        n = buffers[0].shape[0]
        assert len(self.source_state) == len(self._cross_names) + 1 and self.source_state[-1].shape[0] == n

    def _bind_cache(self, binding: ort.IOBinding, first: int, count: int) -> None:
        super()._bind_cache(binding, first, count)
        for name, buf in zip([*self._cross_names, "encoder_attention_mask"], self.source_state, strict=True):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buf[first:first + count]))

    # ---- sources in -------------------------------------------------------------------------------

    def encode(self, first_slot: int, sources: list[list[int]]) -> None:
        """Run the encoder over `sources` (padded together) and write their state into consecutive slots."""
        k, width = len(sources), max(len(src) for src in sources)
        if width > self.source_state[-1].shape[1]:
            raise ValueError(f"a source of {width} tokens exceeds the {self.source_state[-1].shape[1]} each slot holds")
        ids = np.full((k, width), self.pad_id, dtype=np.int64)
        mask = np.zeros((k, width), dtype=np.int64)
        for i, src in enumerate(sources):
            ids[i, :len(src)] = src
            mask[i, :len(src)] = 1
        encoder = self.one_thread[0] if self.one_thread and k <= SMALL_SOURCES else self.encoder
        outputs = encoder.run(self._cross_names, {"input_ids": ids, "attention_mask": mask})
        rows = slice(first_slot, first_slot + k)
        for name, out, buf in zip(self._cross_names, outputs, self.source_state[:-1], strict=True):
            if name.endswith("key") and self.keys_transposed:
                buf[rows, :, :, :width] = out
            else:
                buf[rows, :, :width] = out
        self.source_state[-1][rows] = 0
        self.source_state[-1][rows, :width] = mask

    def prefill_batch(self, first_slot: int, prompts: list[list[int]], every_position: bool = False) -> np.ndarray:
        """Encode each source (a prompt, for the engine) into its slot and decode the decoder start token at
        position 0: the logits of each target's first token, [k, vocab]."""
        if every_position:
            raise ValueError("an encoder-decoder scores targets, not its sources: use decode_targets")
        self.encode(first_slot, prompts)
        k = len(prompts)
        return self._prefill(first_slot, np.full((k, 1), self.start_id, dtype=np.int64), np.zeros((k, 1), np.int64),
                             np.zeros(k, dtype=np.int32), 1, np.zeros((k, 1), np.int64))[:, 0]

    def prefill(self, slot: int, ids: list[int], start: int, every_position: bool = False) -> np.ndarray:
        """Encode the source `ids` into `slot`: its target's first logits [vocab]."""
        if start != 0:
            raise ValueError("a source is encoded whole: it cannot continue from position "
                             f"{start} (prefix caching and chunked prefill do not apply to an encoder-decoder)")
        return self.prefill_batch(slot, [ids], every_position)[0]

    def decode_targets(self, first_slot: int, targets: list[list[int]]) -> np.ndarray:
        """Teacher-forced logits of whole targets (each starting with the decoder start token) for slots whose
        sources are encoded: [k, longest, vocab]."""
        k, width = len(targets), max(len(t) for t in targets)
        ids = np.zeros((k, width), dtype=np.int64)
        for i, t in enumerate(targets):
            ids[i, :len(t)] = t
        lengths = np.array([len(t) for t in targets])
        every = np.tile(np.arange(width), (k, 1))
        return self._prefill(first_slot, ids, every, (lengths - 1).astype(np.int32), width, every)
