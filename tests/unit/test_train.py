import json
import logging
import math

import pytest
import torch

from qatune.errors import DataError
from qatune.train import LengthGroupedBatches, build_optimizer, build_schedulers, fit, prepare
from tests.conftest import tiny_config as shared_tiny_config


def tiny_config(tmp_path, rows, *overrides):
    return shared_tiny_config(tmp_path, rows, "train.epochs=1", "train.weight_decay=0.0", *overrides)


ROWS = [(f"question number {i}", "yes" if i % 2 else "a much longer answer with many words") for i in range(14)]


class StepSpy:
    """Records, at every optimizer step, how many backward passes ran and the gradient norm."""

    def __init__(self, monkeypatch):
        self.backwards = 0
        self.at_step = []
        self.norms = []
        original = build_optimizer

        def spying_build(params, lr, wd):
            optimizer = original(params, lr, wd)
            params[0].register_hook(self._count)  # the embedding: one call per backward
            step = optimizer.step

            def recorded_step(*args, **kwargs):
                self.at_step.append(self.backwards)
                out = step(*args, **kwargs)
                # After the step: the fused AdamW applies the clipping inside its kernel and leaves the
                # gradients it used behind.
                grads = [p.grad.norm() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                self.norms.append(float(torch.stack(grads).norm()))
                return out

            optimizer.step = recorded_step
            return optimizer

        monkeypatch.setattr("qatune.train.loop.build_optimizer", spying_build)

    def _count(self, grad):
        self.backwards += 1
        return grad


def test_first_optimizer_step_after_exactly_n_micro_batches(tmp_path, monkeypatch):
    spy = StepSpy(monkeypatch)
    config = tiny_config(tmp_path, ROWS, "train.batch_size=2", "train.gradient_accumulation_steps=3")
    fit(prepare(config), tmp_path, progress=False)
    # 14 rows / 2 = 7 micro-batches -> steps after micro-batches 3, 6 and the short last window 7.
    assert spy.at_step == [3, 6, 7]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]


def test_accumulation_gives_the_same_update_as_one_large_batch(tmp_path, monkeypatch):
    # Plain SGD: the update is the gradient itself (Adam's first step would hide its scale).
    monkeypatch.setattr("qatune.train.loop.build_optimizer",
                        lambda params, lr, wd: torch.optim.SGD(params, lr=1.0))
    rows = [("q1", "yes"), ("q2", "no"), ("q3", "ok"), ("q4", "a much longer answer with many more words")]
    big = prepare(tiny_config(tmp_path, rows, "train.batch_size=4", "train.group_by_length=false"))
    small = prepare(tiny_config(tmp_path, rows, "train.batch_size=2", "train.gradient_accumulation_steps=2",
                                "train.group_by_length=false"))
    assert all(torch.equal(a, b) for a, b in zip(big.model.parameters(), small.model.parameters()))
    before = [p.detach().clone() for p in big.model.parameters()]
    fit(big, None, progress=False)
    fit(small, None, progress=False)
    assert any(not torch.allclose(a, b.cpu()) for a, b in zip(before, big.model.parameters()))
    # The micro-batches hold different numbers of answer tokens; the loss is normalised by the tokens of
    # the whole window, so the two updates agree.
    for a, b in zip(big.model.parameters(), small.model.parameters()):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-6, rtol=1e-5)


