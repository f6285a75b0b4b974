"""Which prompt prefixes rows share: families for the sampler, the common prefix and groups for one batch."""

import torch

from qatune.data.generative import CausalCollator, ExampleDataset, PromptEncoder, encode_examples
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.speedups import prefixes
from qatune.speedups.prefixes import PrefixPlanner
from qatune.train.sampler import prompt_families
from tests.conftest import CharTokenizer

TEMPLATE = PromptTemplate("C:{context}\nQ:{question}\nA:", answer_prefix=" ")
QA_TEMPLATE = PromptTemplate("Q:{question}\nA:", answer_prefix=" ")
LONG = "the river flows north through the old town"
OTHER = "a mountain rises west of the harbour bay"


def encode(records, max_length=128):
    examples, _ = encode_examples(PromptEncoder(CharTokenizer(), TEMPLATE), records, max_length)
    return examples


def test_a_group_plan_shares_each_contexts_prefix_once_when_that_costs_less():
    rows = [[7, 8, 9, 11, 12, 13, 21, 22], [7, 8, 9, 11, 12, 14, 31, 32], [7, 8, 9, 16, 41],
            [7, 8, 9, 11, 12, 15, 17, 51]]
    plan = prefixes.plan(rows, limits=[5, 5, 3, 6], width=8)
    # Rows 0, 1 and 3 share 5 tokens; row 2 alone keeps its 3 prompt tokens before its first supervised one.
    # Cost: 2 prefixes of 5 + 4 rests of 3 = 22 positions, against 3 + 4 * (8 - 3) = 23 with the common prefix.
    assert plan["rows"].tolist() == [0, 2]
    assert plan["lengths"].tolist() == [5, 3]
    assert plan["group"].tolist() == [0, 0, 1, 0]
    assert (plan["prefix_width"], plan["suffix_width"]) == (5, 3)


def test_no_group_plan_where_the_common_prefix_costs_as_little():
    rows = [[7, 8, 9, 11, 12, 13, 21, 22], [7, 8, 9, 11, 12, 14, 31, 32], [7, 8, 9, 16, 41, 42, 43, 44]]
    assert prefixes.plan(rows, limits=[5, 5, 3], width=8) is None  # 2*5 + 3*3 = 19 against 3 + 3*5 = 18
    assert prefixes.plan(rows[:1], limits=[5], width=8) is None


