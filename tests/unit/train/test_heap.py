"""The process's memory while it trains (qatune.train.heap): freed memory handed back when it piles up beyond what
a settled step held, never while it does not, and a warning when an epoch holds much more than the one before."""

from qatune.train.heap import Heap

MB = 2**20


class FakeProcess:
    """A resident set that the test moves: ``freed`` MB of it are free memory a trim gives back."""

    def __init__(self, live: int):
        self.live, self.freed, self.trims = live, 0, 0

    def resident(self) -> int:
        return (self.live + self.freed) * MB

    def trim(self) -> None:
        self.trims += 1
        self.freed = 0


def test_freed_memory_is_handed_back_only_when_it_piles_up():
    process = FakeProcess(live=1000)
    heap = Heap(enabled=True, resident=process.resident, trim=process.trim)
    assert heap.after_update() == 1000.0  # the first step settles what a step holds
    for _ in range(5):  # steps that hold what the first did: nothing to give back
        assert heap.after_update() == 1000.0
    process.freed = 79  # 7.9% more: within the slack
    assert heap.after_update() == 1079.0 and process.trims == 0
    process.freed = 81  # 8.1% more: handed back, and the step after the trim settles again
    assert heap.after_update() == 1000.0 and process.trims == 1
    process.live = 1200  # a wider batch needs more, for real: it becomes what a settled step holds
    assert heap.after_update() == 1200.0
    process.freed = 90
    assert heap.after_update() == 1290.0 and process.trims == 1
    assert heap.trims == 1


def test_what_the_heaviest_step_leaves_is_not_what_a_settled_step_holds():
    """The epoch's heaviest step follows a trim and leaves its large blocks freed; settled on it, the slack would let
    later epochs hold that much freed memory between ordinary steps, more than the first epoch's peak."""
    process = FakeProcess(live=1000)
    heap = Heap(enabled=True, resident=process.resident, trim=process.trim)
    heap.after_update()  # settles at 1000
    process.freed = 100
    heap.after_update()  # trimmed: the next step would settle
    heap.before_step(64, heaviest=True)
    process.freed = 500  # what the heaviest batch freed
    assert heap.after_update() == 1500.0 and process.trims == 2
    heap.end_epoch(1)
    assert heap.after_update() == 1000.0  # the next epoch's first step: settles where ordinary steps are
    process.freed = 150  # 15% over an ordinary step
    assert heap.after_update() == 1000.0 and process.trims == 4


def test_a_step_larger_than_any_before_it_in_the_epoch_starts_on_a_trimmed_heap():
    """Its blocks are larger than any the heap holds: on a full heap they are new memory on top of it, and a later
    epoch that meets its largest batches on a full heap peaks higher than the first."""
    process = FakeProcess(live=1000)
    heap = Heap(enabled=True, resident=process.resident, trim=process.trim)
    heap.before_step(100)  # the epoch's first step follows the last epoch's trim: nothing to hand back
    process.freed = 50
    heap.after_update()
    assert process.trims == 0 and heap.settled == 0  # the largest so far: no measure of an ordinary step
    heap.before_step(80)  # smaller than one before it: the heap's blocks fit it
    heap.after_update()
    assert process.trims == 0 and heap.settled == 1050 * MB
    heap.before_step(120)  # the largest so far
    assert process.trims == 1
    process.freed = 70
    heap.after_update()
    heap.before_step(110)
    assert process.trims == 1
    heap.end_epoch(1)  # trims; the next epoch counts its largest afresh
    heap.before_step(90)
    assert process.trims == 2
    heap.after_update()
    heap.before_step(95)
    assert process.trims == 3
    heap.before_step(150, heaviest=True)
    assert process.trims == 4


