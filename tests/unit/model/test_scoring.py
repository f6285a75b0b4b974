"""Scoring heads: their layout in one output layer, targets on each column's scale, the loss against hand-computed
values (a label training never had counted by the metrics, not by the loss), values clamped to the training range
and read back as the nearest training value; the heads' description saved in the model's config."""

import math

import pytest
import torch

from qatune.data.grading_fields import FieldSpec, field_spec
from qatune.data.padding import IGNORE_INDEX
from qatune.inference.field_metrics import grading_metrics
from qatune.model.scoring import HeadLayout, MeanPooledScorer, ScoringObjective, classification_config, scoring_loss
from qatune.model.scoring import class_weights as weights_of

SPECS = {"verdict": field_spec("label", ["Correct", "Incorrect", "Correct", "Partly"]),
         "score": field_spec("number", ["0", "1", "2", "0,5"])}  # decimal comma: 0, 0.5, 1, 2


def test_the_heads_are_slices_of_one_output_layer_in_the_columns_order():
    layout = HeadLayout.from_specs(SPECS)
    verdict, score = layout.heads
    assert (verdict.name, verdict.kind, verdict.start, verdict.width) == ("verdict", "label", 0, 3)
    assert verdict.classes == ("Correct", "Incorrect", "Partly")  # the most frequent first
    assert (score.name, score.kind, score.start, score.width, score.low, score.high) == ("score", "number", 3, 1,
                                                                                          0.0, 2.0)
    assert layout.width == 4
    assert layout.labels() == {0: "verdict=Correct", 1: "verdict=Incorrect", 2: "verdict=Partly", 3: "score"}
    assert HeadLayout.from_json(layout.to_json()) == layout
    alone = HeadLayout.from_specs({"verdict": SPECS["verdict"]})
    assert alone.labels() == {0: "Correct", 1: "Incorrect", 2: "Partly"}  # what a text-classification pipeline says


def test_targets_are_class_indices_and_numbers_on_the_trained_scale():
    layout = HeadLayout.from_specs(SPECS)
    # the training range 0..2 maps to -1..1; "1,5" is 1.5 in a column of decimal commas
    assert layout.targets({"verdict": "incorrect.", "score": "1,5"}, SPECS) == [1.0, 0.5]
    # a label training never had, and a score that is no number: nothing to learn from
    never, missing = layout.targets({"verdict": "Maybe", "score": "n/a"}, SPECS)
    assert never == IGNORE_INDEX and math.isnan(missing)


def test_the_loss_by_hand():
    layout = HeadLayout.from_specs(SPECS)
    outputs = torch.tensor([[2.0, 0.0, 0.0, 0.25], [0.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    targets = torch.tensor([[0.0, 0.5], [IGNORE_INDEX, -1.0], [2.0, math.nan]])
    ce = [-math.log(math.exp(2) / (math.exp(2) + 2)), -math.log(math.exp(3) / (math.exp(3) + 2))]
    l1 = [0.25, 0.0]
    assert scoring_loss(outputs, targets, layout).item() == pytest.approx(sum(ce) + sum(l1), rel=1e-6)
    weighted = scoring_loss(outputs, targets, layout, {"verdict": 2.0, "score": 0.5}).item()
    assert weighted == pytest.approx(2 * sum(ce) + 0.5 * sum(l1), rel=1e-6)


def test_predicted_values_are_the_most_likely_label_and_the_nearest_training_score_within_the_range():
    layout = HeadLayout.from_specs(SPECS)
    outputs = torch.tensor([[0.1, 0.9, 0.0, 5.0],      # far above the range: clamped to 2
                            [0.0, 0.0, 1.0, -0.45],    # 0.55: nearest training score 0.5, as written in training
                            [3.0, 0.0, 0.0, -9.0]])    # below the range: clamped to 0
    assert layout.values(outputs) == [{"verdict": "Incorrect", "score": "2"}, {"verdict": "Partly", "score": "0,5"},
                                      {"verdict": "Correct", "score": "0"}]


def test_a_gold_label_training_never_had_counts_as_wrong_in_the_metrics():
    predicted = [{"verdict": "Correct", "score": "1"}, {"verdict": "Correct", "score": "1"}]
    golds = [{"verdict": "Correct", "score": "1"}, {"verdict": "Maybe", "score": "1"}]
    metrics = grading_metrics(SPECS, predicted, golds)
    assert metrics["fields"]["verdict"]["accuracy"] == 50.0 and metrics["fields"]["verdict"]["rows"] == 2


def test_the_objective_counts_rows_and_the_config_says_what_each_output_is():
    from transformers import BertConfig, BertForSequenceClassification

    layout = HeadLayout.from_specs(SPECS)
    config = classification_config(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32), layout, 0,
                                   {"score": 2.0})
    assert config.num_labels == 4 and config.qatune_heads == layout.to_json()
    assert config.qatune_field_weights == {"score": 2.0} and config.problem_type is None
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()  # no dropout: the two forwards agree
    ids = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0]])
    mask = (ids != 0).long()
    targets = torch.tensor([[0.0, 1.0], [1.0, -1.0]])
    out = ScoringObjective(model, layout, {"score": 2.0})(input_ids=ids, attention_mask=mask, targets=targets)
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert out["count"].item() == 2
    assert out["loss_sum"].item() == pytest.approx(scoring_loss(logits, targets, layout, {"score": 2.0}).item())


