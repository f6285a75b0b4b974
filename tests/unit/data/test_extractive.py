import pytest
import torch

from qatune.data.extractive import SpanCollator, best_span, check_window, locate_answer, prepare_features
from qatune.data.padding import IGNORE_INDEX
from qatune.data.spreadsheet import QARecord
from qatune.errors import DataError
from tests.conftest import wordpiece_tokenizer

WORDS = [f"w{i}" for i in range(20)]
TOKENIZER = wordpiece_tokenizer(["who", "?", "paris", "is", "big", ".", "the", "city", "new", "york", "un",
                                 "##believ", "##able", "story", "caf", "##e", "東", "京", "live", "in", *WORDS])
# "[CLS] who ? [SEP]" precede the context: its first token is at position 4.
FIRST = 4


def features_for(context, answer, answer_start=None, max_length=64, stride=2, train=True):
    record = QARecord("who ?", [answer], context=context, answer_start=answer_start, row=2)
    return prepare_features(TOKENIZER, [record], max_length, stride, train=train)


def positions(features):
    return [(f.start_position, f.end_position) for f in features]


def test_answer_at_the_start_of_the_context():
    features, stats, _ = features_for("paris is big .", "paris")
    assert positions(features) == [(FIRST, FIRST)]
    assert stats.audit_matched == stats.audit_checked == 1


def test_answer_at_the_end_of_the_context():
    features, _, _ = features_for("the city is new york", "new york")
    assert positions(features) == [(FIRST + 3, FIRST + 4)]
    assert TOKENIZER.decode(features[0].input_ids[FIRST + 3 : FIRST + 5]) == "new york"


def test_sub_word_answers():
    features, stats, _ = features_for("unbelievable story", "unbelievable")
    assert positions(features) == [(FIRST, FIRST + 2)]          # un ##believ ##able
    features, stats, _ = features_for("unbelievable story", "believable")
    assert positions(features) == [(FIRST + 1, FIRST + 2)]      # starts inside the word
    assert stats.audit_matched == 1


def test_unicode_context_offsets_are_characters_of_the_original_text():
    context = "i live in 東京 . café"
    features, stats, _ = features_for(context, "東京")
    assert positions(features) == [(FIRST + 3, FIRST + 4)]
    features, stats, _ = features_for(context, "Café")          # found ignoring case; accents kept
    start, end = positions(features)[0]
    assert (start, end) == (FIRST + 6, FIRST + 7)               # caf ##e
    offsets = features[0].offsets
    assert context[offsets[start][0] : offsets[end][1]] == "café"
    assert stats.audit_matched == 1


# Windows: max_length 12 leaves 12 - 3 - 2 = 7 context tokens; stride 3 -> windows start at w0, w4, w8, ...
LONG = " ".join(WORDS)


def test_windows_overlap_by_the_stride():
    features, stats, _ = features_for(LONG, "w5", max_length=12, stride=3)
    firsts = [TOKENIZER.convert_ids_to_tokens(f.input_ids[FIRST]) for f in features]
    assert firsts == ["w0", "w4", "w8", "w12", "w16"]
    # w5 is in window 0 (position 4 + 5) and window 1 (4 + 1); elsewhere the label is CLS (0).
    assert positions(features) == [(FIRST + 5, FIRST + 5), (FIRST + 1, FIRST + 1), (0, 0), (0, 0), (0, 0)]
    assert stats.windows == 5 and stats.windows_without_answer == 3


def test_answer_spanning_a_window_boundary_is_labelled_only_where_it_is_whole():
    features, _, _ = features_for(LONG, "w6 w7", max_length=12, stride=3)
    # window 0 holds w0..w6 (w7 is cut off): CLS; window 1 holds w4..w10: positions 6..7.
    assert positions(features)[:3] == [(0, 0), (FIRST + 2, FIRST + 3), (0, 0)]


def test_answer_only_in_the_second_window():
    features, _, _ = features_for(LONG, "w7", max_length=12, stride=3)
    assert positions(features) == [(0, 0), (FIRST + 3, FIRST + 3), (0, 0), (0, 0), (0, 0)]
    assert [f.has_answer for f in features] == [False, True, False, False, False]