def test_after_the_first_epoch_no_step_holds_more_than_the_first_epochs_did():
    """A step peaks at what it starts with plus what it allocates: a later epoch whose steps start holding more freed
    memory than the first epoch's ever did would peak higher, though within the slack of a settled step."""
    process = FakeProcess(live=1000)
    heap = Heap(enabled=True, resident=process.resident, trim=process.trim)
    heap.after_update()  # settles at 1000
    process.freed = 40
    assert heap.after_update() == 1040.0  # the most an ordinary step of epoch 1 holds
    heap.before_step(64, heaviest=True)
    process.freed = 300
    heap.after_update()  # the heaviest step's freed blocks: not an ordinary step's
    heap.end_epoch(1)
    heap.after_update()  # epoch 2 settles at 1000 again
    process.freed = 60  # 6%: within a settled step's slack, and within 2% of epoch 1's 1,040
    assert heap.after_update() == 1060.0 and process.trims == 2
    process.freed = 70  # 1,070: more than 2% over what any ordinary step of epoch 1 held
    assert heap.after_update() == 1000.0 and process.trims == 3


def test_trimmed_after_every_update_each_step_starts_with_no_freed_memory():
    process = FakeProcess(live=1000)
    heap = Heap(enabled=True, resident=process.resident, trim=process.trim, every_step=True)
    for step in range(1, 5):
        process.freed = 30  # 3%: within the slack, handed back all the same
        assert heap.after_update() == 1000.0 and process.trims == step


def test_without_glibc_nothing_is_trimmed():
    process = FakeProcess(live=1000)
    heap = Heap(enabled=False, resident=process.resident, trim=process.trim)
    heap.after_update()
    process.freed = 500
    assert heap.after_update() == 1500.0 and process.trims == 0


def test_an_epoch_that_holds_a_quarter_more_than_the_last_is_warned_of():
    process = FakeProcess(live=1000)
    heap = Heap(enabled=False, resident=process.resident, trim=process.trim)
    heap.after_update()
    assert heap.end_epoch(1) is None
    process.live = 1240
    heap.after_update()
    assert heap.end_epoch(2) is None  # 24% more
    process.live = 1560
    heap.after_update()
    assert heap.end_epoch(3) == ("memory grew from 1240 MB in epoch 2 to 1560 MB in epoch 3, which saw the same rows: "
                                 "something keeps memory from one step to the next (please report it with this run's "
                                 "metrics.jsonl)")


def widths_by_epoch(tmp_path, monkeypatch, precision: str) -> dict[int, set]:
    """The widths of the batches a tiny Llama trains on in each epoch of a 4-epoch run (``precision``) on rows of
    every length, reshuffled each epoch."""
    import random

    from transformers import LlamaConfig, LlamaForCausalLM

    from qatune.config import load_config
    from qatune.data import generative
    from qatune.train import loop, prepare
    from qatune.train.loop import fit
    from tests.conftest import chat_tokenizer

    tmp_path.mkdir()
    rng = random.Random(0)
    words = "the river city north south bridge castle king queen year war people music art".split()
    rows = [(" ".join(rng.choice(words) for _ in range(rng.randint(4, 900))) + "?", rng.choice(words))
            for _ in range(96)]
    (tmp_path / "rows.csv").write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in rows), encoding="utf-8")
    tokenizer = chat_tokenizer([f"{q} {a}" for q, a in rows])
    folder = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                 tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = load_config(None, [f"data.train_file={tmp_path / 'rows.csv'}", f"model.name_or_path={folder}",
                                "data.prompt_template=Q: {question}\nA:", "data.max_length=1024", "train.epochs=4",
                                "train.batch_size=4", f"train.precision={precision}", "train.learning_rate=1e-3",
                                "train.group_by_length=false"])  # new batches, new widths, every epoch
    seen: dict[int, set] = {}
    epoch = [None]  # set when training starts: the start-up checks' batches before it are not counted
    start, width_of = loop.Loop.start_epoch, generative.batch_width

    def started(self, number):
        epoch[0] = number
        start(self, number)

    def recorded(*args, **kwargs):
        width = width_of(*args, **kwargs)
        if epoch[0] is not None:
            seen.setdefault(epoch[0], set()).add(width)
        return width

    monkeypatch.setattr(loop.Loop, "start_epoch", started)
    monkeypatch.setattr(generative, "batch_width", recorded)
    fit(prepare(config), None, progress=False)
    return seen


