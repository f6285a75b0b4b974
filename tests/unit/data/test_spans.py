"""A passage's pieces and spans, whether an answer is one of them, and what generate.grounded auto decides from a
run's training answers."""

from qatune.data.spans import AUTO_SHARE, in_passage, passage_answers, pieces
from qatune.data.spreadsheet import QARecord


def texts(passage):
    return [(passage[p.start : p.end], p.spaced) for p in pieces(passage)]


def test_pieces_are_words_single_punctuation_marks_and_single_cjk_characters():
    assert texts("The  Vistula\nRiver (1887), Kraków.") == [
        ("The", False), ("Vistula", True), ("River", True), ("(", True), ("1887", False), (")", False),
        (",", False), ("Kraków", True), (".", False)]
    assert texts("首都北京 is Beijing") == [("首", False), ("都", False), ("北", False), ("京", False), ("is", True),
                                          ("Beijing", True)]


def test_an_answer_is_in_its_passage_at_piece_boundaries_ignoring_case_and_whitespace():
    passage = "Warsaw lies on the Vistula  River (1887), in Ogród Saski; 北京市 too."
    for answer in ("Warsaw", "the Vistula River", "The vistula\triver", "River", "1887", "(1887),", "Ogród Saski",
                   "ogród", "北京", "京市", "too.", " ".join(passage.split())):
        assert in_passage(answer, passage), answer
    for answer in ("ate", "Vistul", "arsaw", "Warsaw Vistula", "1887,", "Ogrod Saski", "", "  ", "River(1887"):
        assert not in_passage(answer, passage), answer


def record(answer, context, row=0):
    return QARecord(question="q", answers=[answer], context=context, row=row)


def test_auto_is_on_when_the_training_answers_are_spans_and_off_when_they_are_not():
    spans = passage_answers([record("red", "the ball is red."), record("The ball", "the ball is red."),
                             record("blue", "a blue sky")])
    assert (spans.rows, spans.spans, spans.no_answer, spans.auto) == (3, 3, None, True)
    assert spans.to_json() == {"rows": 3, "spans": 3, "no_answer": None, "no_answer_rows": 0, "auto": True,
                               "share": 1.0}
    written = passage_answers([record("crimson", "the ball is red."), record("a colour", "a blue sky"),
                               record("blue", "a blue sky")])
    assert (written.spans, written.no_answer, written.auto) == (1, None, False)
    assert "1 of 3 training answers (33.3%)" in written.describe() and written.describe().endswith("auto: off")


def test_the_fixed_answer_of_the_rows_not_in_their_passage_is_the_no_answer_text_and_counts_for_auto():
    rows = [record(f"thing {i}", f"item {i} is thing {i}.", i) for i in range(6)]
    rows += [record("unanswerable", "the sky is grey.", 6), record("Unanswerable ", "a blue sky", 7),
             record("unanswerable", "rain.", 8), record("thing 9", "no such item", 9)]
    answers = passage_answers(rows)
    assert (answers.spans, answers.no_answer, answers.no_answer_rows) == (6, "unanswerable", 3)
    assert (answers.spans + answers.no_answer_rows) / answers.rows == 0.9 >= AUTO_SHARE and answers.auto
    # one row of a text is not a fixed answer; nor is a text that fewer than half of the other rows share
    assert passage_answers([*rows[:6], record("unanswerable", "x", 6)]).no_answer is None
    spread = [*rows[:6], record("n/a", "x", 6), record("n/a", "y", 7), record("a", "z", 8), record("b", "z", 9),
              record("c", "z", 10)]
    assert passage_answers(spread).no_answer is None


def test_rows_without_a_passage_are_not_counted():
    answers = passage_answers([record("red", "the ball is red."), record("blue", None), record("green", "")])
    assert (answers.rows, answers.spans, answers.auto) == (1, 1, True)
    assert passage_answers([record("blue", None)]).auto is False
