"""Build or load models and tokenizers: from the hub, a local folder, a packaged model (its name's package and folder:
:mod:`qatune.model.packaged`), a GGUF file (converted once into qatune's cache: :mod:`qatune.model.gguf_cache`) or
scratch.

Also a model's longest sequence. LoRA is :mod:`qatune.model.adapters`'s; writing and reading model folders (and
their ``qatune.json``) :mod:`qatune.model.folder`'s.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qatune.config import ModelConfig, ScratchModel
from qatune.errors import ModelError
from qatune.model import gguf_cache
from qatune.model.packaged import PACKAGED_MODELS, installed_packaged_models, resolve_model_path
from qatune.tasks import task_kind

log = logging.getLogger("qatune")

HUB_PROBE_TIMEOUT_S = 3.0

GPT2_SPECIAL = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]


@dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained finds a model: a folder or hub id, and the .gguf file in it, if any."""

    path: str
    gguf_file: str | None = None
    name: str = ""
    """As the config names it."""

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def model_source(model: ModelConfig) -> ModelSource:
    """Packaged names become their installed folder; a path to a .gguf file becomes its folder and file."""
    name = model.name_or_path or ""
    if name in PACKAGED_MODELS:
        packaged = PACKAGED_MODELS[name]
        return ModelSource(resolve_model_path(name), model.gguf_file or packaged.gguf_file, name)
    if name.lower().endswith(".gguf"):
        file = Path(name).expanduser()
        if not file.is_file():
            raise ModelError(f"model file {name} not found; check model.name_or_path")
        return ModelSource(str(file.resolve().parent), file.name, name)
    return ModelSource(name, model.gguf_file, name)


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers within a few seconds (False under HF_HUB_OFFLINE=1)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False") or os.environ.get(
            "TRANSFORMERS_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False
    return True


def _is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def _load_kwargs(model: ModelConfig, source: ModelSource) -> dict[str, Any]:
    """from_pretrained arguments shared by tokenizer, config and model."""
    kwargs: dict[str, Any] = {"revision": model.revision}
    if source.is_gguf:
        if importlib.util.find_spec("gguf") is None:
            install = PACKAGED_MODELS[source.name].install if source.name in PACKAGED_MODELS else "pip install gguf"
            raise ModelError(f"model '{source.name}' is read from a .gguf file, which needs the gguf package; "
                             f"run: {install}")
        kwargs["gguf_file"] = source.gguf_file
        gguf_cache.read_quickly()
    if not _is_local(source.path) and not hub_reachable():
        # Offline: only the local cache can help, and it answers at once instead of after minutes of retries.
        kwargs["local_files_only"] = True
    return kwargs


def readable_source(model: ModelConfig, convert: bool = True) -> ModelSource:
    """Where to load ``model`` from: a local .gguf file's converted folder in qatune's cache, converted now
    unless ``convert`` is False (:mod:`qatune.model.gguf_cache`), or :func:`model_source`'s answer."""
    source = model_source(model)
    if not source.is_gguf or not _is_local(source.path):
        return source
    file = Path(source.path) / str(source.gguf_file)
    folder = gguf_cache.convert_once(file, functools.partial(_convert, model, source)) if convert else \
        gguf_cache.converted(file)
    return source if folder is None else ModelSource(str(folder), None, source.name)


