"""The plan keys `mb` and `gbs` set explicitly, trained on 2 gloo processes against one process.

Rule checked: a plan's micro-batch size `mb` and global batch `gbs` cut each step's batch into
gbs / (dp * mb) micro-batches per data-parallel rank, whose gradients accumulate before the
optimizer step, so 3 AdamW steps give the losses and parameters of one process training on the
whole batch (1e-5 relative; the helpers of test_pipeline_numerics / test_backend_numerics).
"""

from __future__ import annotations

from test_backend_numerics import GPT, LLAMA
from test_pipeline_numerics import run_and_check


def test_explicit_micro_batch_and_global_batch_accumulate_like_one_process() -> None:
    run_and_check(2, [
        (GPT, "dp=2,mb=1,gbs=4"),          # 2 micro-batches of 1 sequence per data-parallel rank
        (LLAMA, "tp=2,mb=2,gbs=4"),        # 2 micro-batches of 2 sequences on both tensor-parallel ranks
    ])
