"""Random-weight Hugging Face Llama-family (and Gemma 2) checkpoints, built and saved in the test (nothing from a hub),
and transformers' own greedy continuation of a prompt, for parity tests."""

from __future__ import annotations

import torch
import transformers

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_key_value_heads=1, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32})),
    "llama-linear-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    # the long-context scalings, trained on 32 positions of the 128 served, so generation crosses the original context
    "qwen2-yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 32})),
    "llama-longrope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [1.0 + 2.0 * i for i in range(8)]})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    # a head width of its own (4 x 32 = 128 wide attention on a 64 wide stream), query/key norms
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    # the second block without rotary positions (1 = rotary, as in SmolLM3's config)
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(no_rope_layers=[1, 0])),
    # rotary on the leading 0.75 of each head as in Phi-4-mini, fused qkv_proj and gate_up_proj
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(partial_rotary_factor=0.75,
                                                                         tie_word_embeddings=False)),
    # Phi-4-mini's layout at a small size: partial rotary (12 of 16 dimensions, 6 factors) with longrope
    "phi4-mini-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        partial_rotary_factor=0.75, tie_word_embeddings=True, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                         "partial_rotary_factor": 0.75, "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [1.0 + 2.0 * i for i in range(6)]})),
    # windows of 8 positions, so that prompts and their continuations cross them; 3 layers for both kinds
    "mistral-window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2-window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Qwen2's rule: with use_sliding_window, the layers from max_window_layers on
    "qwen3-window": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        num_hidden_layers=3, head_dim=32, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
        max_window_layers=1)),
    # with use_sliding_window, the window on the blocks without rotary positions (the second)
    "smollm3-window": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(
        num_hidden_layers=3, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=8)),
    # every layer windowed whenever sliding_window is set (Phi-3-mini-4k: 2047 of 4096), partial rotary
    "phi3-window": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        partial_rotary_factor=0.75, tie_word_embeddings=False, sliding_window=8)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=8.0, final_logit_softcapping=12.0)),
    # a head width of its own, query/key norms, a window on all but every 3rd layer, each kind its own rotary base
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=3, head_dim=32, sliding_window=8, query_pre_attn_scalar=24, sliding_window_pattern=3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}


def save_random(path, tokenizer, family: str, shard: bool = False, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    fields = dict(SMALL, vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.eos_id,
                  pad_token_id=tokenizer.eos_id, **extra)
    fields.update(overrides)
    torch.manual_seed(0)
    hf = model_cls(config_cls(**fields)).eval()
    with torch.no_grad():  # random init is near-uniform; wider weights make every logit matter
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif family.startswith("gemma") and name.endswith("norm.weight"):  # Gemma computes x̂·(1 + w)
                p.normal_(0.0, 0.2)
            elif p.numel() == getattr(hf.config, "head_dim", -1):  # query/key norms: not all ones
                p.normal_(1.0, 0.2)
    hf.save_pretrained(path, max_shard_size="100KB" if shard else "5GB")
    tokenizer.save(path / "tokenizer.json")
    return hf


def greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, each token from a forward of the whole sequence (no cache)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def greedy_hf_cached(hf, prompt: list[int], n: int, first_call: int | None = None) -> list[int]:
    """transformers' greedy continuation through its KV cache, as `generate` runs it: the prompt in one call
    (or its first `first_call` tokens, then the rest), then one token per call, the cache keeping each key as
    the call that wrote it rotated it."""
    tokens = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt[:first_call]]), use_cache=True)
        if first_call is not None:
            out = hf(torch.tensor([prompt[first_call:]]), cache=out.cache, use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens
