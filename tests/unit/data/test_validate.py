"""Each seed bug, built the way the original posters built it, must be caught with its name."""

import pytest
import torch

from qatune.data.validate import raise_for_errors, validate_batch, validate_dataset, validate_loader, validate_settings
from qatune.errors import DataError
from qatune.model.scratch_tokenizer import train_scratch_tokenizer
from tests.conftest import wordpiece_tokenizer

QA = [("What is the fee?", "Ten dollars"), ("Is there parking?", "Yes, behind the building"),
      ("When do you open?", "At nine")]


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    texts = [f"Question: {q}\nAnswer: {a}" for q, a in QA] * 5
    return train_scratch_tokenizer("generative", texts, 300)


def codes(findings, level="error"):
    return [f.code for f in findings if f.level == level]


def test_seed_bug_1_the_dataset_is_one_long_string():
    text = " ".join(f"{q} {a}" for q, a in QA)          # the seed joined the sheet into one string

    class QADataset(torch.utils.data.Dataset):          # ...and indexed it
        def __init__(self, text):
            self.text = text

        def __len__(self):
            return len(self.text)

        def __getitem__(self, i):
            return self.text[i]

    assert codes(validate_dataset(text)) == ["dataset-is-string"]
    findings = validate_dataset(QADataset(text))
    assert codes(findings) == ["dataset-is-string"]
    assert "yields single characters ('What is the fee?' ...)" in findings[0].message


def test_seed_bug_2_max_length_computed_as_1(gpt2_tokenizer):
    texts = [f"Question: {q}\nAnswer: {a}" for q, a in QA]
    max_length = len([texts])                            # the seed's max_length: 1
    batch = gpt2_tokenizer(texts, max_length=max_length, truncation=True, padding="max_length", return_tensors="pt")
    batch["labels"] = batch["input_ids"].clone()
    findings = validate_batch(batch, tokenizer=gpt2_tokenizer)
    assert codes(findings) == ["max-length-tiny"]
    assert "max_length was probably computed as 1" in findings[0].message


def test_seed_bug_3_no_labels(gpt2_tokenizer):
    batch = gpt2_tokenizer([f"Question: {q}\nAnswer: {a}" for q, a in QA], padding=True, return_tensors="pt")
    assert codes(validate_batch(batch, tokenizer=gpt2_tokenizer)) == ["no-labels"]


def test_seed_bug_3b_every_label_masked(gpt2_tokenizer):
    batch = gpt2_tokenizer([f"Question: {q}\nAnswer: {a}" for q, a in QA], padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    prompt_length = batch["input_ids"].shape[1]          # "mask the prompt" with the padded width: everything
    labels[:, :prompt_length] = -100
    batch["labels"] = labels
    findings = validate_batch(batch, tokenizer=gpt2_tokenizer)
    assert codes(findings) == ["all-labels-ignored"]
    with pytest.raises(DataError, match="every label in the batch is -100"):
        raise_for_errors(findings)


def test_seed_bug_4_attention_mask_one_on_padding(gpt2_tokenizer):
    batch = gpt2_tokenizer([f"Question: {q}\nAnswer: {a}" for q, a in QA], padding=True, return_tensors="pt")
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])   # the seed's mask
    batch["labels"] = batch["input_ids"].clone()
    assert gpt2_tokenizer.pad_token_id == gpt2_tokenizer.eos_token_id
    findings = validate_batch(batch, tokenizer=gpt2_tokenizer)
    assert codes(findings) == ["mask-on-padding"]
    assert "attention_mask is 1 on padding" in findings[0].message


def test_labels_copied_onto_padding_are_caught(gpt2_tokenizer):
    batch = gpt2_tokenizer([f"Question: {q}\nAnswer: {a}" for q, a in QA], padding=True, return_tensors="pt")
    batch["labels"] = batch["input_ids"].clone()          # padding positions are trained
    assert codes(validate_batch(batch, tokenizer=gpt2_tokenizer)) == ["labels-on-padding"]
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    assert codes(validate_batch(batch, tokenizer=gpt2_tokenizer)) == []


BERT = wordpiece_tokenizer(["is", "paris", "big", "?", ".", "the", "city"])


def seed_span_batch(question, context, answer, positions):
    enc = BERT([question], [context], return_tensors="pt")
    start, end = positions(enc["input_ids"][0].tolist(), question, context, answer)
    enc["start_positions"] = torch.tensor([start])
    enc["end_positions"] = torch.tensor([end])
    return enc


