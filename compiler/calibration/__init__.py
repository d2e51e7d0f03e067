"""Calibration: this machine and its GPUs measured, bottom up.

`profile` (the local profile's data and file; it sits below `shardc.hardware`, which makes the
`local` cluster from it), `fit` (the one least-squares fit), `speed` (the speed probe every CPU
figure is taken beside), `timing` (CPU-time medians and the single-process benchmarks), `ops`
(eager op and optimizer costs), `gloo` (N processes at once: concurrent rates, collectives),
`local` (the `shardc calibrate` driver on top), and `gpu` with `gpu_markdown` (GPU matmuls
against a preset's efficiency curve).
"""
