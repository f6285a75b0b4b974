"""Every path that exists only to make a training step faster, behind one switch: ``train.speedups``.

Each path gives the model's own loss and gradients (to rounding) with less work, and is used for a model only
after a check on a tiny batch has reproduced the model's own outputs with it. ``train.speedups: off`` trains
through the model's own forward with nothing patched; ``auto`` (the default) turns on what was measured to
help where the run trains (:func:`qatune.speedups.switch.auto_verdict`); a list names the paths to use.

    switch.py          the switch: PATHS, Speedups (what the loop calls), the evaluation loss
    causal.py          a causal LM's loss on what it reads: last_column, supervised_head, shared_prefix,
                       prefix_groups, last_layer_rows, unpadded_rows
    gpt2.py            gpt2_supervised_rows: GPT-2's own version of the above
    prefixes.py        which prompt prefixes a batch's rows share (planned on the host, per batch)
    fused_lora.py      lora_one_pass            attention.py       attention_by_width
    master_weights.py  bf16_master_weights      shapes.py          width_rounding, the head's rows
    activations.py     fused_gelu               malloc_reuse.py    malloc_reuse
    clipping.py        folded_clipping          checks.py          what the checks share
"""

from qatune.speedups.switch import NAMES, PATHS, Speedups, auto_verdict, evaluation_loss, for_inference

__all__ = ["NAMES", "PATHS", "Speedups", "auto_verdict", "evaluation_loss", "for_inference"]