def test_mean_pooling_averages_the_rows_own_tokens_and_saves_and_loads(tmp_path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    backbone = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32))
    scorer = MeanPooledScorer(backbone, 4).eval()
    ids, mask = torch.tensor([[1, 5, 6, 0]]), torch.tensor([[1, 1, 1, 0]])
    hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state[0, :3].mean(0)
    assert torch.allclose(scorer(input_ids=ids, attention_mask=mask).logits[0], scorer.head(hidden), atol=1e-6)
    scorer.save_pretrained(tmp_path)
    loaded = MeanPooledScorer.from_folder(tmp_path).eval()
    assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits, scorer(input_ids=ids, attention_mask=mask)
                       .logits)
    assert FieldSpec.from_json(SPECS["score"].to_json()) == SPECS["score"]


def test_a_mean_pooled_scorer_checkpoints_its_backbones_activations_with_the_same_gradients():
    import warnings

    from transformers import BertConfig, BertModel

    from qatune.train.memory_estimate import checkpoint_activations

    def loss_and_grads(checkpointed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        backbone = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=32, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0))
        scorer = MeanPooledScorer(backbone, 3).train()
        if checkpointed:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no deprecated entry point on the way
                checkpoint_activations(scorer)
            assert backbone.is_activation_checkpointing
        ids, mask = torch.tensor([[1, 5, 6, 0], [7, 8, 9, 4]]), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
        loss = scorer(input_ids=ids, attention_mask=mask).logits.square().sum()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in scorer.named_parameters()}

    plain_loss, plain = loss_and_grads(False)
    loss, grads = loss_and_grads(True)
    torch.testing.assert_close(loss, plain_loss)
    assert grads.keys() == plain.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], msg=name)


def test_class_weights_by_hand_keep_the_rows_mean_weight_at_one():
    # counts 6, 3, 1: balanced 1/6, 1/3, 1 over a row mean of 0.3; sqrt 1/sqrt(count) over its own row mean
    assert weights_of((6, 3, 1), "balanced") == pytest.approx((5 / 9, 10 / 9, 10 / 3), abs=1e-6)
    raw = [6 ** -0.5, 3 ** -0.5, 1.0]
    mean = (6 * raw[0] + 3 * raw[1] + raw[2]) / 10
    assert weights_of((6, 3, 1), "sqrt") == pytest.approx(tuple(r / mean for r in raw), abs=1e-6)
    assert weights_of((6, 3, 1), "none") == ()
    layout = HeadLayout.from_specs(SPECS, weights="balanced")  # verdict counts: Correct 2, Incorrect 1, Partly 1
    assert layout.heads[0].class_weights == pytest.approx((2 / 3, 4 / 3, 4 / 3), abs=1e-6)
    assert layout.heads[1].class_weights == ()  # a number head has no classes to weigh
    outputs = torch.tensor([[2.0, 0.0, 0.0, 0.25], [0.0, 1.0, 0.0, -1.0]])
    targets = torch.tensor([[0.0, 0.5], [1.0, -1.0]])
    ce = [-math.log(math.exp(2) / (math.exp(2) + 2)), -math.log(math.exp(1) / (math.exp(1) + 2))]
    assert scoring_loss(outputs, targets, layout).item() == pytest.approx(2 / 3 * ce[0] + 4 / 3 * ce[1] + 0.25,
                                                                          rel=1e-6)


VALUES = HeadLayout.from_specs(SPECS, number_head="values")


def test_a_number_head_choosing_among_values_is_a_softmax_over_the_training_values():
    score = VALUES.heads[1]
    assert (score.kind, score.by_values, score.start, score.width) == ("number", True, 3, 4)
    assert VALUES.labels() == {0: "verdict=Correct", 1: "verdict=Incorrect", 2: "verdict=Partly", 3: "score=0",
                               4: "score=0,5", 5: "score=1", 6: "score=2"}
    assert HeadLayout.from_json(VALUES.to_json()) == VALUES
    # a score is the index of its nearest training value (0,4 -> 0,5; 1,9 -> 2); none is not learned from
    assert VALUES.targets({"verdict": "Correct", "score": "0,4"}, SPECS) == [0.0, 1.0]
    assert VALUES.targets({"verdict": "Correct", "score": "1,9"}, SPECS) == [0.0, 3.0]
    assert VALUES.targets({"verdict": "Correct", "score": "n/a"}, SPECS) == [0.0, float(IGNORE_INDEX)]
    outputs = torch.tensor([[2.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0]])
    ce_score = -math.log(math.exp(3) / (math.exp(3) + 3))
    ce_verdict = -math.log(math.exp(2) / (math.exp(2) + 2))
    assert scoring_loss(outputs, torch.tensor([[0.0, 1.0]]), VALUES).item() == pytest.approx(ce_verdict + ce_score,
                                                                                              rel=1e-6)
    # a single training value leaves nothing to choose: a regression head, as without the setting
    alone = HeadLayout.from_specs({"score": field_spec("number", ["3", "3"])}, number_head="values")
    assert (alone.heads[0].by_values, alone.heads[0].width) == (False, 1)


def test_a_head_choosing_among_values_predicts_the_median_of_its_distribution_not_the_most_likely_value():
    # probabilities 0.45, 0, 0.1, 0.45 over 0, 0,5, 1, 2: the most likely is 0 or 2, the median (least expected
    # absolute error) is 1
    probabilities = torch.tensor([[0.45, 1e-9, 0.1, 0.45], [0.1, 0.2, 0.1, 0.6], [0.7, 0.1, 0.1, 0.1]])
    outputs = torch.cat([torch.zeros(3, 3), probabilities.log()], dim=1)
    assert [row["score"] for row in VALUES.values(outputs)] == ["1", "2", "0"]


def test_old_layouts_without_the_new_keys_still_load():
    saved = [{k: v for k, v in head.items() if k not in ("by_values", "class_weights")}
             for head in HeadLayout.from_specs(SPECS).to_json()]
    assert HeadLayout.from_json(saved) == HeadLayout.from_specs(SPECS)