def _convert(model: ModelConfig, source: ModelSource, folder: Path) -> None:
    """Write a .gguf file's tokenizer, config and dequantized weights into ``folder`` as transformers reads them
    from the file (its language model with every weight, whatever the task then loads of it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, GgufConfig

    kwargs = _load_kwargs(model, source)
    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=model.trust_remote_code, **kwargs)
    config = gguf_config_fixes(AutoConfig.from_pretrained(source.path, trust_remote_code=model.trust_remote_code,
                                                          **kwargs))
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    with _gguf_loading():
        loaded = auto.from_pretrained(source.path, dtype="float32", config=copy.deepcopy(config),
                                      quantization_config=GgufConfig(dequantize=True),
                                      trust_remote_code=model.trust_remote_code, use_safetensors=False, **kwargs)
    if getattr(loaded, "hf_quantizer", None) is not None:
        loaded.hf_quantizer.remove_quantization_config(loaded)
    gguf_cache.check_room(folder, sum(p.numel() * p.element_size() for p in loaded.parameters()))
    loaded.save_pretrained(folder)
    config.save_pretrained(folder)  # as read from the file: a model's own config gains its class and dtype
    tokenizer.save_pretrained(folder)


@contextmanager
def _gguf_loading():
    """A GGUF file's weights loaded quietly and once-over: transformers shows a progress bar of its own while it
    dequantizes them (only -v shows it here), and asks gguf for the same tensor name map once per submodule of
    the model (397 times for SmolLM2-135M, rebuilding it each time), which is built once here."""
    try:
        import gguf
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None and not log.isEnabledFor(logging.DEBUG):
        gguf_utils.tqdm = functools.partial(original, disable=True)
    name_map = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = name_map
        if original is not None:
            gguf_utils.tqdm = original


def quiet_transformers() -> None:
    """Keep transformers' own progress bars and load reports off the console unless -v."""
    import transformers

    if not log.isEnabledFor(logging.DEBUG):
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()


def load_tokenizer(model: ModelConfig, task: str, convert: bool = True) -> Any:
    """``convert``: a .gguf file is converted once into qatune's cache (:mod:`qatune.model.gguf_cache`) and read
    from there (False: a file read once, such as one just exported, is read directly unless converted before)."""
    from transformers import AutoTokenizer

    source = readable_source(model, convert)
    kwargs = _load_kwargs(model, source)
    quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=model.trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(_load_failure("tokenizer", model.name_or_path, exc, offline=kwargs.get("local_files_only")
                                       )) from None
    return prepare_tokenizer(tokenizer, task, model.name_or_path)


def prepare_tokenizer(tokenizer: Any, task: str, name: str) -> Any:
    if task_kind(task).scores:
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token_id is None:
                raise ModelError(f"tokenizer of '{name}' has neither a PAD nor an EOS token to pad rows with")
            tokenizer.pad_token = tokenizer.eos_token  # padding is decided by the attention mask
        tokenizer.padding_side = "right"
        return tokenizer
    if task_kind(task).points:
        if not getattr(tokenizer, "is_fast", False):
            raise ModelError(f"extractive QA needs a fast tokenizer (character offsets) and '{name}' has none; "
                             "pick a model whose folder has tokenizer.json")
        if tokenizer.cls_token_id is None and tokenizer.pad_token_id is None:
            raise ModelError(f"tokenizer of '{name}' has neither a CLS nor a PAD token")
        tokenizer.padding_side = "right"
        return tokenizer
    if tokenizer.eos_token_id is None:
        raise ModelError(f"tokenizer of '{name}' has no EOS token; generative QA needs one to end answers")
    if tokenizer.pad_token_id is None:
        # GPT-2 has no pad token. Padding is decided by the attention mask, so sharing EOS is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_pretrained(model: ModelConfig, task: str, tokenizer: Any, model_config: Any = None, auto: Any = None,
                    convert: bool = True) -> Any:
    """A pretrained model in float32. A GGUF file is dequantized into a plain model: its weights are
    ordinary tensors, and neither its config nor the folders saved from it carry a quantization mark.
    ``auto``: the transformers class to load it as (default: the task's); a scoring model is built from
    ``model_config`` as given (its heads set in it). ``convert``: as :func:`load_tokenizer`'s."""
    source = readable_source(model, convert)
    model_config = model_config if model_config is not None else load_model_config(model, convert)
    seq2seq = task_kind(task).writes and bool(getattr(model_config, "is_encoder_decoder", False))
    auto = auto or auto_class(task, seq2seq)
    kwargs = _load_kwargs(model, source)
    if task_kind(task).scores:
        kwargs["config"] = model_config
    if model.dropout is not None:
        kwargs["config"] = with_dropout(kwargs.get("config", model_config), model.dropout)
    if source.is_gguf:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
        kwargs["config"] = model_config  # with what the GGUF reader leaves out put back (gguf_config_fixes)
    quiet_transformers()
    try:
        with _gguf_loading():
            # A .gguf file is no pickle either: it is read by the gguf package.
            loaded = auto.from_pretrained(source.path, dtype="float32", trust_remote_code=model.trust_remote_code,
                                          use_safetensors=not source.is_gguf, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(_load_failure("model", model.name_or_path, exc, task,
                                       offline=kwargs.get("local_files_only"))) from None
    if getattr(loaded, "hf_quantizer", None) is not None:
        loaded.hf_quantizer.remove_quantization_config(loaded)
    if source.path != model_source(model).path:
        loaded.config.name_or_path = model_source(model).path  # where it came from, not qatune's cache
    if task_kind(task).writes and getattr(loaded.config, "pad_token_id", None) is None:
        loaded.config.pad_token_id = tokenizer.pad_token_id
    return loaded


# The dropout probabilities transformers' configs name (BERT, GPT-2, T5, BART, Llama and their kin).
DROPOUT_SETTINGS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "dropout",
                    "activation_dropout", "hidden_dropout", "classifier_dropout", "resid_pdrop", "embd_pdrop",
                    "attn_pdrop", "summary_first_dropout", "dropout_rate")