def test_seed_bug_5a_span_found_by_searching_answer_tokens():
    def search_tokens(ids, question, context, answer):   # the seed searched the answer's tokens in the sequence
        answer_ids = BERT(answer, add_special_tokens=False)["input_ids"]
        start = ids.index(answer_ids[0])
        return start, start + len(answer_ids) - 1

    batch = seed_span_batch("is paris big ?", "paris is big .", "big", search_tokens)
    assert codes(validate_batch(batch, tokenizer=BERT, answers=["big"])) == ["span-outside-context"]


def test_seed_bug_5b_character_offsets_used_as_token_positions():
    def char_offsets(ids, question, context, answer):
        start = context.index(answer) + len(question)
        return start, start + len(answer)

    batch = seed_span_batch("is paris big ?", "paris is big .", "big", char_offsets)
    findings = validate_batch(batch, tokenizer=BERT, answers=["big"])
    assert codes(findings) == ["span-beyond-sequence"]
    assert "look like character offsets" in findings[0].message


def test_seed_bug_5c_positions_off_by_one_do_not_decode_to_the_answer():
    def forgot_cls(ids, question, context, answer):      # counted tokens without the leading [CLS]
        position = len(ids) - 1 - ids[::-1].index(BERT.convert_tokens_to_ids(answer)) - 1
        return position, position

    batch = seed_span_batch("is paris big ?", "paris is big .", "big", forgot_cls)
    findings = validate_batch(batch, tokenizer=BERT, answers=["big"])
    assert codes(findings) == ["span-mismatch"]
    assert "tokens give 'is', answer is 'big'" in findings[0].message


def test_correct_span_passes():
    def right(ids, question, context, answer):
        return ids.index(BERT.convert_tokens_to_ids("big"), 6), ids.index(BERT.convert_tokens_to_ids("big"), 6)

    batch = seed_span_batch("is paris big ?", "paris is big .", "big", right)
    assert validate_batch(batch, tokenizer=BERT, answers=["big"]) == []


def test_seed_bug_6_tiny_dataset_and_learning_rate_far_too_high():
    findings = validate_settings(learning_rate=0.1, max_grad_norm=None, n_examples=2, batch_size=8)
    assert codes(findings, "warning") == ["lr-high-no-clipping", "tiny-dataset", "batch-larger-than-dataset"]
    assert codes(findings) == []
    assert codes(validate_dataset([{"question": "q", "answer": "a"}] * 2), "warning") == ["tiny-dataset"]
    assert validate_settings(learning_rate=5e-5, max_grad_norm=1.0, warmup_steps=10, n_examples=500, batch_size=8) == []


def test_a_batch_larger_than_the_data_names_the_setting_to_lower():
    def message(**kw):
        found = [f.message for f in validate_settings(learning_rate=5e-5, max_grad_norm=1.0, n_examples=200, **kw)
                 if f.code == "batch-larger-than-dataset"]
        return found[0] if found else None

    assert message(batch_size=16, accumulation=100) == (
        "the batch of an update (train.batch_size 16 x train.gradient_accumulation_steps 100 = 1600) is larger than "
        "the 200 training examples; every update sees all of them; lower train.gradient_accumulation_steps")
    assert message(batch_size=256) == ("train.batch_size 256 is larger than the 200 training examples; every update "
                                       "sees all of them; lower train.batch_size")
    assert message(batch_size=256, accumulation=2).endswith("lower train.batch_size")
    assert message(batch_size=16, accumulation=12) is None


def test_validate_loader_on_a_users_dataloader(gpt2_tokenizer):
    texts = [f"Question: {q}\nAnswer: {a}" for q, a in QA] * 4

    def collate(rows):
        batch = gpt2_tokenizer(rows, padding=True, return_tensors="pt")
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["labels"] = batch["input_ids"].clone()
        return dict(batch)

    loader = torch.utils.data.DataLoader(texts, batch_size=3, collate_fn=collate)
    findings = validate_loader(loader, tokenizer=gpt2_tokenizer)
    assert codes(findings) == ["mask-on-padding"]
    with pytest.raises(DataError, match="attention_mask is 1 on padding"):
        raise_for_errors(findings)


def test_lora_takes_higher_learning_rates_than_full_fine_tuning():
    def warned(lr, lora):
        return [f.message for f in validate_settings(learning_rate=lr, max_grad_norm=1.0, warmup_steps=10, lora=lora,
                                                     n_examples=500, batch_size=8)]

    assert warned(1e-3, lora=False) == ["learning rate 0.001 is high for fine-tuning a pretrained model (typical: "
                                        "1e-5 to 1e-4); it can destroy what the model knows or diverge"]
    assert warned(1e-3, lora=True) == []
    assert warned(5e-3, lora=True) == ["learning rate 0.005 is high for LoRA adapters on a pretrained model "
                                       "(typical: 1e-4 to 1e-3); it can destroy what the model knows or diverge"]
