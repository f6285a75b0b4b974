"""Small random causal LMs for the tests of the speed paths (no training)."""

import torch


def tiny_gpt2(dropout: float = 0.0, seed: int = 0, tied: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=50, n_positions=32, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=tied)
    return GPT2LMHeadModel(config)


def tiny_llama(dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                        attention_dropout=dropout))