def test_the_warning_goes_to_metrics_jsonl_as_an_event():
    process, written = FakeProcess(live=1000), []
    heap = Heap(enabled=False, resident=process.resident, trim=process.trim)
    heap.after_update()
    heap.end_epoch(1, step=10, metrics_log=type("Log", (), {"write": staticmethod(written.append)}))
    process.live = 1300
    heap.after_update()
    grown = heap.end_epoch(2, step=20, metrics_log=type("Log", (), {"write": staticmethod(written.append)}))
    assert written == [{"event": "memory_warning", "step": 20, "epoch": 2, "message": grown}]


def test_bf16_training_on_a_cpu_meets_few_widths_whatever_its_rows(tmp_path, monkeypatch):
    """Under bf16 on a CPU oneDNN keeps memory for every matrix shape it meets (a few MB each for SmolLM2's), so memory
    climbed as long as batches met new widths: rows of every length met a new one at almost every step of every
    epoch. Under bf16 batches are padded to one of eight widths an octave (at most an eighth longer): the widths a run
    meets are bounded by its rows' range, not by its steps; fp32, which keeps nothing per shape, pads to the longest
    row."""
    from qatune.data.padding import bucket

    few = widths_by_epoch(tmp_path / "bf16", monkeypatch, "bf16")
    monkeypatch.undo()
    every = widths_by_epoch(tmp_path / "fp32", monkeypatch, "fp32")
    met, met_fp32 = set().union(*few.values()), set().union(*every.values())
    assert all(bucket(width) == width for width in met), [w for w in sorted(met) if bucket(w) != w]
    octaves = max(met).bit_length() - min(met).bit_length() + 1
    assert len(met) <= 8 * octaves
    assert len(met_fp32) > 2 * len(met), (sorted(met_fp32), sorted(met))  # a width of its own for most batches
    assert any(bucket(width) != width for width in met_fp32)


def test_freed_memory_is_handed_back_before_each_epochs_heaviest_batch(tmp_path, monkeypatch):
    """Every epoch ends with its heaviest batch (train/sampler.py), when the steps before it have built what later
    steps keep; the heap is trimmed just before it, so its blocks do not stack on the holes earlier widths left."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatune.config import load_config
    from qatune.train import heap, loop, prepare
    from qatune.train.loop import fit
    from tests.conftest import chat_tokenizer

    rows = [(" ".join(["word"] * (4 + (7 * i) % 40)) + "?", "yes") for i in range(22)]
    (tmp_path / "rows.csv").write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in rows), encoding="utf-8")
    tokenizer = chat_tokenizer([f"{q} {a}" for q, a in rows])
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                 pad_token_id=tokenizer.pad_token_id)).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    config = load_config(None, [f"data.train_file={tmp_path / 'rows.csv'}", f"model.name_or_path={tmp_path / 'llama'}",
                                "data.prompt_template=Q: {question}\nA:", "train.epochs=3", "train.batch_size=4",
                                "train.gradient_accumulation_steps=2"])  # 6 batches: 3 updates an epoch
    trimmed_at, trained, step = [], [], loop.train_step
    before_step = heap.Heap.before_step

    def before(self, tokens, heaviest=False):
        if heaviest:
            trimmed_at.append(len(trained))
        before_step(self, tokens, heaviest)

    monkeypatch.setattr(heap.Heap, "before_step", before)
    monkeypatch.setattr(loop, "train_step", lambda lp, window: trained.append(window) or step(lp, window))
    fit(prepare(config), None, progress=False)
    assert len(trained) == 9 and trimmed_at == [2, 5, 8]  # before each epoch's last update
    widest = max(batch["input_ids"].shape[1] for window in trained for batch in window)
    for last in trained[2::3]:  # whose last batch is the epoch's heaviest: the two longest rows' batch
        assert last[-1]["input_ids"].shape[1] == widest


def test_the_loop_groups_micro_batches_into_windows_and_marks_the_epochs_last():
    from qatune.train.sampler import windows

    assert list(windows("abcde", 2)) == [(["a", "b"], False), (["c", "d"], False), (["e"], True)]
    assert list(windows("abcd", 2)) == [(["a", "b"], False), (["c", "d"], True)]
    assert list(windows("", 2)) == []
