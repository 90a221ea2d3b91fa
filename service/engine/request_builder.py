"""Requests in: a `GenerationRequest` validated against the model and the engine's limits, and built into the
engine's state of it: a `RequestState` with one `Sequence` per sample or beam, each with its own sampling
(seeded generator, penalties' history, the ids suppressed until `min_new_tokens`), text stream and grammar
matcher.

    builder = RequestBuilder(model, tokenizer, limits, context, max_running, eos_ids, grammars)
    state = builder.build(GenerationRequest("r1", prompt_ids))      # raises InvalidRequest naming a bad field

Pure: it reads only what never changes (the model, the limits, the tokenizer), so any thread may build a
request; `Engine.add` hands the state to the engine thread.
"""

from __future__ import annotations

import secrets

import numpy as np

from service.engine.beam_search import BeamSearch
from service.engine.detokenizer import TextStream
from service.engine.errors import InvalidRequest
from service.engine.grammar import Grammar, Grammars
from service.engine.request import EngineLimits, GenerationRequest
from service.engine.sampler import SequenceSampling
from service.engine.sequence import RequestState, Sequence
from service.runtime.bundle import ModelSpec
from service.runtime.tokenizer import Tokenizer


class RequestBuilder:
    def __init__(self, model: ModelSpec, tokenizer: Tokenizer, limits: EngineLimits, context: int, max_running: int,
                 eos_ids: frozenset[int], grammars: Grammars):
        self.model = model
        self.tokenizer = tokenizer  # each sequence's text stream decodes with it
        self.limits = limits
        self.context = context  # positions per sequence, prompt + completion
        self.max_running = max_running  # sequences the engine decodes at once: a request runs at most this many
        self.eos_ids = eos_ids  # every id that ends generation
        self.grammars = grammars  # compiles a constrained request's grammar (cached by content)

    def build(self, request: GenerationRequest, grammar: Grammar | None = None) -> RequestState:
        """Validate `request` (InvalidRequest names the field) and build its state. A constrained request's
        `grammar` is compiled here unless given (`AsyncEngine` compiles it in a worker thread first)."""
        request.validate(self.model.vocab_size, self.context, self.limits)
        if request.slots > self.max_running:
            field = "beam.width" if request.beam is not None else "n"
            raise InvalidRequest(field, f"{request.slots} sequences; this engine runs at most {self.max_running} at "
                                 "once")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        state = RequestState(request, seed)
        # penalties count the tokens the model has generated from: the prompt, or an encoder-decoder's target
        history = [self.model.decoder_start_token_id] if self.model.encoder_decoder else request.prompt_token_ids
        first = SequenceSampling.create(request.sampling, history, self.model.vocab_size, seed,
                                        want_logprobs=request.logprobs, top_logprobs=request.top_logprobs,
                                        suppress=self._suppressed_until_min_tokens(request),
                                        min_tokens=request.stopping.min_new_tokens)
        if request.constraint is not None and grammar is None:
            grammar = self.grammars.compile(request.constraint)
        if request.beam is not None:
            state.beam = BeamSearch(request.beam.width, self.eos_ids | frozenset(request.stopping.stop_token_ids),
                                    request.stopping.max_new_tokens, request.beam.length_penalty,
                                    request.beam.early_stopping)
        for i in range(request.slots):
            sampling = first if i == 0 else first.fork(i, seed)
            seq = Sequence(state, i, sampling, TextStream(self.tokenizer, request.stopping.stop))
            seq.matcher = grammar.matcher() if grammar is not None else None
            state.seqs.append(seq)
        return state

    def _suppressed_until_min_tokens(self, request: GenerationRequest) -> np.ndarray:
        """The ids that would end a sequence before `min_new_tokens`: its stop ids, and the EOS ids."""
        st = request.stopping
        return np.array(list(st.stop_token_ids) + ([] if st.ignore_eos else sorted(self.eos_ids)), dtype=np.int64)
