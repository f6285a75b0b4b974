"""qatune serve's decoding: the answer text released token by token, and the batched decode loop against
model.generate on small random models (no training)."""

import pytest
import torch

from qatune.serve import batching, decoding
from qatune.serve.batching import Finished, Generation, Job
from qatune.serve.decoding import AnswerText, Decoder, Sampling, sample
from tests.conftest import CharTokenizer
from tests.unit.serve.random_models import EOS, PROMPTS, id_tokenizer, random_gpt2, random_t5


def feed(answer: AnswerText, text: str, then_eos: bool = True) -> list[str]:
    pieces = []
    for c in text:
        if answer.finish_reason is None:
            pieces.append(answer.push(ord(c)))
    if then_eos and answer.finish_reason is None:
        pieces.append(answer.push(EOS))
    return pieces


def test_answer_text_is_released_as_it_becomes_final_and_adds_up_to_the_stripped_answer():
    answer = AnswerText(CharTokenizer(), max_tokens=50)
    pieces = feed(answer, " Paris is  big ")
    # the leading space (the answer prefix) never shows; trailing spaces wait for the next word
    assert pieces == ["", "P", "a", "r", "i", "s", "", " i", "s", "", "", "  b", "i", "g", "", ""]
    assert "".join(pieces) == answer.text == "Paris is  big"
    assert answer.finish_reason == "stop" and answer.generated == 16


def test_a_stop_string_ends_the_answer_and_its_start_is_held_back():
    answer = AnswerText(CharTokenizer(), max_tokens=50, stop=("\nQ", "##"))
    pieces = feed(answer, " Paris\nQuestion", then_eos=False)
    assert "".join(pieces) == answer.text == "Paris"
    assert pieces[-2:] == ["", ""]  # "\n" held (it may start "\nQ"), then "\nQ" found: nothing of it is sent
    assert answer.finish_reason == "stop" and answer.generated == 8


def test_a_held_back_stop_prefix_is_released_when_it_turns_out_not_to_be_one():
    answer = AnswerText(CharTokenizer(), max_tokens=50, stop=("##",))
    assert feed(answer, "a#b") == ["a", "", "#b", ""]


def test_max_tokens_ends_the_answer_with_length():
    answer = AnswerText(CharTokenizer(), max_tokens=4)
    assert "".join(feed(answer, "abcdefgh")) == "abcd"
    assert answer.finish_reason == "length" and answer.generated == 4


class ByteTokenizer(CharTokenizer):
    """UTF-8 bytes as tokens (id = byte + 2): a character may take several tokens."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i - 2 for i in ids if i > 1).decode("utf-8", errors="replace")


def test_an_incomplete_utf8_character_is_never_sent():
    answer = AnswerText(ByteTokenizer(), max_tokens=50)
    pieces = [answer.push(b + 2) for b in "né".encode()] + [answer.push(EOS)]
    assert pieces == ["n", "", "é", ""]


def generate_alone(model, prompt, max_new_tokens, seq2seq):
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    eos = model.config.eos_token_id
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=model.config.pad_token_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out[0, 1:].tolist() if seq2seq else out[0, len(prompt):].tolist()
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def decode_batch(model, prompts, max_tokens, seq2seq, sampling=None):
    tokenizer = id_tokenizer(model)
    events = [[] for _ in prompts]
    rows = [batching._Row(Job(Generation(p, sampling or Sampling(max_tokens=max_tokens)), events[i].append), tokenizer)
            for i, p in enumerate(prompts)]
    with torch.inference_mode():
        Decoder(model, tokenizer, seq2seq).run(rows)
    return [row.answer.tokens for row in rows], events


@pytest.mark.parametrize("seq2seq", [False, True], ids=["causal", "seq2seq"])
def test_batched_decoding_gives_what_model_generate_gives_each_prompt_alone(seq2seq):
    model = random_t5() if seq2seq else random_gpt2()
    batched, events = decode_batch(model, PROMPTS, 12, seq2seq)
    alone = [generate_alone(model, p, 12, seq2seq) for p in PROMPTS]
    assert batched == alone
    lengths = {len(tokens) for tokens in batched}
    assert len(lengths) > 1  # some rows stopped at EOS and left the batch while others went on
    for row_events, tokens in zip(events, batched):
        assert isinstance(row_events[-1], Finished)
        assert row_events[-1].finish_reason == ("length" if len(tokens) == 12 else "stop")
        assert row_events[-1].prompt_tokens > 0


def test_rows_that_join_a_running_batch_get_what_model_generate_gives_them_alone():
    model = random_gpt2()
    tokenizer = id_tokenizer(model)
    arrivals = {1: PROMPTS[3:5], 4: PROMPTS[5:], 9: [[30, 31, 32]]}  # step -> prompts that arrive
    late = [[8, 9]]  # arrives just as every earlier row has finished: a fresh batch
    rows, step = [], 0

    def make(prompts):
        new = [batching._Row(Job(Generation(p, Sampling(max_tokens=12)), lambda e: None), tokenizer) for p in prompts]
        rows.extend(new)
        return new

    def more(active):
        nonlocal step, late
        step += 1
        if active == 0:
            arrived, late = late, []
            return make(arrived)
        return make(arrivals.get(step, []))

    with torch.inference_mode():
        Decoder(model, tokenizer, seq2seq=False).run(make(PROMPTS[:3]), more)
    assert len(rows) == len(PROMPTS) + 2 and not late
    assert [row.answer.tokens for row in rows] == [generate_alone(model, row.request.prompt, 12, False) for row in rows]


def test_a_joined_batch_does_not_grow_wider_than_its_rows():
    model = random_gpt2()
    decoder = Decoder(model, id_tokenizer(model), seq2seq=False)
    with torch.inference_mode():
        steps = decoding._CausalSteps(decoder)
        steps.start([[5] * 20, [6, 7]])
        for _ in range(3):
            steps.next(torch.tensor([9, 9]))
        steps.join([[11, 12, 13]])
        assert steps.mask.shape == (3, 23) and steps.cache.get_seq_length() == 23
        steps.select(torch.tensor([1, 2]))  # the long row leaves: only 5 columns are still used
        assert steps.mask.shape == (2, 5) and steps.cache.get_seq_length() == 5
        assert steps.mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]


def test_sampling_is_reproducible_with_a_seed_and_top_p_near_zero_is_greedy():
    model = random_gpt2()
    seeded = Sampling(max_tokens=8, temperature=1.5, seed=7)
    first, _ = decode_batch(model, PROMPTS[:3], 8, False, seeded)
    second, _ = decode_batch(model, PROMPTS[:3], 8, False, seeded)
    assert first == second
    greedy, _ = decode_batch(model, PROMPTS[:3], 8, False)
    assert first != greedy
    nucleus, _ = decode_batch(model, PROMPTS[:3], 8, False, Sampling(max_tokens=8, temperature=1.5, top_p=1e-6))
    assert nucleus == greedy


def test_sample_never_picks_a_token_outside_the_nucleus():
    logits = torch.tensor([3.0, 2.9, -5.0, -6.0])
    picks = {sample(logits, 1.0, 0.9, torch.Generator().manual_seed(i)) for i in range(50)}
    assert sample(logits, 1.0, 0.5, torch.Generator().manual_seed(0)) == 0  # 0 alone holds half the mass
    assert picks <= {0, 1} and len(picks) == 2
