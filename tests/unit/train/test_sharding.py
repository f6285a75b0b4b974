"""Which modules train.distributed fsdp makes its units: the blocks the model itself never splits
(``_no_split_modules``), in the encoder and the decoder alike, tied weights left in the root."""

from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

from qatune.train.sharding import units


def test_units_are_the_blocks_the_model_never_splits():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    assert units(gpt2) == list(gpt2.transformer.h)
    # T5's encoder blocks are units too, not only the larger list of decoder blocks.
    t5 = T5ForConditionalGeneration(T5Config(num_layers=2, num_decoder_layers=3, d_model=16, d_kv=8, d_ff=32,
                                             num_heads=2, vocab_size=50))
    assert units(t5) == [*t5.encoder.block, *t5.decoder.block]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Tied(nn.Module):
    """Names its embedding-like block as never split, though the head shares its weight."""

    _no_split_modules = ("Block",)

    def __init__(self):
        super().__init__()
        self.embed = Block()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 4)
        self.head.weight = self.embed.linear.weight


def test_a_block_sharing_a_weight_stays_in_the_root_and_a_model_naming_none_shards_its_largest_list():
    model = Tied()
    assert units(model) == list(model.layers)
    model._no_split_modules = None
    model.layers.append(Block())
    assert units(model) == list(model.layers)
