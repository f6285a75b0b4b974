"""Small random models (no training) and a tokenizer of token ids, for the decode loop and the batcher."""

import torch

from tests.conftest import CharTokenizer

EOS = 0


def random_gpt2(vocab=60):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # EOS 2: some prompts reach it within a few tokens, others never (seen with this seed)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.5,
                        bos_token_id=2, eos_token_id=2, pad_token_id=2)
    return GPT2LMHeadModel(config).eval()


def random_t5(vocab=60):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=vocab, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                      initializer_factor=8.0, pad_token_id=1, eos_token_id=EOS, decoder_start_token_id=1)
    return T5ForConditionalGeneration(config).eval()


class IdTokenizer(CharTokenizer):
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 5, 6], [40] * 10, [7], [21, 22, 23, 24, 25]]


def id_tokenizer(model):
    tokenizer = IdTokenizer(pad_id=model.config.pad_token_id)
    tokenizer.eos_token_id = model.config.eos_token_id
    return tokenizer