def with_dropout(config: Any, probability: float) -> Any:
    """``config`` with every dropout probability it names set to ``probability`` (model.dropout); names it
    leaves unset (None) or lacks stay so."""
    for name in DROPOUT_SETTINGS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(config, name, probability)
    return config


def auto_class(task: str, seq2seq: bool = False) -> Any:
    """The transformers auto class a pretrained model of ``task`` loads as (an encoder-decoder's where ``seq2seq``)."""
    import transformers

    kind = task_kind(task)
    return getattr(transformers, kind.seq2seq_auto_class if seq2seq and kind.seq2seq_auto_class else kind.auto_class)


def _load_failure(what: str, name: str, exc: Exception, task: str = "", offline: bool | None = False) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    local = Path(name)
    looks_local = local.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not local.exists():
        return f"model folder '{name}' not found; check model.name_or_path"
    if offline and not local.exists():
        installed = sorted(installed_packaged_models())
        instead = (f"or use a model installed for offline use: {', '.join(installed)}" if installed else
                   f"or install one for offline use: {PACKAGED_MODELS['smollm2-135m-instruct'].install}")
        return (f"cannot load the {what} '{name}': the Hugging Face hub is not reachable and it is not in the local "
                f"cache; set model.name_or_path to a local folder, {instead}")
    if local.exists() and local.is_dir():
        from qatune.runs.layout import FINAL, looks_like_run

        if looks_like_run(local):
            return (f"'{name}' is a qatune run directory, not a model folder; set model.name_or_path to its "
                    f"trained model, {Path(name, FINAL).as_posix()} (or a checkpoint folder inside it)")
        if not (local / "config.json").is_file() and not any(local.glob("*.gguf")):
            return (f"model folder '{name}' holds no saved model (no config.json); point model.name_or_path at a "
                    "folder written by save_pretrained, such as a qatune run's final/")
        if "safetensors" in text or "no file named" in text:
            return (f"{what} folder '{name}' has no model.safetensors; qatune loads safetensors only "
                    "(convert the .bin weights with save_pretrained)")
        if "Unrecognized model" in text or "does not appear" in text or "should be one of" in text:
            return f"'{name}' cannot be loaded as {task_kind(task).loads_as if task else 'a model'} ({text})"
        return f"cannot load the {what} from folder '{name}': {text}"
    if local.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:
        return f"model folder '{name}' not found; check model.name_or_path"
    return (f"cannot load the {what} '{name}': not a local folder, and the Hugging Face hub did not provide it "
            f"({text}); check model.name_or_path, or download it first while online")


