"""train.distributed: fsdp on two CPU processes (gloo): the model sharded block by block (DTensors on dim 0, half on
each process), every logged loss and every final weight the same as one process with gradient accumulation (a
tiny GPT-2 from scratch, a tiny Llama from a local folder, LoRA, CPU offload with activation checkpointing), the
global gradient norm clipped, a moving average of the weights kept shard by shard, a sharded checkpoint resumed
exactly (also after one process was killed), a failure on one process ending both in one line, and the set-ups it
cannot train refused in one line."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from qatune.cli import cli
from qatune.commands.launch import torchrun_launcher
from tests.conftest import ROOT, chat_tokenizer, tiny_llama
from tests.failing_process import error_lines, injected

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROWS = [(f"what is item {i}?", f"thing {i * 7}") for i in range(32)]
GPT2 = "{scratch: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 300}}"


def qatune(*args, processes=1, here=True):
    """``qatune ARGS``: one process ``here`` runs in this one (its imports made once; its peak memory is this
    process's), else in a child process, which launches torchrun for several. Its stdout, or of several processes
    their stderr (their log)."""
    if processes == 1 and here:
        done = CliRunner().invoke(cli, [*map(str, args)])
        assert done.exit_code == 0, done.output + done.stderr
        return done.stdout
    launch = ["--num-processes", str(processes)] if processes > 1 else []
    done = subprocess.run([sys.executable, "-m", "qatune", *map(str, args), *launch], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout if processes == 1 else done.stderr


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    (tmp / "qa.csv").write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in ROWS))
    (tmp / "held.csv").write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in ROWS[::3]))
    return tmp


def config(tmp_path, data, model, *extra):
    """Validation splits held.csv's 11 rows 6/5 between two processes: 2 batches of 5 on one, 1 on the other (the
    sharded forwards go in lockstep)."""
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(f"""
        model: {model}
        data: {{train_file: {data / "qa.csv"}, eval_file: {data / "held.csv"}}}
        train: {{epochs: 2, batch_size: 4, logging_steps: 1, learning_rate: 3.0e-3, precision: fp32,
                 keep_checkpoints: 10, eval_batch_size: 5}}
        """) + "".join(f"{line}\n" for line in extra))
    return path


def train_both(tmp_path, path, *sets, sharded_only=(), one_speedups="off", one_here=True):
    """The config on two processes with fsdp, and on one (speed paths off: fsdp has none) with accumulation 2 (in this
    process unless ``one_here`` is false)."""
    sets = [arg for item in sets for arg in ("--set", item)]
    two = qatune("train", "--config", path, "--output-dir", tmp_path / "two", "--quiet", "--set",
                 "train.distributed=fsdp", *sets, *[arg for item in sharded_only for arg in ("--set", item)],
                 processes=2)
    qatune("train", "--config", path, "--output-dir", tmp_path / "one", "--quiet", "--set",
           "train.gradient_accumulation_steps=2", "--set", f"train.speedups={one_speedups}", *sets, here=one_here)
    return two


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_steps(a, b, rel=1e-5, weights=True, answers_apart=0):
    """``answers_apart``: held-out answers that may differ (bf16: a greedy token where two logits are closer than
    bf16's rounding, which differs with the batches' shapes where bf16 is emulated)."""
    ma, mb = metrics(a), metrics(b)
    assert [(m["event"], m["step"]) for m in ma] == [(m["event"], m["step"]) for m in mb]
    for x, y in zip(ma, mb, strict=True):
        assert abs(x["loss"] - y["loss"]) <= rel * abs(x["loss"]), (x, y)
        if x["event"] == "eval":
            assert x["num_examples"] == y["num_examples"]
            apart = 100 * answers_apart / x["num_examples"] + 1e-9  # one answer moves EM and F1 at most this much
            assert all(abs(x[name] - y[name]) <= apart for name in ("exact_match", "f1")), (x, y)
        else:
            # The global norm, not a shard's (one of two shards holds about 0.7 of it): summed over ranks in an
            # order gloo picks, it has been seen 9e-5 apart from one process's where the losses agree to 1e-5.
            assert abs(x["grad_norm"] - y["grad_norm"]) <= max(rel, 1e-3) * x["grad_norm"], (x, y)
    if weights:
        for name in ("model.safetensors", "adapter_model.safetensors"):
            if (a / "final" / name).is_file():
                wa, wb = load_file(a / "final" / name), load_file(b / "final" / name)
                assert sorted(wa) == sorted(wb)
                for key in wa:
                    scale = float(wa[key].abs().max()) or 1.0
                    assert float((wa[key] - wb[key]).abs().max()) <= rel * scale, key


def test_gpt2_matches_one_process_and_resumes_exactly(tmp_path, data):
    """With a moving average of the weights (train.ema_decay), which validation, best/ and final/ read: each process
    averages its shard. Without clipping the updates are identical (test_clipped_gradients_match_one_process: with
    it)."""
    path = config(tmp_path, data, GPT2)
    log = train_both(tmp_path, path, "train.max_grad_norm=null", "train.save_every=3", "train.ema_decay=0.8",
                     one_here=False)  # its peak memory is measured below
    assert "fsdp: 2 FSDPGPT2Block units and the root, sharded on 2 processes: 0.02M of 0.04M parameters" in log
    assert "speedups (auto): none on: train.distributed is fsdp" in log
    assert_same_steps(tmp_path / "one", tmp_path / "two")
    # validation's predictions, each process writing its own rows, gathered in the rows' order
    validation = "predictions-validation.csv"
    assert (tmp_path / "two" / validation).read_text() == (tmp_path / "one" / validation).read_text()
    # qatune check's estimates of the peak per process, against the peaks the runs measured.
    check = qatune("check", "--config", path, "--json", here=False)  # its estimate counts its own imports
    estimated = {s["setup"]: s["total_gib"] for s in json.loads(check)["memory"]["setups"]}
    for setup, run in (("1 process", "one"), ("fsdp x 2", "two")):
        measured = json.loads((tmp_path / run / "run.json").read_text())["result"]["peak_memory_mb"] / 1024
        assert 0.7 * measured <= estimated[setup] <= 1.3 * measured, (setup, estimated, measured)
    # final/ and best/ are whole model folders; a checkpoint holds a shard of the weights and optimizer per process.
    def files(run, under):
        return sorted(str(p.relative_to(run / under)) for p in (run / under).rglob("*") if p.is_file())

    for folder in ("final", "best"):
        assert files(tmp_path / "two", folder) == files(tmp_path / "one", folder)
    step3 = files(tmp_path / "two", "checkpoints/step-0000003")
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "scheduler.pt", "rng.pt",
            "trainer_state.json", "config.json"} <= set(step3)
    assert "model.safetensors" not in step3 and "optimizer.pt" not in step3 and "average.pt" not in step3
    # eval reads a sharded checkpoint in one process, without a warning: the same weights as one process's step 3.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        scores = [json.loads(qatune("eval", tmp_path / run / "checkpoints" / "step-0000003", "--data",
                                    data / "held.csv", "--json")) for run in ("one", "two")]
    assert abs(scores[0]["loss"] - scores[1]["loss"]) <= 1e-5 * scores[0]["loss"], scores
    # A checkpoint written at step 3 continues as the run that never stopped.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    qatune("train", "--resume", resumed / "checkpoints" / "step-0000003", "--quiet", processes=2)
    assert_same_steps(tmp_path / "two", resumed, rel=1e-6)


def test_a_scorer_whose_pooler_never_trains_resumes_exactly(tmp_path):
    """Mean pooling leaves a BERT's pooler out of the loss, so a sharded checkpoint holds no optimizer state for it:
    the resume loads the state there is (and the average of every weight). Its validations never improve (made so),
    so no best/ is gathered after one, where the root unit keeps the average that validation gathered: the sharded
    average is still checkpointed, and training goes on from the trained weights."""
    from tests.e2e.test_scoring_cli import CONFIG, rows, write

    path = tmp_path / "scoring.yaml"
    path.write_text(CONFIG.format(train=write(tmp_path / "train.csv", rows(48, 1)),
                                  held=write(tmp_path / "held.csv", rows(12, 2)), columns="[verdict, score]"))
    sets = [arg for item in ("model.pooling=mean", "train.epochs=2", "train.save_every=2", "train.keep_checkpoints=10",
                             "train.distributed=fsdp", "train.ema_decay=0.9") for arg in ("--set", item)]
    never = injected(tmp_path, *[(rank, "qatune.train.validation:better", "false") for rank in (0, 1)])

    def train(*args):
        done = subprocess.run([sys.executable, "-m", "qatune", "train", *map(str, args), "--quiet", "--num-processes",
                               "2"], capture_output=True, text=True, cwd=ROOT, env=never, check=False)
        assert done.returncode == 0, done.stderr

    train("--config", path, "--output-dir", tmp_path / "whole", *sets)
    assert not (tmp_path / "whole" / "best").exists()
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed)
    train("--resume", resumed / "checkpoints" / "step-0000002")
    assert_same_steps(tmp_path / "whole", resumed, rel=1e-6)


@pytest.fixture(scope="module")
def clipped(tmp_path_factory, data):
    """The GPT-2 config as it is (gradients clipped) trained on two processes with fsdp (two/) and on one (one/)."""
    tmp = tmp_path_factory.mktemp("clipped")
    train_both(tmp, config(tmp, data, GPT2))
    return tmp


def test_clipped_gradients_match_one_process(clipped):
    """The global norm is summed in another order than one process sums it: the same steps to its last digits."""
    assert_same_steps(clipped / "one", clipped / "two", weights=False)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "tiny-llama"
    tokenizer = chat_tokenizer([f"{q} {a}" for q, a in ROWS] * 3, vocab_size=400)
    tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("lora,memory", [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "offload-and-activation-checkpointing"])
def test_llama_matches_one_process(lora, memory, tmp_path, data, llama_folder):
    lora_yaml = ", lora: {r: 4, alpha: 8, dropout: 0.0}" if lora else ""
    path = config(tmp_path, data, f"{{name_or_path: {llama_folder}{lora_yaml}}}")
    sets = ["train.max_grad_norm=null"] + (["train.activation_checkpointing=true"] if memory else [])
    log = train_both(tmp_path, path, *sets, sharded_only=["train.cpu_offload=true"] if memory else [])
    assert "fsdp: 1 FSDPLlamaDecoderLayer units and the root" in log
    if memory:
        assert "kept in CPU memory between uses (train.cpu_offload)" in log
        assert "activation checkpointing: each block's activations recomputed in the backward pass" in log
    assert_same_steps(tmp_path / "one", tmp_path / "two")


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    """A tiny T5 without dropout (the processes draw other masks than one process) and its tokenizer, saved."""
    from transformers import T5Config, T5ForConditionalGeneration

    from qatune.model.scratch_tokenizer import train_scratch_tokenizer

    folder = tmp_path_factory.mktemp("t5") / "tiny-t5"
    tokenizer = train_scratch_tokenizer("generative", [f"{q} {a}" for q, a in ROWS] * 3, 300, "t5")
    T5ForConditionalGeneration(T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_t5_encoder_and_decoder_blocks_are_units_and_match_one_process(tmp_path, data, t5_folder):
    """The units are the blocks the model never splits (T5Block, in the encoder and the decoder alike)."""
    path = config(tmp_path, data, f"{{name_or_path: {t5_folder}}}")
    log = train_both(tmp_path, path, "train.max_grad_norm=null", "train.epochs=1")
    assert "fsdp: 4 FSDPT5Block units and the root" in log
    assert_same_steps(tmp_path / "one", tmp_path / "two")


def test_bf16_matches_one_process_with_fp32_master_weights(tmp_path, data):
    """Under bf16 the units compute in bf16 from fp32 shards and reduce gradients in fp32, as one process's bf16
    weights with fp32 masters do: the same steps, to a fraction of bf16's resolution (2^-8) where they round
    differently, and the same held-out answers but one (validation batches other rows together on two processes
    than on one)."""
    path = config(tmp_path, data, GPT2)
    log = train_both(tmp_path, path, "train.max_grad_norm=null", "train.precision=bf16", "train.epochs=1",
                     one_speedups="[bf16_master_weights]")
    assert "computing in bf16 with fp32 gradient reduction" in log
    assert_same_steps(tmp_path / "one", tmp_path / "two", rel=1e-3, weights=False, answers_apart=1)


SHARDED = """
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from tests.conftest import chat_tokenizer, tiny_llama
from qatune.train.sharding import shard
dist.init_process_group("gloo")
model = tiny_llama(chat_tokenizer())
total = sum(p.numel() for p in model.parameters())
print(shard(model, "fp32", torch.device("cpu")), flush=True)
params = list(model.parameters())
assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params)
local = sum(p.to_local().numel() for p in params)
print(f"rank {dist.get_rank()}: {local} of {total}", flush=True)  # one write each: the processes share the pipe
assert model.lm_head.weight is model.model.embed_tokens.weight
# bf16: the blocks hand each other bf16 activations; only the root casts its output (the logits) to fp32.
low = tiny_llama(chat_tokenizer())
shard(low, "bf16", torch.device("cpu"))
seen = []
hook = lambda module, inputs, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype)  # noqa: E731
low.model.layers[0].register_forward_hook(hook)
assert low(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32 and seen == [torch.bfloat16], seen
dist.destroy_process_group()
"""


def test_parameters_are_dtensors_split_on_dim0_and_bf16_units_pass_bf16(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    done = subprocess.run([*torchrun_launcher(2), str(script)], capture_output=True, text=True, cwd=ROOT,
                          check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    shares = re.findall(r"rank \d: (\d+) of (\d+)", done.stdout)
    assert len(shares) == 2, done.stdout
    assert sum(int(local) for local, _ in shares) == int(shares[0][1])
    assert all(0.4 < int(local) / int(total) < 0.6 for local, total in shares)


def test_a_failure_on_one_process_ends_both_in_one_line(tmp_path, data):
    """The main process fails writing a checkpoint while the other writes its shard of it (in a collective): both
    end within seconds, with the main process's message in one line, and run.json says failed."""
    path = config(tmp_path, data, GPT2)
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(path), "--output-dir", str(run),
                           "--quiet", "--set", "train.distributed=fsdp", "--set", "train.save_every=2",
                           "--num-processes", "2"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=injected(tmp_path, (0, "qatune.train.loop:save_checkpoint", "raise")), check=False)
    seconds = time.time() - float((tmp_path / "failed_at").read_text())
    message = ("process 0 of 2 failed: internal error: RuntimeError: injected failure in save_checkpoint (run with -v "
               "for the traceback; please report it with the output of 'qatune env')")
    assert error_lines(done.stderr) == [f"error: {message}"], done.stderr
    assert done.returncode == 2
    assert seconds < 30, f"the processes ended {seconds:.1f} s after the failure"
    status = json.loads((run / "run.json").read_text())
    assert (status["status"], status["error"]) == ("failed", message)
    assert not list((run / "checkpoints").glob("step-*"))
    print(f"both processes ended {seconds:.1f} s after the failure")