def test_gradients_are_clipped_and_the_norm_before_clipping_is_logged(tmp_path, monkeypatch):
    spy = StepSpy(monkeypatch)
    config = tiny_config(tmp_path, ROWS, "train.batch_size=7", "train.max_grad_norm=0.001")
    fit(prepare(config), tmp_path, progress=False)
    assert spy.norms and all(norm <= 0.001 * (1 + 1e-4) for norm in spy.norms)
    logged = [json.loads(line)["grad_norm"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(norm > 0.01 for norm in logged)


def test_step_lr_after_warmup(tmp_path):
    config = tiny_config(tmp_path, ROWS, "train.learning_rate=0.1", "train.warmup_steps=4",
                         "train.scheduler.step_size=3", "train.scheduler.gamma=0.5", "train.scheduler.interval=step")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup, decay = build_schedulers(optimizer, config)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        warmup.step()
        decay.step()
    expected = [0.1 * min(1.0, (k + 1) / 4) * 0.5 ** (k // 3) for k in range(10)]
    assert seen == pytest.approx(expected)


def test_step_lr_per_epoch(tmp_path):
    config = tiny_config(tmp_path, ROWS, "train.learning_rate=0.1", "train.scheduler.step_size=2",
                         "train.scheduler.gamma=0.1")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup, decay = build_schedulers(optimizer, config)
    assert warmup is None
    seen = []
    for _epoch in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        decay.step()
    assert seen == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001])


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, 1e-3, 0.1)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert [p.shape for p in decayed["params"]] == [torch.Size([4, 4])]
    assert len(plain["params"]) == 3


def test_same_seed_same_run(tmp_path):
    a = prepare(tiny_config(tmp_path, ROWS, "train.batch_size=4", "model.scratch.dropout=0.1"))
    fit(a, None, progress=False)
    b = prepare(tiny_config(tmp_path, ROWS, "train.batch_size=4", "model.scratch.dropout=0.1"))
    fit(b, None, progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_length_grouped_batches_cover_everything_once_and_reduce_padding():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    sampler = LengthGroupedBatches(lengths, batch_size=8, seed=3)
    first = list(sampler)
    assert sorted(i for batch in first for i in batch) == list(range(400))
    assert len(first) == len(sampler) == 50
    padding = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in first)
    plain = list(LengthGroupedBatches(lengths, batch_size=8, seed=3, group=False))
    plain_padding = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in plain)
    assert padding < plain_padding / 5
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_families_stay_together_and_singletons_keep_the_plain_order():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    singletons = [[i] for i in range(400)]
    for group in (True, False):
        assert list(LengthGroupedBatches(lengths, 8, seed=3, group=group, families=singletons)) == \
            list(LengthGroupedBatches(lengths, 8, seed=3, group=group))
    families = [list(range(start, min(start + 5, 400))) for start in range(0, 400, 5)]  # 80 contexts of 5 rows
    for group in (True, False):
        batches = list(LengthGroupedBatches(lengths, 8, seed=3, group=group, families=families))
        assert sorted(i for batch in batches for i in batch) == list(range(400)) and len(batches) == 50
        # A family of 5 in batches of 8 lies in one batch or in two: never spread wider.
        spread = [len({b for b, batch in enumerate(batches) for i in batch if i in family}) for family in families]
        assert max(spread) == 2 and spread.count(1) >= 30
        plain = list(LengthGroupedBatches(lengths, 8, seed=3, group=group))
        plain_spread = [len({b for b, batch in enumerate(plain) for i in batch if i in family}) for family in families]
        assert sum(plain_spread) > 3 * sum(spread)  # shuffled alone: nearly every row in a batch of its own


def test_batches_are_filled_with_whole_families_where_one_fits():
    sizes = [5, 3, 3, 5] * 25  # 100 families, 400 rows: 50 batches of 5 + 3 need no family split
    families, start = [], 0
    for size in sizes:
        families.append(list(range(start, start + size)))
        start += size
    for group in (True, False):
        batches = list(LengthGroupedBatches([10] * 400, 8, seed=5, group=group, families=families))
        assert len(batches) == 50 and all(len(batch) == 8 for batch in batches)
        where = {i: b for b, batch in enumerate(batches) for i in batch}
        assert all(len({where[i] for i in family}) == 1 for family in families)


def test_the_log_names_families_kept_together_only_when_group_by_prefix_keeps_some(tmp_path, caplog):
    from qatune.train.loop import Loop

    passages = [" ".join(f"{word}{k}" for k in range(30)) for word in ("river", "mountain")]
    rows = [(f"question {i} about it", passages[i % 2], f"answer {i}") for i in range(8)]
    said = {}
    with_context = ["data.context_column=context"]
    for name, data, overrides in [("default", rows, with_context),
                                  ("kept", rows, [*with_context, "train.group_by_prefix=true"]),
                                  ("no contexts", ROWS, ["train.group_by_prefix=true"]),
                                  ("prompts trained", rows, [*with_context, "train.group_by_prefix=true",
                                                             "train.train_on_prompt=true"])]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qatune"):
            Loop.setup(prepare(tiny_config(tmp_path, data, "train.batch_size=4", *overrides)), None, None)
        said[name] = [m for m in caplog.messages if m.startswith("batches:")]
    assert said["default"] == []  # off, the sampler has nothing to say
    assert len(said["kept"]) == 1 and said["kept"][0].startswith(
        "batches: 8 of 8 rows in 2 groups that share a long prompt prefix (one context) kept together, ")
    assert said["no contexts"] == ["batches: train.group_by_prefix keeps no rows together: no rows share a long "
                                   "prompt prefix (one context)"]
    assert said["prompts trained"] == ["batches: train.group_by_prefix keeps no rows together: the prompts are "
                                       "trained on too (train.train_on_prompt)"]


