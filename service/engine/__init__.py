"""The engine: continuous batching over a KV cache in blocks, in token ids. No grpc, no HTTP, no torch.

    core.py             Engine.step(): schedule -> run the model -> sample -> update and emit; Engine.generate()
    run_step.py         the run phase: the step's model calls in order, and who fails when one raises
    sample_step.py      the sample phase: logits -> each row's tokens (sampled, a beam step, or drafts kept)
    output.py           the output step: chosen tokens appended, checked for a stop, emitted; a sequence fed or finished
    step_data.py        what flows between the phases: RunnerOutput, Sampled, Output
    async_engine.py     the engine on its own thread, behind an asyncio API (AsyncEngine, RequestStream)
    request.py          what goes in and comes out: GenerationRequest and its parameters, TokenEvent
    request_builder.py  a request validated and built into its state (RequestBuilder)
    sequence.py         per-request and per-sequence state (the engine thread's alone)
    scheduler.py        who runs in the next step, under the token budget; admission, growth and preemption by KV blocks
    kv_cache.py         the KV cache: dense slots of address space, memory in blocks taken as tokens are written
    prefix_cache.py     keys and values of prompt prefixes, in blocks, for later prompts that share them
    cache_plan.py       the memory budget: the model, the activations, the KV blocks and the prefix cache
    sampler.py          logits -> next tokens for a whole batch, per-row parameters and RNG
    beam_search.py      a request's beam search rule; beam_step.py applies its next beams
    speculative.py      prompt lookup and the acceptance rule; speculative_step.py the policy and its calls
    counters.py         the engine's running totals, for its snapshot
    detokenizer.py      token ids -> text deltas, with stop strings
    errors.py           what the engine reports to a caller
    config.py           EngineConfig
"""
