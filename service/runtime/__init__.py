"""The runtime: loads a bundle and runs its graphs on onnxruntime. numpy only, no torch.

    bundle.py         the bundle format (bundle.json): the contract with `attnserve export`
    tokenizer.py      the bundle's tokenizer (tokenizer.json), the other half of that contract
    session.py        a bundle graph in an onnxruntime session, checked against the contract
    static_runner.py  the serving runner: the static-cache graph, bound once to the engine's KV cache
    concat_runner.py  the reference runner: the concat-cache graph as a step function (export checks, benchmarks)
    seq2seq_runner.py the encoder-decoder's runner: the encoder once per source, then the decoder's static cache
    chat_template.py  the model's chat template: messages -> prompt text, as transformers renders it
    graph_choice.py   which graph to serve on this CPU (`--graph auto`)
    choice_cache.py   the graph choice and its self-check kept per bundle, CPU and settings, for restarts
    self_check.py     a graph against the fp32 graph, and for batch invariance, before serving
    seq2seq_check.py  the self-check's probe for an encoder-decoder
    probes.py         what the self-check measures with, for either kind of model: Agreement, Invariance
    cpu.py            this CPU's model, cores and instruction-set flags
    memory.py         the memory limit and budget; address space whose pages are taken on write
"""