@pytest.mark.parametrize(("precision", "multiple"), [("bf16", 2), ("fp32", 1)])
def test_training_batches_have_widths_rounded_for_the_precision(tmp_path, precision, multiple):
    rows = [*ROWS, *((f"question number {i} of three", "yes") for i in range(4))]  # rows of other lengths
    prepared = prepare(tiny_config(tmp_path, rows, f"train.precision={precision}", "train.batch_size=3",
                                   "train.device=cpu"))
    collate, widths = prepared.collator, []

    def recording(items):
        batch = collate(items)
        widths.append((max(len(item) for item in items), batch["input_ids"].shape[1]))
        return batch

    fit(prepared, None, progress=False)  # sets the multiple on the run's collator
    assert collate.pad_to_multiple_of == multiple
    prepared.collator = recording  # a plain function: the second fit leaves the collator as the first set it
    fit(prepared, None, progress=False)
    # The model computes all but a batch's last column (it predicts nothing): that width is the rounded one.
    assert any((longest - 1) % 2 for longest, _ in widths)  # some batch's computed width would be odd
    assert all(width - 1 == -(-(longest - 1) // multiple) * multiple for longest, width in widths)


@pytest.mark.parametrize(("longest", "multiple", "limit", "width"), [
    (9, 8, None, 16), (9, 8, 10, 10), (9, 8, 16, 16), (17, 2, 17, 17), (16, 2, 17, 16), (9, 1, 9, 9)])
def test_a_rounded_width_stops_at_the_models_positions(longest, multiple, limit, width):
    from qatune.data.padding import batch_width

    assert batch_width(longest, multiple, limit) == width


def test_bf16_training_with_rows_as_long_as_an_odd_position_count(tmp_path):
    # Rounded to even, a 17-token batch would index position 17 of a model that has 17 (0..16).
    rows = [(" ".join(f"word{j}" for j in range(i, i + 12)), "yes") for i in range(6)]
    config = tiny_config(tmp_path, rows, "model.scratch.n_positions=17", "data.max_length=17",
                         "train.precision=bf16", "train.device=cpu", "train.batch_size=3")
    prepared = prepare(config)
    assert max(prepared.dataset.lengths) == 17
    result = fit(prepared, None, progress=False)
    assert prepared.collator.pad_to_multiple_of == 2
    assert math.isfinite(result["final_train_loss"])


SPAN_ROWS = [(f"what colour is thing {i}?", f"thing {i} is {c} and round.", c)
             for i, c in enumerate(["red", "blue", "green", "black", "white"])]


@pytest.mark.parametrize(("rows", "overrides"), [
    (ROWS, ()), (ROWS, ("model.scratch.architecture=t5",)),
    (SPAN_ROWS, ("task=extractive", "data.context_column=context", "data.max_length=64", "data.doc_stride=16"))],
    ids=["causal", "seq2seq", "extractive"])
def test_rounded_widths_leave_loss_and_gradients_unchanged(tmp_path, rows, overrides):
    # The padding a rounded width adds is masked like any other: the same rows give the same loss and gradients.
    from qatune.model.objectives import model_inputs, objective_for

    prepared = prepare(tiny_config(tmp_path, rows, *overrides))
    model = prepared.model.eval()  # no dropout: both passes see the same function
    objective = objective_for(prepared.config.task, model)
    items = [prepared.dataset[i] for i in range(min(5, len(prepared.dataset)))]

    def run(multiple):
        prepared.collator.pad_to_multiple_of = multiple
        batch = prepared.collator(items)
        model.zero_grad(set_to_none=True)
        out = objective(**model_inputs(batch))
        out["loss_sum"].backward()
        return batch["input_ids"].shape[1], out["loss_sum"].detach(), {
            name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    width, loss, grads = run(1)
    wider, rounded_loss, rounded_grads = run(width + 5)
    assert wider > width
    torch.testing.assert_close(rounded_loss, loss)
    assert rounded_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(rounded_grads[name], grad, msg=name)


def test_check_shows_a_rows_tokens_without_the_padding_a_rounded_width_adds(tmp_path):
    from qatune.commands.check import render_trained_tokens

    prepared = prepare(tiny_config(tmp_path, ROWS))
    example = prepared.dataset[0]
    plain = render_trained_tokens(prepared, example)
    prepared.collator.pad_to_multiple_of = len(example) + 7
    assert render_trained_tokens(prepared, example) == plain


def test_rows_whose_answer_is_not_in_the_context_are_no_longer_counted_as_kept(tmp_path, caplog):
    rows = [*SPAN_ROWS, ("what colour is thing 9?", "thing 9 is grey.", "purple"),
            ("what colour is thing 8?", "thing 8 is pink.", "orange")]
    config = shared_tiny_config(tmp_path, rows, "task=extractive", "data.context_column=context",
                                "data.max_length=64", "data.doc_stride=16")
    with caplog.at_level(logging.INFO, logger="qatune"):
        report = prepare(config, with_model=False).reports["train_file"]
    assert (report["rows_read"], report["kept"], report["dropped"]) == (7, 5, {"answer not in context": [7, 8]})
    assert "data: qa.csv: 7 rows read, 5 kept, 2 dropped (answer not in context: rows 7, 8)" in caplog.messages


LONG_QUESTIONS = [(f"what is item number {i} in the long list?", f"thing {i}") for i in range(12)]


def test_rows_that_fit_only_with_no_question_left_are_dropped_and_said_so(tmp_path):
    rows = [(f"q{i}?", f"a{i}") for i in range(8)] + [(q, "thing thing thing") for q, _ in LONG_QUESTIONS[:4]]
    prepared = prepare(shared_tiny_config(tmp_path, rows, "data.max_length=10"), with_model=False)
    dropped = [f for f in prepared.findings if f.code == "rows-too-long"]
    assert [f.level for f in dropped] == ["warning"]
    # The long rows would fit with an empty question (the template's 6 tokens + the answer): not worth training.
    assert dropped[0].message.startswith("4 of 12 rows dropped: they do not fit max_length=10 even with the question "
                                         "cut to nothing; the prompt's own text is 6 tokens (rows 10, 11, 12, 13)")
    assert [example.row for example in prepared.dataset.items] == list(range(2, 10))
    assert all(example.prompt_length > 6 for example in prepared.dataset.items)
    report = prepared.reports["train_file"]
    assert (report["kept"], report["dropped"]) == (8, {"does not fit max_length=10": [10, 11, 12, 13]})


def test_most_rows_not_fitting_is_an_error_not_a_warning(tmp_path):
    rows = [(q, " ".join(["word"] * 12) if i < 8 else a) for i, (q, a) in enumerate(LONG_QUESTIONS)]
    prepared = prepare(shared_tiny_config(tmp_path, rows, "data.max_length=12"), with_model=False)
    dropped = [f for f in prepared.findings if f.code == "rows-too-long"]
    assert [f.level for f in dropped] == ["error"]
    assert dropped[0].message.startswith("most rows cannot be trained: 8 of 12 rows dropped: the answer alone does "
                                         "not fit max_length=12 (rows 2, 3, 4, 5, 6, 7, 8, 9)")


def test_seq2seq_rows_whose_question_would_be_cut_to_nothing_are_dropped(tmp_path):
    rows = [(f"q{i}?", f"a{i}") for i in range(8)] + [(q, "thing thing thing") for q, _ in LONG_QUESTIONS[:4]]
    overrides = ("model.scratch.architecture=t5",)
    kept = prepare(shared_tiny_config(tmp_path, rows, *overrides, "data.max_length=18"), with_model=False)
    fixed = kept.dataset.items[0].input_ids  # every source cut to the template and one token of its question
    assert len(fixed) == 18 and len(kept.dataset.items) == 12
    with pytest.raises(DataError, match=r"12 of 12 rows dropped: they do not fit max_length=17 even with the "
                                        r"question cut to nothing; the prompt's own text is 17 tokens"):
        prepare(shared_tiny_config(tmp_path, rows, *overrides, "data.max_length=17"), with_model=False)
