"""LoRA layers' adapter product added inside the base layer's matrix product (qatune.speedups.lora) against
peft's own forward (base, adapter product, its scaled copy and their sum as separate full-size tensors),
per training step of W2 (SmolLM2-135M-Instruct, LoRA r=16 on all seven projections of its 30 layers) inside
qatune's own loop.

One process, one model, set up as `qatune train` sets it up for W2 (bench/w2_smollm2_lora.py's config). Every
batch of the first ``--rows`` rows is trained twice, alternating which goes first: once with the one-pass
forward, once with peft's. Prints the summed step times of both and their ratio per pass over the batches,
and their median; and, from the first batch after one update (peft starts the adapters' B at zero), the
summed loss and the largest gradient difference both ways.
In fp32 by default; ``--precision bf16`` on a CPU with native bf16 (bf16 weights under bf16 autocast, where
the one-pass forward is taken too: autocast casts nothing there) writes lean_lora_bf16.json's figures.

    python bench/lean_lora.py               # 3 passes over 6 batches, ~12 minutes on 2 cores in fp32
    python bench/lean_lora.py --rows 96 --passes 2
    python bench/lean_lora.py --precision bf16 --json bench/lean_lora_bf16.json
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_machine import per_batch_options, timed_passes, write_json


def main() -> int:
    import w2_smollm2_lora as w2

    from qatune.model.objectives import model_inputs
    from qatune.speedups import lora as lean_lora
    from qatune.train.loop import train_step

    args, info = per_batch_options(__doc__, __file__, more=lambda parser: parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32"))
    prepared, loop = w2.qatune_loop(args.rows, f"train.precision={args.precision}", groups=False)
    model = prepared.model
    layers = lean_lora.install(model)
    print(f"loss: {loop.objective.describe()}; {layers} LoRA layers", flush=True)
    loop.start_epoch(0)
    batches = list(loop.loader)
    arms = [("one pass", lambda b: (lean_lora.install(model), b)[1]),
            ("peft", lambda b: (lean_lora.remove(model), b)[1])]
    train_step(loop, [batches[-1]])  # one update first: LoRA's B starts at zero, where A's gradient is zero too
    first = {}
    for name, shape in arms:
        batch = shape(batches[0])
        # The model's own gradients too: under bf16 the optimizer holds fp32 masters, not these parameters.
        loop.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        loss = loop.objective(**model_inputs(batch))["loss_sum"]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        first[name] = (float(loss.detach()), grads)
    loop.optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    gap = max(float((g - first["peft"][1][n]).abs().max()) for n, g in first["one pass"][1].items())
    scale = max(float(g.abs().max()) for g in first["peft"][1].values())
    losses = {name: value[0] for name, value in first.items()}
    print(f"first batch, summed loss: one pass {losses['one pass']:.6f}, peft {losses['peft']:.6f}; largest "
          f"gradient difference {gap:.2e} (largest gradient {scale:.2e})", flush=True)
    passes, median, per_pass = timed_passes(batches, arms, lambda b: train_step(loop, [b]), args.passes)
    tokens = sum(len(item) for item in prepared.dataset.items)
    print(f"\nsteps with the one-pass LoRA product are x{median:.3f} faster (median of {per_pass}); precision "
          f"{prepared.precision}, {len(batches)} batches, {tokens} tokens")
    write_json(args.json, {"machine": info, "loss": loop.objective.describe(), "lora_layers": layers,
                           "rows": args.rows, "precision": prepared.precision, "batches": len(batches),
                           "tokens": tokens, "first_batch_loss_sum": losses, "first_batch_largest_grad_gap": gap,
                           "first_batch_largest_grad": scale, "passes": passes, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