def test_fsdp_needs_several_processes(tmp_path, data):
    path = config(tmp_path, data, "{scratch: {n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 300}}")
    done = subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(path), "--output-dir",
                           str(tmp_path / "run"), "--set", "train.distributed=fsdp"], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert ("error: train.distributed fsdp shards the model across processes, and this run has one; train with "
            "--num-processes N (N >= 2) or torchrun") in done.stderr
    assert not (tmp_path / "run").exists()


def test_two_nodes_over_loopback(tmp_path, data, clipped):
    """The same run launched as two one-process "nodes" by torchrun with a c10d rendezvous, as on two machines: the
    steps of the two processes of one machine (clipped/two)."""
    import socket

    path = config(tmp_path, data, GPT2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
         str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "qatune-test",
         f"--log-dir={tmp_path / 'logs'}", "-m", "qatune", "train", "--config", str(path), "--output-dir",
         str(tmp_path / "nodes"), "--quiet", "--set", "train.distributed=fsdp"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert_same_steps(clipped / "two", tmp_path / "nodes", rel=1e-6)


def rank_pid(parent, rank):
    """The pid of the training process with ``rank`` among ``parent``'s descendants (torchrun's workers)."""
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            with open(f"/proc/{proc}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and f"QATUNE_TEST_PARENT={parent}".encode() in environ:
            return int(proc)
    return None


def test_resumes_after_one_process_is_killed(tmp_path, data):
    """kill -9 of one process mid-run: the newest whole checkpoint continues as if nothing happened."""
    import signal
    import time

    path = config(tmp_path, data, GPT2)
    sets = ["--set", "train.distributed=fsdp", "--set", "train.save_every=1", "--set", "train.epochs=2",
            "--set", "train.max_grad_norm=null", "--quiet"]
    qatune("train", "--config", path, "--output-dir", tmp_path / "whole", *sets, processes=2)
    marker = f"kill-{os.getpid()}"
    run = subprocess.Popen([sys.executable, "-m", "qatune", "train", "--config", str(path), "--output-dir",
                            str(tmp_path / "killed"), *sets, "--num-processes", "2"], cwd=ROOT,
                           env={**os.environ, "QATUNE_TEST_PARENT": marker}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (tmp_path / "killed" / "checkpoints" / "step-0000005").is_dir() and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = rank_pid(marker, 1)
    assert pid is not None, "no process of rank 1"
    os.kill(pid, signal.SIGKILL)
    output = run.communicate(timeout=300)[0]
    assert run.returncode != 0, output
    assert not (tmp_path / "killed" / "final").exists()
    qatune("train", "--resume", tmp_path / "killed", "--quiet", processes=2)
    assert_same_steps(tmp_path / "whole", tmp_path / "killed", rel=1e-6)
    assert not [p.name for p in (tmp_path / "killed" / "checkpoints").iterdir() if p.name.startswith(".")]
    # Resuming with another number of processes is refused before they start: each trains its own share of every
    # step.
    done = subprocess.run([sys.executable, "-m", "qatune", "train", "--resume", str(tmp_path / "whole" / "checkpoints"
                           / "step-0000008"), "--quiet", "--num-processes", "3"], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr and "launching" not in done.stderr
    assert "was written by a run of 2 processes and this one has 3: an exact resume needs the same number" in \
        done.stderr
