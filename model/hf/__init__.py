"""Hugging Face checkpoints to and from our model directories (torch).

    import_hf.py  `attnserve import-hf`: GPT-2, the Llama family and BART into a model directory
    export_hf.py  `attnserve export-hf`: a model directory as GPT-2, Llama or BART
    llama.py      the Llama family (Llama, Qwen2, Mistral, Qwen3, SmolLM3, Phi-3/4): config and parameter names
    bart.py       `BartForConditionalGeneration` <-> our `EncoderDecoder`, both ways
    cli.py        the command line both conversions share
"""
