"""GGUF files (llama.cpp's and Ollama's model format) into our model directories, through the Hugging Face
importer (numpy and the `gguf` package; torch only in the import_hf step).

    import_gguf.py     `attnserve import-gguf`: read the file, write its Hugging Face directory, import that
    architectures.py   GGUF architectures: config.json from the metadata, tensor names, the q/k row order
    tokenizer.py       tokenizer.json from `tokenizer.ggml.*`, as llama.cpp tokenizes
"""
