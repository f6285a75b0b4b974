"""Command line: the only package that imports click. QatuneError -> one clear line and exit 1.

The group, how a command's errors become exits, and the commands that make and use a run; the commands that start
a server (serve, ui) are in servers.py, the ``-v`` every command takes in options.py. Heavy libraries (torch,
transformers, pandas) are imported inside the commands, so ``--help`` is fast.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import sys
import traceback
import warnings

import click

from qatune import __version__
from qatune.cli.options import verbose_option
from qatune.cli.servers import serve, ui
from qatune.commands.process import exit_without_teardown, first_to_say
from qatune.errors import QatuneError

log = logging.getLogger("qatune")


class QatuneGroup(click.Group):
    """Runs a command and turns library errors into one line on stderr and a non-zero exit."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QatuneError as exc:
            if ctx.meta.get("qatune.verbose"):
                traceback.print_exc()
            # several processes of a run meeting one error say it once
            if getattr(exc, "said_here", True) and first_to_say(str(exc)):
                click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:
            # The reader of our output went away (qatune ... | head): nothing went wrong here.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, io.UnsupportedOperation):
                pass  # stdout is not a real file (in-process runner): nothing more will be written to it
            ctx.exit(0)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # a bug in qatune: say so, and keep the traceback behind -v
            if ctx.meta.get("qatune.verbose"):
                traceback.print_exc()
                ctx.exit(2)
            click.echo(f"internal error: {type(exc).__name__}: {exc} (run with -v for the traceback; "
                       "please report it with the output of 'qatune env')", err=True)
            ctx.exit(2)