def build_scratch(shape: ScratchModel, task: str, tokenizer: Any, scoring_config: Any = None) -> Any:
    """A randomly initialised GPT-2, T5 or BERT of the given shape (seed the RNG before calling); for a scoring
    model (``scoring_config``: what sets its heads in a transformers config) GPT-2's or BERT's sequence
    classification.

    Each architecture's modeling module is imported only when it is built (importing BERT's costs a
    GPT-2 run more than a second of start-up).
    """
    scoring_config = scoring_config or (lambda config: config)
    if shape.architecture == "t5":
        from transformers.models.t5 import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=len(tokenizer), d_model=shape.n_embd, d_kv=shape.n_embd // shape.n_head,
            d_ff=4 * shape.n_embd, num_layers=shape.n_layer, num_decoder_layers=shape.n_layer,
            num_heads=shape.n_head, dropout_rate=shape.dropout, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
        )
        return T5ForConditionalGeneration(config)
    if task_kind(task).writes or (task_kind(task).scores and shape.architecture == "gpt2"):
        from transformers.models.gpt2 import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=len(tokenizer), n_positions=shape.n_positions, n_embd=shape.n_embd, n_layer=shape.n_layer,
            n_head=shape.n_head, resid_pdrop=shape.dropout, embd_pdrop=shape.dropout, attn_pdrop=shape.dropout,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            # GPT-2's own GELU (the tanh approximation) as one fused kernel instead of five elementwise ops:
            # the same function, built into the scratch model's config.
            activation_function="gelu_pytorch_tanh",
        )
        if task_kind(task).scores:
            return GPT2ForSequenceClassification(scoring_config(config))
        return GPT2LMHeadModel(config)
    from transformers.models.bert import BertConfig, BertForQuestionAnswering, BertForSequenceClassification

    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=shape.n_embd, num_hidden_layers=shape.n_layer,
        num_attention_heads=shape.n_head, intermediate_size=4 * shape.n_embd,
        max_position_embeddings=shape.n_positions, hidden_dropout_prob=shape.dropout,
        attention_probs_dropout_prob=shape.dropout, pad_token_id=tokenizer.pad_token_id,
    )
    if task_kind(task).scores:
        return BertForSequenceClassification(scoring_config(config))
    return BertForQuestionAnswering(config)


def load_model_config(model: ModelConfig, convert: bool = True) -> Any:
    """The transformers config of a pretrained model, without its weights (``convert``: as
    :func:`load_tokenizer`'s)."""
    from transformers import AutoConfig

    source = readable_source(model, convert)
    kwargs = _load_kwargs(model, source)
    try:
        config = AutoConfig.from_pretrained(source.path, trust_remote_code=model.trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(_load_failure("model", model.name_or_path, exc,
                                       offline=kwargs.get("local_files_only"))) from None
    return gguf_config_fixes(config) if source.is_gguf else config


def gguf_config_fixes(config: Any) -> Any:
    """What transformers' GGUF reader leaves out of a config, put back: a GPT-2's context length arrives as
    ``n_ctx``, which GPT-2 does not read, and its position embeddings would be taken for 1,024 rows."""
    n_ctx = getattr(config, "n_ctx", None)
    if getattr(config, "model_type", None) == "gpt2" and isinstance(n_ctx, int) and n_ctx != config.n_positions:
        config.n_positions = n_ctx
    return config


def model_max_positions(config: Any, tokenizer: Any = None) -> int | None:
    """Longest sequence a model config's position embeddings allow (None when unknown)."""
    for name in ("n_positions", "max_position_embeddings", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 1_000_000 else None
