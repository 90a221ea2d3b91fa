"""The Transformers in PyTorch: the network at the top, training and Hugging Face conversion beside it.

    attention.py       scaled dot-product and multi-head attention (self and cross, grouped-query)
    gpt.py             the decoder-only Transformer: GPT-2 or Llama-style
    seq2seq.py         the encoder-decoder Transformer of "Attention Is All You Need" (and BART)
    config.py          `GPTConfig`: the hyperparameters that fix a decoder's shape
    seq2seq_config.py  `Seq2SeqConfig`: the same for an encoder-decoder
    json_config.py     what both configs share: `config.json` out and in, unknown fields refused
    norm.py            LayerNorm or RMSNorm
    rotary.py          rotary position embeddings (RoPE)
    kv_cache.py        `BatchKVCache`: the explicit, preallocated key/value cache
    checkpoint.py      model directories: config.json + model.safetensors + tokenizer.json
    generate.py        `attnserve generate-local`: sampling from a model directory in PyTorch
    training/          training, its data, the model cards and the default-model pick
    hf/                Hugging Face checkpoints to and from model directories
"""
