"""data.field_weights in a generative grader's loss: each answer token weighs as the column its text is part of,
the weights' mean 1 (the loss stays a mean over the answer's tokens), and the objectives weigh each token's loss."""

import pytest
import torch

from qatune.data.generative import CausalCollator, PromptEncoder, weigh_answer_tokens
from qatune.data.grading_fields import AnswerTemplate
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.model.objectives import CausalLMObjective

TEMPLATE = AnswerTemplate.make(["verdict", "note"], "Verdict: {verdict}\nNote: {note}")


def test_each_answer_token_weighs_as_its_column_with_mean_one(scratch_gpt2):
    _, tokenizer = scratch_gpt2
    encoder = PromptEncoder(tokenizer, PromptTemplate("Question: {question}\nAnswer:"))
    values = {"verdict": "thing 7", "note": "item 3 item 4"}
    record = QARecord(question="what is item 1?", answers=[TEMPLATE.render(values)], row=2, answer_fields=values)
    example = encoder.example(record, 64)
    weigh_answer_tokens(encoder, example, record, TEMPLATE, {"verdict": 3.0, "note": 0.5})
    text = " " + record.answer  # the answer prefix, then the answer
    tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    verdict, note = (text.index("thing 7"), text.index("thing 7") + 7), (text.index("item 3"), len(text))
    raw = [3.0 if s < verdict[1] and e > verdict[0] else 0.5 if s < note[1] and e > note[0] else 1.0
           for s, e in tokens] + [1.0]
    scale = len(raw) / sum(raw)
    assert example.weights == pytest.approx([w * scale for w in raw])
    assert sum(example.weights) == pytest.approx(len(example) - example.prompt_length)  # mean 1
    assert 3.0 in raw and 0.5 in raw and raw.count(1.0) >= 3  # "Verdict:", "Note:" and the end token weigh 1


def test_the_collated_weights_weigh_each_tokens_loss(scratch_gpt2):
    model, tokenizer = scratch_gpt2
    encoder = PromptEncoder(tokenizer, PromptTemplate("Question: {question}\nAnswer:"))
    values = {"verdict": "thing 7", "note": "item 3"}
    record = QARecord(question="what is item 1?", answers=[TEMPLATE.render(values)], row=2, answer_fields=values)
    example = encoder.example(record, 64)
    weigh_answer_tokens(encoder, example, record, TEMPLATE, {"verdict": 4.0})
    batch = CausalCollator(tokenizer.pad_token_id)([example])
    assert batch["label_weights"][0, example.prompt_length:].tolist() == pytest.approx(example.weights)
    with torch.no_grad():
        weighted = CausalLMObjective(model)(**{k: v for k, v in batch.items() if k not in ("row", "n_items",
                                                                                        "n_tokens")})
        logits = model(input_ids=batch["input_ids"]).logits[0, :-1]
        targets = batch["input_ids"][0, 1:]
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")[example.prompt_length - 1:]
    assert weighted["loss_sum"].item() == pytest.approx(float((losses * torch.tensor(example.weights)).sum()),
                                                        rel=1e-5)
    assert weighted["count"].item() == len(example.weights)
