"""qatune serve's batcher: waiting requests gathered into one batch that answers each as alone, a cancelled
request left out, a failing batch failing its requests only (small random models, no training)."""

import threading

import torch

from qatune.serve.batching import Batcher, Delta, Generation, Job
from qatune.serve.decoding import Sampling
from tests.unit.serve.random_models import PROMPTS, id_tokenizer, random_gpt2


class Loaded:
    """What Batcher reads of a LoadedModel."""

    def __init__(self, model, tokenizer):
        from qatune.config import Config
        from qatune.model.folder import ModelInfo

        self.model, self.tokenizer, self.config = model, tokenizer, Config()
        self.info = ModelInfo(task="generative", max_length=64)


def answer_through_batcher(max_batch_size, prompts, wait_ms=200.0):
    model = random_gpt2()
    batcher = Batcher(Loaded(model, id_tokenizer(model)), max_batch_size=max_batch_size, wait_ms=wait_ms)
    finished = {}
    all_done = threading.Event()

    def notify_for(i):
        def notify(event):
            if not isinstance(event, Delta):
                finished[i] = event
                if len(finished) == len(prompts):
                    all_done.set()
        return notify

    batcher.start()
    for i, prompt in enumerate(prompts):
        batcher.submit(Job(Generation(prompt, Sampling(max_tokens=10)), notify_for(i)))
    assert all_done.wait(60)
    batcher.stop()
    return [finished[i].text for i in range(len(prompts))], batcher.stats


def test_the_batcher_gathers_waiting_jobs_into_one_batch_and_answers_as_alone():
    batched, stats = answer_through_batcher(32, PROMPTS)
    assert stats.batches == 1 and stats.largest == len(PROMPTS) and stats.joined == 0
    alone, stats = answer_through_batcher(1, PROMPTS)
    assert stats.batches == len(PROMPTS) and stats.largest == 1
    assert batched == alone


def test_a_cancelled_job_leaves_the_batch_and_a_failing_batch_fails_its_jobs():
    class Broken(torch.nn.Module):
        config = random_gpt2().config

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **_):
            raise RuntimeError("boom")

    batcher = Batcher(Loaded(Broken(), id_tokenizer(Broken())), max_batch_size=4, wait_ms=50)
    got = []
    finished = threading.Event()
    batcher.start()
    cancelled = Job(Generation([5, 6], Sampling(max_tokens=4)), got.append, cancelled=True)
    batcher.submit(cancelled)
    batcher.submit(Job(Generation([5, 6], Sampling(max_tokens=4)), lambda e: (got.append(e), finished.set())))
    assert finished.wait(30)
    batcher.stop()
    assert len(got) == 1 and "RuntimeError" in got[0].message  # only the live job heard of it
    assert batcher.stats.largest == 1