@click.group(cls=QatuneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qatune")
@verbose_option
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Turn a spreadsheet of questions and answers into a fine-tuned QA model."""
    level = logging.DEBUG if ctx.meta.get("qatune.verbose") else logging.INFO
    _setup_logging(level)
    if not ctx.meta.get("qatune.verbose"):
        warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation chatter
        warnings.filterwarnings("ignore", category=DeprecationWarning)


def _setup_logging(level: int) -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        level = max(level, logging.ERROR)  # other processes of an accelerate launch stay quiet
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


cli.add_command(serve)
cli.add_command(ui)


@cli.command()
@click.option("--config", "config_path", default=None,
              help="YAML config file (see configs/); with --resume, the run's own saved config by default.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. --set train.learning_rate=1e-5 (repeatable).")
@click.option("--output-dir", default=None, help="Run directory (default: output_dir from the config).")
@click.option("--overwrite", is_flag=True, help="Replace an existing run directory.")
@click.option("--resume", is_flag=False, flag_value="", default=None, metavar="[RUN_DIR|CHECKPOINT]",
              help="Continue a stopped run from its newest checkpoint, with its saved config and --set on top "
                   "(default RUN_DIR: --output-dir, or the config's output_dir).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--num-processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Training processes on this machine (launches torchrun; GPUs or CPU with gloo).")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Machines training together; run the same command on each, with its own --node-rank.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --nodes: this machine's number, 0 for the one at --master.")
@click.option("--master", default=None, metavar="HOST:PORT",
              help="With --nodes: the address of the machine with --node-rank 0, reachable from all.")
@click.option("--join-timeout", type=click.IntRange(min=1), default=600, show_default=True,
              help="With --nodes: seconds to wait for the other machines to join.")
@verbose_option
@click.pass_context
def train(ctx: click.Context, config_path: str | None, overrides: tuple[str, ...], output_dir: str | None,
          overwrite: bool, resume: str | None, quiet: bool, num_processes: int, nodes: int, node_rank: int,
          master: str | None, join_timeout: int) -> None:
    """Fine-tune a model on a spreadsheet and write a run directory.

    The run directory holds final/ (a plain transformers model folder), best/ (when there is
    validation data), config.yaml, metrics.jsonl and run.json. Every config key, with its type
    and default: qatune config --keys.
    """
    if config_path is None and resume is None:
        raise click.UsageError("Missing option '--config' (or --resume RUN_DIR to continue a stopped run).", ctx)
    if config_path is None and not (resume or output_dir):
        raise click.UsageError("--resume without --config needs the run to continue: --resume RUN_DIR", ctx)
    from qatune.config import load_config
    from qatune.train import train as run_training
    from qatune.train.resume import saved_config

    # Without --config, a resumed run keeps its own saved config (a stale config file could end it early).
    config = load_config(config_path, overrides) if config_path else saved_config(resume or output_dir, overrides)
    from qatune.commands.launch import launch, launches, process_args

    if launches(num_processes, nodes):
        if resume:
            from qatune.train.resume import check_launch

            check_launch(resume, num_processes * nodes)
        args = process_args(config_path, overrides, output_dir, overwrite, resume, quiet,
                            verbose=bool(ctx.find_root().meta.get("qatune.verbose")))
        ctx.exit(launch(args, num_processes, nodes, node_rank, master, join_timeout))
    run_dir = run_training(config, output_dir=output_dir, overwrite=overwrite, progress=not quiet, resume=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(str(run_dir))


@cli.command(name="eval")
@click.argument("run_dir", required=False)
@click.option("--data", "data_file", default=None, help="Held-out spreadsheet with the same columns as training.")
@click.option("--model", "which", type=click.Choice(["final", "best"]), default="final", show_default=True,
              help="Which model of the run to evaluate.")
@click.option("--base", is_flag=True,
              help="Evaluate the config's pretrained model before fine-tuning (with --config; no RUN_DIR).")
@click.option("--config", "config_path", default=None, help="With --base: the YAML config of the run to compare.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="With --base: override a config key. With RUN_DIR: how --data is read, e.g. --set data.sheet=0 "
                   "or --set data.question_column=Q (data.sheet/encoding/delimiter/*_column/answer_separator).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Evaluation batch size.")
@click.option("--compare", "compare_with", default=None, metavar="base|RUN|FILE.gguf",
              help="Also evaluate another model on the same rows and write compare-<file>.md and .csv: base (the "
                   "run's model before fine-tuning), another run, or a .gguf file.")
@click.option("--grounded", type=click.Choice(["auto", "on", "off"]), default=None,
              help="Answer with a span of the row's passage (on), freely (off), or as the run decided when it "
                   "trained (auto); default: the run's generate.grounded.")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON on stdout.")
@verbose_option
def eval_command(run_dir: str | None, data_file: str | None, which: str, base: bool, config_path: str | None,
                 overrides: tuple[str, ...], batch_size: int | None, compare_with: str | None, grounded: str | None,
                 as_json: bool) -> None:
    """Evaluate a trained run (or a .gguf file) on a held-out file: loss, perplexity, exact match, F1.

    Writes eval-<file>.json and predictions-<file>.csv into the run directory (beside a .gguf file:
    eval-<gguf name>-<file>.json, predictions-<gguf name>-<file>.csv). With --base --config X.yaml,
    the untouched pretrained model is evaluated with the same prompt, on data.eval_file or --data (its files
    go to OUTPUT_DIR-base/): what fine-tuning starts from. A grading run also gets a picture per label field
    (confusion-<file>-<field>.png) and per number field (scores-<file>-<field>.png).

    With --compare base|RUN|FILE.gguf, another model answers the same rows too, and compare-<file>.md and
    compare-<file>.csv show how each metric moved and which rows went right -> wrong and wrong -> right.
    """
    from qatune.commands.evaluation import result_lines, run_eval

    result = run_eval(run_dir, data_file, which, base, config_path, overrides, batch_size, compare_with,
                      progress=True, grounded=grounded)  # bars on stderr: --json keeps stdout
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=2))
        return
    for line in result_lines(result):
        click.echo(line)


@cli.command()
@click.argument("run_dir")
@click.argument("question", required=False)
@click.option("--context", default=None,
              help="The passage (extractive runs, and prompts with {context}).")
@click.option("--context-file", type=click.Path(dir_okay=False), default=None,
              help="Read the passage from a text file.")
@click.option("--file", "data_file", default=None, help="Answer every row of a spreadsheet (question column).")
@click.option("--field", "fields", multiple=True, metavar="NAME=VALUE",
              help="A column the run's prompt names besides the question, e.g. --field 'Total Marks=3' (repeatable).")
@click.option("--output", "--out", "output", default=None,
              help="With --file: where to write the answers (.csv, .tsv, .xlsx, .json or .jsonl, by its suffix). "
                   "A grading run (data.answer_columns) keeps the sheet as it is and adds the fields, 'parsed' and "
                   "'model output' columns; an .xlsx written from a workbook keeps its other sheets.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="With --file: how the file is read, e.g. --set data.sheet=0 or --set data.question_column=Q "
                   "(data.sheet/encoding/delimiter/*_column/answer_separator).")
@click.option("--with", "with_runs", multiple=True, metavar="RUN",
              help="With --file and a grading run: another grading run that grades the same rows and adds the "
                   "columns no run before it gives (a scorer's verdict and score, then a generative run's feedback; "
                   "repeatable).")
@click.option("--model", "which", type=click.Choice(["final", "best"]), default="final", show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="Longest generated answer.")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=None, help="0 is greedy; above 0 samples.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=None,
              help="Nucleus sampling threshold.")
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--grounded", type=click.Choice(["auto", "on", "off"]), default=None,
              help="Answer with a span of the row's passage (on), freely (off), or as the run decided when it "
                   "trained (auto); default: the run's generate.grounded.")
@verbose_option
def generate(run_dir: str, question: str | None, context: str | None, context_file: str | None,
             data_file: str | None, fields: tuple[str, ...], output: str | None, overrides: tuple[str, ...],
             with_runs: tuple[str, ...], which: str, max_new_tokens: int | None, temperature: float | None,
             top_p: float | None, seed: int | None, grounded: str | None) -> None:
    """Answer a question (or every row of --file) with a trained run or a .gguf file. Prints the answer only."""
    from qatune.commands.answering import run_generate

    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "grounded": grounded}
    answer = run_generate(run_dir, question, context, context_file, data_file, fields, output, overrides, which,
                          options, seed, with_runs)
    click.echo(str(answer))
    # stdout stays the answer (empty) for scripts; a person sees why the line is blank
    if isinstance(answer, str) and not answer.strip():
        click.echo("note: the model's answer is empty; a model trained longer, or on more rows like this "
                   "question, may answer it", err=True)


@cli.command()
@click.option("--config", "config_path", required=True, help="YAML config file.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--overfit", type=click.IntRange(min=1), default=None, metavar="N",
              help="Also train a few dozen steps on N rows; fail if the loss does not fall near zero.")
@click.option("--overfit-steps", type=click.IntRange(min=1), default=50, show_default=True,
              help="Optimizer steps of the --overfit run.")
@click.option("--processes", type=click.IntRange(min=2), default=None,
              help="Processes the run will train on, on this machine (train --num-processes N): the configured set-up "
                   "is judged on that many [default: a ddp config as one process; DDP and FSDP shown on 2].")
@verbose_option
def check(config_path: str, overrides: tuple[str, ...], as_json: bool, overfit: int | None, overfit_steps: int,
          processes: int | None) -> None:
    """Check config, data, tokenization and settings before training, and estimate the memory it needs.

    Exit code 0 when fit to train (warnings allowed), 1 when there are errors.
    """
    from qatune.commands.check import render_report, run_check
    from qatune.config import load_config

    try:
        report = run_check(load_config(config_path, overrides), overfit=overfit, overfit_steps=overfit_steps,
                           processes=processes)
    except QatuneError as exc:
        if as_json:  # scripts read stdout: a problem that stops the check is JSON there too (and the line on stderr)
            click.echo(json.dumps({"ok": False, "error": str(exc)}, indent=2, ensure_ascii=False))
        raise
    click.echo(json.dumps(report, indent=2, ensure_ascii=False) if as_json else render_report(report))
    if not report["ok"]:
        raise click.exceptions.Exit(1)


@cli.command()
@click.argument("run_dir")
@click.option("--merge", "merged", metavar="FOLDER", default=None,
              help="Write a plain transformers folder (LoRA adapters folded in).")
@click.option("--gguf", "gguf_file", metavar="OUT.gguf", default=None,
              help="Write one GGUF file for llama.cpp, Ollama and LM Studio, and OUT.Modelfile beside it.")
@click.option("--quant", type=click.Choice(["f16", "bf16", "q8_0", "f32"]), default="f16", show_default=True,
              help="With --gguf: the weights' precision in the file.")
@click.option("--data", "data_file", default=None,
              help="With --gguf: the rows to check the file on (default: the run's held-out rows).")
@click.option("--rows", type=click.IntRange(min=1), default=32, show_default=True,
              help="With --gguf: how many held-out rows the check asks (their prompts, and the next token at every "
                   "position of prompt and answer, the file against the run); more rows check deeper, and take "
                   "longer.")
@click.option("--answers", "answer_rows", type=click.IntRange(min=0), default=4, show_default=True,
              help="With --gguf: of those rows, how many the run and the file both answer (greedy), to compare.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="With --data: how the file is read, e.g. --set data.sheet=0 or --set data.question_column=Q.")
@click.option("--model", "which", type=click.Choice(["final", "best"]), default="final", show_default=True)
@verbose_option
def export(run_dir: str, merged: str | None, gguf_file: str | None, quant: str, data_file: str | None, rows: int,
           answer_rows: int, overrides: tuple[str, ...], which: str) -> None:
    """Write a run's model for other tools: a plain transformers folder (--merge), or a GGUF file (--gguf)
    checked against the run before it is written.

    \b
      qatune export runs/faq --merge faq-model
      qatune export runs/faq --gguf faq.gguf --quant q8_0     # then: ollama create faq -f faq.Modelfile
    """
    if (merged is None) == (gguf_file is None):
        raise QatuneError("pass one of --merge FOLDER (a transformers folder) or --gguf OUT.gguf (llama.cpp, Ollama)")
    if merged is not None:
        if data_file is not None or overrides:
            raise QatuneError("--data and --set go with --gguf (the rows its check asks)")
        from qatune.export.merged import export_merged

        click.echo(str(export_merged(run_dir, merged, which)))
        return
    from qatune.export.gguf import export_gguf

    if overrides and data_file is None:
        raise QatuneError("--set goes with --data (how that file is read)")
    path, check = export_gguf(run_dir, gguf_file, quant, which, data_file, overrides, rows, answer_rows)
    click.echo(f"check on {check.rows} rows of {check.rows_from}: {check.line()}", err=True)
    click.echo(f"Ollama: ollama create NAME -f {path.with_suffix('.Modelfile')}", err=True)
    click.echo(str(path))


@cli.command()
@click.argument("data_file")
@click.option("--task", type=click.Choice(["auto", "generative", "extractive"]), default="auto", show_default=True,
              help="auto: extractive when a context column holds the answers.")
@click.option("--sheet", default=None, help="Excel sheet name or 0-based index (default: the first sheet).")
@click.option("--delimiter", default=None,
              help="Cell separator of a text file, e.g. ';' or tab (default: ',', or tab for .tsv).")
@click.option("--question", "question_column", default=None, help="The column with the questions (else guessed).")
@click.option("--answer", "answer_column", default=None, help="The column with the answers (else guessed).")
@click.option("--context", "context_column", default=None, help="The column with the passages (else guessed).")
@click.option("--model", default=None,
              help="Model to fine-tune (default: gpt2 / bert-base-uncased; offline, an installed packaged model).")
@click.option("--output", default="qatune.yaml", show_default=True, help="Config file to write.")
@click.option("--output-dir", default=None, help="Run directory to put in the config.")
@click.option("--force", is_flag=True, help="Replace an existing config file.")
@verbose_option
def init(data_file: str, task: str, sheet: str | None, delimiter: str | None, question_column: str | None,
         answer_column: str | None, context_column: str | None, model: str | None, output: str, output_dir: str | None,
         force: bool) -> None:
    """Guess the question/answer/context columns of a spreadsheet and write a config for it."""
    from pathlib import Path

    from qatune.commands.init import choose_model, describe, inspect, write_config
    from qatune.config import delimiter_character

    try:
        delimiter = delimiter_character(delimiter) if delimiter is not None else None
    except ValueError as exc:
        raise QatuneError(f"--delimiter: {exc}") from None
    path = Path(data_file)
    found = inspect(path, sheet=sheet, task=task, question_column=question_column, answer_column=answer_column,
                    context_column=context_column, delimiter=delimiter)
    chosen = choose_model(found.task, model)
    click.echo(describe(found, path))
    click.echo(f"  {'model:':17} {chosen.column!r:24} ({chosen.reason})")
    write_config(Path(output), path, found, chosen.column, output_dir, force)
    click.echo(f"wrote {output}; next: qatune check --config {output}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@verbose_option
def env(as_json: bool) -> None:
    """Versions and devices: what a bug report needs."""
    from qatune.commands.environment import environment

    info = environment()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    width = max(map(len, info))
    for key, value in info.items():
        click.echo(f"{key:<{width}}  {value}")


@cli.command(name="config")
@click.option("--keys", "list_keys", is_flag=True, help="List every config key with its type and default.")
@click.option("--config", "config_path", default=None, help="A YAML config to resolve and print.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@verbose_option
def config_command(list_keys: bool, config_path: str | None, overrides: tuple[str, ...]) -> None:
    """Every config key (--keys), or a config resolved with its defaults and overrides, as YAML."""
    from qatune.config import key_lines, load_config

    if list_keys:
        click.echo("\n".join(key_lines()))
        return
    if config_path is None and not overrides:
        raise click.UsageError("pass --keys, or --config FILE (and --set KEY=VALUE) to print the resolved config")
    click.echo(load_config(config_path, overrides).to_yaml(), nl=False)


def entry() -> int:
    """The ``qatune`` console script: :func:`main`, then an exit without the interpreter's teardown.

    At exit Python collects once more over every object alive, and a process that imported torch and
    transformers holds millions: that sweep took ~0.9 s of every command's wall time (gc.freeze moves
    them out of its reach). It then frees every object one by one, the model and optimizer state
    included (another ~0.2 s after training): :func:`exit_without_teardown` leaves that to the OS.
    """
    code = main()
    gc.freeze()
    exit_without_teardown(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (testable without a subprocess)."""
    try:
        code = cli.main(args=argv, prog_name="qatune", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0