def test_a_groups_prefix_never_reaches_a_rows_first_supervised_position():
    rows = [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 4  # identical prompts, answers start at position 4
    plan = prefixes.plan(rows, limits=[3, 3, 3, 3], width=9)
    assert plan is None  # one group of all rows is the common prefix itself
    rows = [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 3 + [[1, 2, 9, 9, 9, 9, 9, 9, 9]]
    plan = prefixes.plan(rows, limits=[6, 6, 4, 8], width=9)
    # The first three rows: row 2's limit, not the 9 they share; row 3 alone: as long as the other prefix.
    assert plan["lengths"].tolist() == [4, 4]
    assert plan["group"].tolist() == [0, 0, 0, 1]


def test_widths_are_rounded_up_to_the_multiple_and_the_prefix_not_past_the_batch():
    rows = [[7, 8, 9, 11, 12, 13, 21, 22], [7, 8, 9, 11, 12, 14, 31, 32], [7, 8, 9, 16, 41],
            [7, 8, 9, 11, 12, 15, 17, 51]] * 4
    plan = prefixes.plan(rows, limits=[5, 5, 3, 6] * 4, width=8, multiple=4)
    # The four copies of row 2 in one group of their 3 tokens, the others in one of 5: widths 5 -> 8 (the
    # batch's width), 3 -> 4. Cost 2 * 8 + 16 * 4 = 80 against 3 + 16 * 5 = 83.
    assert plan["lengths"].tolist() == [5, 3]
    assert (plan["prefix_width"], plan["suffix_width"]) == (8, 4)


def test_families_are_rows_about_one_context_not_questions_that_begin_alike():
    records = [QARecord(f"what about {q}?", ["yes"], context=c, row=i) for i, (q, c) in enumerate(
        [("one", LONG), ("two", OTHER), ("three", LONG), ("four", "a short one"), ("five", OTHER), ("six", LONG)])]
    examples = encode(records)
    assert prefixes.families([e.input_ids[:e.prompt_length] for e in examples]) == [[0, 2, 5], [1, 4], [3]]
    assert prompt_families(ExampleDataset(examples)) == [[0, 2, 5], [1, 4], [3]]
    alike = encode([QARecord(q, ["x"], context="same", row=i) for i, q in enumerate(
        ["what is the cat?", "what is the dog?", "how many cats?"])])
    # Beyond "C:same\nQ:", two of them share "what is the ": 12 tokens, fewer than MIN_FAMILY_PREFIX.
    assert prefixes.families([e.input_ids[:e.prompt_length] for e in alike]) is None
    longer = encode([QARecord(q, ["x"], context="same", row=i) for i, q in enumerate(
        ["what is the name of the cat?", "what is the name of the dog?", "how many cats?"])])
    assert prefixes.families([e.input_ids[:e.prompt_length] for e in longer]) == [[0, 1], [2]]
    assert prompt_families(ExampleDataset(alike[:1])) is None


def test_the_collator_plans_groups_from_the_rows_it_pads():
    records = [QARecord(q, ["yes"], context=c, row=i) for i, (q, c) in enumerate(
        [("a?", LONG), ("b?", LONG), ("c?", OTHER), ("d?", OTHER)])]
    examples = encode(records)
    batch = PrefixPlanner(CausalCollator(pad_token_id=0, uncounted_columns=1), shared=True, groups=True)(examples)
    groups = batch["prefix_groups"]
    assert groups["group"].tolist() == [0, 0, 1, 1]
    prompt_lengths = [e.prompt_length for e in examples]
    # Each context's prefix runs up to the question, which differs ("a?" / "b?"): "C:<context>\nQ:".
    assert groups["lengths"].tolist() == [len("C:" + LONG + "\nQ:"), len("C:" + OTHER + "\nQ:")]
    assert groups["suffix_width"] == max(len(e) - 1 - groups["lengths"][g] for e, g in
                                         zip(examples, groups["group"].tolist(), strict=True))
    assert all(length <= p - 1 for length, p in zip(groups["lengths"].tolist(), prompt_lengths[::2], strict=True))
    assert batch["shared_prefix"] == len("C:")
    assert torch.equal(batch["input_ids"][0, :len(examples[0])], torch.tensor(examples[0].input_ids))


def test_shared_prefix_is_common_to_every_row_and_ends_before_the_first_supervised_position(char_tokenizer):
    encoder = PromptEncoder(char_tokenizer, QA_TEMPLATE)
    collate = PrefixPlanner(CausalCollator(pad_token_id=0), shared=True, groups=False)
    a = encoder.example(QARecord("abc", ["x"]), 64)    # Q:abc\nA: x<eos>
    b = encoder.example(QARecord("abd", ["y"]), 64)
    c = encoder.example(QARecord("b", ["z"]), 64)
    assert collate([a, b])["shared_prefix"] == len("Q:ab")
    assert collate([a, b, c])["shared_prefix"] == len("Q:")
    # Identical prompts: the prefix stops at the position that predicts the first answer token.
    assert collate([a, a])["shared_prefix"] == a.prompt_length - 1
    assert collate([a])["shared_prefix"] == 0
    on_prompt = PrefixPlanner(CausalCollator(pad_token_id=0, train_on_prompt=True), shared=True, groups=True)
    assert "shared_prefix" not in on_prompt([a, b]) and "prefix_groups" not in on_prompt([a, b])
    other = PromptEncoder(char_tokenizer, PromptTemplate("{question}\nA:", answer_prefix=" "))
    assert collate([a, other.example(QARecord("Q:b", ["z"]), 64)])["shared_prefix"] == len("Q:")
    assert collate([a, other.example(QARecord("x", ["z"]), 64)])["shared_prefix"] == 0