def test_answer_longer_than_any_window_is_counted():
    features, stats, _ = features_for(LONG, " ".join(WORDS[2:12]), max_length=12, stride=3)
    assert len(features) == 5 and all(p == (0, 0) for p in positions(features))   # kept, labelled unanswerable
    assert stats.unreachable_rows == [2]


def test_answer_absent_is_dropped_for_training_and_unlabelled_for_evaluation():
    features, stats, kept = features_for("paris is big .", "london")
    assert features == [] and kept == [] and stats.not_found_rows == [2]
    features, stats, kept = features_for("paris is big .", "london", train=False)
    assert positions(features) == [(IGNORE_INDEX, IGNORE_INDEX)] and len(kept) == 1


def test_derived_answer_start():
    assert locate_answer("the cat and the cat", "cat") == (4, 7)
    assert locate_answer("the cat and the cat", "cat", answer_start=16) == (16, 19)
    assert locate_answer("the cat and the cat", "cat", answer_start=14) == (16, 19)   # nearest occurrence
    assert locate_answer("Paris is   Big.", "paris is big") == (0, 14)                # case and whitespace
    assert locate_answer("STRASSE", "straße") == (0, 7)                               # casefold expands ß
    assert locate_answer("paris", "london") is None
    assert locate_answer("paris", "") is None


def test_given_answer_start_chooses_the_labelled_occurrence():
    features, _, _ = features_for("paris is big . paris", "paris", answer_start=15)
    assert positions(features) == [(FIRST + 4, FIRST + 4)]


def test_stride_too_large_is_refused():
    with pytest.raises(DataError, match=r"data\.doc_stride=8 is too large for data\.max_length=12"):
        check_window(12, 8)


def test_collator_pads_and_keeps_labels():
    features, _, _ = features_for("paris is big .", "big")
    other, _, _ = features_for("the city", "city")
    batch = SpanCollator(TOKENIZER.pad_token_id)([features[0], other[0]])
    assert batch["input_ids"].shape == (2, len(features[0]))
    assert batch["attention_mask"][1].tolist() == [1] * len(other[0]) + [0] * (len(features[0]) - len(other[0]))
    assert batch["token_type_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert batch["start_positions"].tolist() == [FIRST + 2, FIRST + 1]


def test_best_span_takes_the_best_valid_span_across_windows():
    context = LONG
    features, _, _ = features_for(context, "w5", max_length=12, stride=3, train=False)
    n = len(features[0])
    starts = [torch.zeros(n) for _ in features]
    ends = [torch.zeros(n) for _ in features]
    starts[1][FIRST + 5] = 5.0   # window 1 token w9
    ends[1][FIRST + 6] = 5.0     # window 1 token w10
    starts[0][0] = ends[0][0] = 100.0   # CLS is never an answer
    starts[2][FIRST + 3] = 9.0   # window 2: w11 ... but end before start is invalid
    ends[2][FIRST + 2] = 9.0
    text, score = best_span(features, starts, ends, context, n_best=5, max_answer_length=5)
    assert text == "w9 w10" and score == 10.0
    text, score = best_span(features, starts, ends, context, n_best=5, max_answer_length=1)
    assert score == 9.0 and len(text.split()) == 1


def test_windows_cover_every_context_to_its_end():
    for answer in ("w19", "w0"):
        features, _, _kept = features_for(LONG, answer, max_length=12, stride=3)
        last = max(o[1] for f in features for o in f.offsets if o is not None)
        assert last == len(LONG)


def test_a_tokenizer_that_drops_the_end_of_a_context_is_refused(monkeypatch):
    from qatune.data import extractive
    from qatune.errors import ModelError

    features, _, kept = features_for(LONG, "w5", max_length=12, stride=3)
    with pytest.raises(ModelError, match="huggingface/tokenizers#2091"):
        extractive._check_coverage(TOKENIZER, features[:3], kept)   # what tokenizers 0.23.2 returns
    extractive._check_coverage(TOKENIZER, features, kept)
