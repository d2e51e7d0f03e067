"""Published training runs: the validation set of the cost model (issue 14).

Every row is one run someone else measured and published: the model's configuration, the plan
it ran (tp/pp/dp/vpp/cp/sp/mb/gbs/recompute/zero/dtype), the cluster (device, count,
interconnect), the published figure (step time in seconds, TFLOP/s per GPU, or tokens/s per
GPU) and where it was published. Figures are copied from their source, never derived from a
second source's formula; a run whose figure or plan we could not source is not here.

Rules of the set:
- `calibration` rows fix the one sustained-efficiency figure per device type
  (`DeviceSpec.matmul_efficiency` in `shardc.hardware`); every other row is a check the model
  was not tuned on. At most one figure per device, fitted on the named rows together, never
  per row (`published_runs.py --fit DEVICE`).
- Kept aside on purpose (an independent check for later, never added here): further rows of
  Narayanan et al.'s weak-scaling table (Megatron-LM, their Table 1) beyond the four
  calibration rows, and Korthikanti et al.'s iteration times and memory figures.
- `runtime` says which framework's runtime the row ran, which sets the estimate's options
  (`published_runs.options_for`): `megatron` (Megatron-LM, NeMo: Megatron's 1F1B or interleaved
  schedule, no torch.distributed.pipelining buffers, textbook ZeRO-1 as the distributed
  optimizer), `deepspeed` (Megatron-DeepSpeed: DeepSpeed's PipelineEngine and its TrainSchedule
  with blocking exchanges, `shardc.cost.lockstep`) or `torchtitan` (FSDP2).
- Every row's plan is the run's own configuration as its launch script or paper states it
  (micro-batch size, virtual stages, data-parallel implementation), cited in `source`.
"""

from __future__ import annotations

from dataclasses import dataclass

METRICS = ("step_s", "tflops", "tokens_per_gpu_s")
RUNTIMES = ("megatron", "deepspeed", "torchtitan")


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One published run. `model`: `examples/gpt.py` or `examples/llama.py` factory arguments
    (query string without batch); `plan`: a `ParallelPlan` string; `gpus` on `device` (a
    preset name), 8 per node; `inter_gbps`: the per-GPU inter-node bandwidth in GB/s (one
    direction) when the cluster's fabric is not the preset's; `metric` in `METRICS`."""

    name: str
    model: str
    seq: int
    plan: str
    device: str
    gpus: int
    interconnect: str
    metric: str
    published: float
    source: str
    runtime: str = "megatron"
    calibration: bool = False
    gradient_reduce: str = "fp32"
    inter_gbps: float | None = None
    note: str = ""
    # What the run enabled that the estimate prices (`published_runs.options_for`), each with
    # its source in `overlap_source`: tensor-parallel collectives overlapped with the GEMMs
    # (Transformer Engine userbuffers, NeMo's `ub_tp_comm_overlap`).
    tp_comm_overlap: bool = False
    overlap_source: str = ""
    # False: gradients reduced over data parallelism only once backward is over (exposed).
    overlap_grad_reduce: bool = True
    # DeepSpeed's bf16 path, as its BF16_Optimizer runs it (bf16 with DeepSpeed's ZeRO stage 0, its
    # own ZeRO-1): every micro-batch's bf16 gradients added into fp32 ones after its backward, the
    # fp32 gradients all-reduced after the last (`EstimateOptions.fp32_grad_accumulation`,
    # `zero_gradient_collective`). BLOOM ran that optimizer; MT-NLG's 2021 bf16 code was never
    # released and is priced as that, the first public form of it (see its rows).
    bf16_optimizer: bool = False
    # The framework fuses the elementwise work between GEMMs as compiled pricing describes
    # (`compile=1`): Transformer Engine's fused layers (NeMo). Megatron-LM 2021 and
    # Megatron-DeepSpeed fused a few kernels (bias-GeLU, scale-mask-softmax, bias-dropout-add)
    # and ran the rest per op: priced eager, which fits Megatron-LM's own four runs within 6%
    # where compiled pricing spreads them from -8% to +15% (README).
    fused_kernels: bool = False

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"{self.name}: metric {self.metric!r} is not one of {METRICS}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"{self.name}: runtime {self.runtime!r} is not one of {RUNTIMES}")
        if self.tp_comm_overlap and not self.overlap_source:
            raise ValueError(f"{self.name}: tp_comm_overlap needs the configuration that enabled it (overlap_source)")


def _gpt(layers: int, hidden: int, heads: int, vocab: int, *, tie: bool = False, flash: bool = False) -> str:
    return (f"examples/gpt.py:gpt?n_layer={layers}&n_embd={hidden}&n_head={heads}&vocab_size={vocab}"
            f"&dropout=0.1&tie={'true' if tie else 'false'}" + ("&flash=true" if flash else ""))


def _llama(layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int = 128256) -> str:
    return (f"examples/llama.py:llama?n_layer={layers}&dim={dim}&n_head={heads}&n_kv_head={kv_heads}"
            f"&ffn_hidden={ffn}&vocab_size={vocab}")


_NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
              "Using Megatron-LM (SC'21), Table 1")
# The runs' own launch configuration: the paper's scripts (Megatron-LM commit 6985e58, whose
# defaults scatter/gather pipeline tensors and reduce fp16 gradients in fp16); sec. 5.1: "we use the
# interleaved pipeline schedule with the scatter/gather optimization enabled".
_SC21 = "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh"
_DGXC = "NVIDIA/dgxc-benchmarking"
_SELENE = "DGX A100 SuperPOD: NVLink3 + 8x HDR 200 Gb/s InfiniBand per node"
_DGX_H100 = "DGX H100: NVLink4 + 8x NDR 400 Gb/s InfiniBand per node"
_LAUNCHER = "NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/"
# NeMo's GPT-3 and Llama 3.1 training configurations turn on Transformer Engine's userbuffers
# TP overlap (`ub_tp_comm_overlap: True`, with `overlap_p2p_comm`, `overlap_grad_sync` and
# `overlap_param_sync`); the 405B benchmark overrides its `ub_tp_comm_overlap_cfg`.
_UB_GPT3 = _LAUNCHER + "gpt3/175b.yaml (ub_tp_comm_overlap: True)"
_UB_70B = _LAUNCHER + "llama/llama3_1_70b.yaml (ub_tp_comm_overlap: true, tp_overlap ub_cfg_h100_h8192_tp4_mbs1_seqlen8192)"
_UB_405B = (f"{_DGXC} llama3.1/configure.sh (405b: model.ub_tp_comm_overlap_cfg.proj_fprop/fc2_fprop overrides "
            "of the run's userbuffers TP-overlap configuration)")
# torchtitan's A100 page names the GPUs only: the preset's node (NVLink3, 8x HDR 200 Gb/s) is assumed.
_TITAN_A100 = "8 A100-80GB per node; fabric not stated (preset DGX A100 assumed)"

ROWS: tuple[PublishedRun, ...] = (
    # Gradient reduction after backward (overlap_grad_reduce=False) in the 2021-22 runtimes:
    # Megatron-LM's local DDP all-reduces its gradient buffer once forward_backward_func returns
    # (megatron/training.py `train_step`, v2.x), and DeepSpeed's pipeline engine runs ReduceGrads
    # after the last BackwardPass (deepspeed/runtime/pipe/schedule.py `TrainSchedule`, used by
    # Megatron-DeepSpeed for BLOOM and MT-NLG). NeMo overlaps it (`overlap_grad_sync: True` in
    # the launcher configurations cited below); torchtitan's FSDP reduces per block in backward.
    # --- A100: calibration (Megatron-LM, fp16 with fp16 gradient all-reduce, as the paper ran).
    # Plans from the paper's launch script (`_SC21`): micro-batch sizes 16 and 8 where pp=1, torch
    # DDP there (its buckets all-reduced during the last backward); local DDP (after backward) and
    # 5 layers per virtual stage (vpp=2) for 145.6B; mb=1 without virtual stages for 1008B.
    PublishedRun("Megatron-LM 1.7B", _gpt(24, 2304, 24, 51200), 2048,
                 "dp=32,mb=16,gbs=512,recompute=full,dtype=fp16", "A100-80GB", 32, _SELENE,
                 "tflops", 137.0, f"{_NARAYANAN}; plan: {_SC21} (1.7B: MBS=16, DDP=torch)", calibration=True,
                 gradient_reduce="compute"),
    PublishedRun("Megatron-LM 18.4B", _gpt(40, 6144, 48, 51200), 2048,
                 "dp=32,tp=8,mb=8,gbs=1024,recompute=full,dtype=fp16", "A100-80GB", 256, _SELENE,
                 "tflops", 135.0, f"{_NARAYANAN}; plan: {_SC21} (18B: MBS=8, DDP=torch)", calibration=True,
                 gradient_reduce="compute"),
    PublishedRun("Megatron-LM 145.6B", _gpt(80, 12288, 96, 51200), 2048,
                 "dp=24,tp=8,pp=8,vpp=2,mb=2,gbs=2304,recompute=full,dtype=fp16", "A100-80GB", 1536, _SELENE,
                 "tflops", 148.0, f"{_NARAYANAN}; plan: {_SC21} (145B: MBS=2, DDP=local, "
                 "--num-layers-per-virtual-pipeline-stage 5)", calibration=True, gradient_reduce="compute",
                 overlap_grad_reduce=False),
    PublishedRun("Megatron-LM 1008B", _gpt(128, 25600, 160, 51200), 2048,
                 "dp=6,tp=8,pp=64,mb=1,gbs=3072,recompute=full,dtype=fp16", "A100-80GB", 3072, _SELENE,
                 "tflops", 163.0, f"{_NARAYANAN}; plan: {_SC21} (1T: MBS=1, DDP=local, no virtual stages)",
                 calibration=True, gradient_reduce="compute", overlap_grad_reduce=False),
    # --- A100: checks
    # BLOOM: Megatron-DeepSpeed, bf16 with DeepSpeed's BF16_Optimizer (its ZeRO stage 0: "bf16
    # must use z0! it implements its own zero stage 1 equivalent"): under the pipeline engine it
    # adds every micro-batch's bf16 gradients into fp32 ones after that backward (DeepSpeed
    # 56c5223, bf16+pipeline parallelism, pipe/engine.py `_exec_backward_pass`: `update_hp_grads`),
    # all-reduces the fp32 gradients after the last (`_bf16_reduce_grads`), updates its shard and
    # all-gathers the weights; full activation checkpointing, tied 250880-token embedding, ALiBi
    # (traced as learned positions: the same matmuls); 'type:transformer|embedding' stage split
    # (5 blocks on the first and last stage, 6 on the others: apply-plan's). Jean Zay: 4x
    # Omni-Path 100 Gb/s per node of 8 GPUs.
    PublishedRun("BLOOM-176B", _gpt(70, 14336, 112, 250880, tie=True), 2048,
                 "dp=8,tp=4,pp=12,mb=2,gbs=2048,recompute=full,zero=1,dtype=bf16", "A100-80GB", 384,
                 "Jean Zay: NVLink + 4x Omni-Path 100 Gb/s per node", "step_s", 104.70,
                 "bigscience-workshop/bigscience train/tr11-176B-ml/README.md (\"Important checkpoints\": "
                 "iteration 85376, elapsed time per iteration 104.70 s, GBS 2048, 48 nodes; plan from "
                 "tr11-176B-ml.slurm: TP=4, PP=12, MBS=2, ZERO_STAGE=0 with bf16)",
                 runtime="deepspeed", inter_gbps=4 * 12.5 / 8, overlap_grad_reduce=False,
                 bf16_optimizer=True),
    # MT-NLG 530B: Megatron-DeepSpeed on Selene (DeepSpeed's PipelineEngine), tp=8 x pp=35,
    # gbs=1920, seq 2048, activation checkpointing, bf16 (sec. 2.3, 3.2); the paper's
    # per-iteration latencies at three node counts (sec. 2.4: their 126/121/113 TFLOP/s count the
    # recomputed forward, Narayanan et al.'s formula). Not stated there: the optimizer's sharding
    # (textbook ZeRO-1 assumed) and the micro-batch size, read off sec. 2.4's three iteration times
    # instead: at a fixed batch a 1F1B step is c x (gbs/(dp mb) + p - 1) with c one micro-batch's
    # time on a stage, the same at every scale; only mb=2 makes c one figure (0.390, 0.386, 0.390 s
    # at dp 8, 10, 12; mb=1: 0.219, 0.222, 0.229; mb=4: 0.639, 0.612, 0.600). An inference from the
    # published times, independent of shardc's model and of its efficiency (README).
    # The runtime, as the sources give it (README, "MT-NLG"): Megatron-DeepSpeed's GPTModelPipe
    # ties the embedding and the LM head (`TiedLayerSpec('embed', ...)` on the first and last stage,
    # their gradients all-reduced by the pipe engine's ReduceTiedGrads); its stages split the
    # blocks evenly ('type:transformer': 3 per stage, the embedding on the first, the final norm,
    # head and loss on the last); DeepSpeed checkpoints only the transformer blocks of a
    # GPTModelPipe (deepspeed e2fdd25, 2021-09, `_is_checkpointable`: the head is not recomputed).
    # bf16 gradients: DeepSpeed's public 2021 pipeline engine had no mixed-precision bf16 path (bf16
    # without ZeRO ran the bare optimizer on bf16 weights; bf16 ZeRO-1 was not implemented, deepspeed
    # #1771, 2022-02); bf16 with pipeline parallelism arrived in deepspeed PR #1801, 2022-03, as
    # BF16_Optimizer: fp32 accumulation after every micro-batch, fp32 all-reduce. Both parents of
    # MT-NLG's stack required exactly that of
    # bf16 in 2021 (Megatron-LM b4bc51b "Bfloat with fp32 grad acc", 2021-03, and its arguments.py
    # since 50a4b5f, 2021-04: "bfloat16 requires gradient accumulation and all-reduce to be done in
    # fp32"; deepspeed issue #974, 2021-04: bf16 needs "gradient accumulation in fp32 instead of
    # fp16"). Priced as BF16_Optimizer runs it (`bf16_optimizer`): an inference, like mb=2, not a
    # statement of the paper.
    *(PublishedRun(f"MT-NLG 530B ({n} GPUs)", _gpt(105, 20480, 128, 50272, tie=True), 2048,
                   f"dp={n // 280},tp=8,pp=35,mb=2,gbs=1920,recompute=full,zero=1,dtype=bf16", "A100-80GB", n,
                   _SELENE, "step_s", t,
                   "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B "
                   "(arXiv 2201.11990), sec. 2.4: 60.1/50.2/44.4 s per iteration on 280/350/420 DGX A100 "
                   "(as quoted in cli99/llm-analysis examples/megatron-turing-nlg/README.md)",
                   runtime="deepspeed", overlap_grad_reduce=False, bf16_optimizer=True,
                   note="mb=2 is not stated in the paper: inferred from its three iteration times (sec. 2.4); "
                        "fp32 gradient accumulation per micro-batch (bf16_optimizer) inferred from its stack's "
                        "2021 bf16 requirement (Megatron-LM b4bc51b, deepspeed #974), not stated in the paper")
      for n, t in ((2240, 60.1), (2800, 50.2), (3360, 44.4))),
    # torchtitan: FSDP2 (ZeRO-3) over 64 A100-80GB, local batch 1, seq 8192. Its "selective op"
    # row (2973 WPS) is left out: that policy saves every second matmul's output and recomputes
    # the rest of the layer, which no shardc recomputation expresses (`selective` is the
    # attention core, absent from a fused sdpa node).
    # "selective layer" checkpoints every second block (torchtitan 1ea476e, the page's commit:
    # torchtitan/config_manager.py `selective_ac_option` default "2", every 2nd layer): 16 of
    # the 32 blocks recomputed in full, what recompute_layers=16 prices.
    PublishedRun("torchtitan Llama 3 8B (selective layer AC)", _llama(32, 4096, 32, 8, 14336), 8192,
                 "dp=64,mb=1,gbs=64,recompute=full,recompute_layers=16,zero=3,dtype=bf16", "A100-80GB", 64,
                 _TITAN_A100, "tokens_per_gpu_s", 2904.0,
                 "pytorch/torchtitan docs/performance.md (\"Llama 3 performance numbers\", 64 A100: "
                 "8B, batch 1, selective layer, WPS 2904)", runtime="torchtitan"),
    PublishedRun("torchtitan Llama 3 70B (full AC)", _llama(80, 8192, 64, 8, 28672), 8192,
                 "dp=64,mb=1,gbs=64,recompute=full,zero=3,dtype=bf16", "A100-80GB", 64,
                 _TITAN_A100, "tokens_per_gpu_s", 331.0,
                 "pytorch/torchtitan docs/performance.md (\"Llama 3 performance numbers\", 64 A100: "
                 "70B, batch 1, full, WPS 331)", runtime="torchtitan"),
    # The same page's Llama 2 table (first published at torchtitan 395a526, the same FSDP2 set-up:
    # per-block fully_shard, bf16 parameters, fp32 reduce-scatter, `selective_ac_option` "2"):
    # local batch 2, seq 4096, vocabulary 32000; 13B's FFN 13824 (4h*2/3 rounded up to 256), 70B's
    # 28672 (x1.3, rounded up to 4096), as torchtitan/models/llama/__init__.py sizes them. Its
    # "selective op" rows are left out as above; the 70B "selective layer" runs were OOM.
    *(PublishedRun(f"torchtitan Llama 2 {name}", model, 4096, plan, "A100-80GB", 64, _TITAN_A100,
                   "tokens_per_gpu_s", wps,
                   "pytorch/torchtitan docs/performance.md (\"Llama 2 performance numbers\", 64 A100: "
                   f"{label}, WPS {wps:g})", runtime="torchtitan")
      for name, model, plan, wps, label in (
          ("13B (no AC)", _llama(40, 5120, 40, 40, 13824, 32000), "dp=64,mb=2,gbs=128,zero=3,dtype=bf16",
           2162.0, "13B, batch 2, no AC"),
          ("13B (selective layer AC)", _llama(40, 5120, 40, 40, 13824, 32000),
           "dp=64,mb=2,gbs=128,recompute=full,recompute_layers=20,zero=3,dtype=bf16", 1914.0,
           "13B, batch 2, selective layer"),
          ("70B (full AC)", _llama(80, 8192, 64, 8, 28672, 32000),
           "dp=64,mb=2,gbs=128,recompute=full,zero=3,dtype=bf16", 353.0, "70B, batch 2, full"))),
    # --- H100: NeMo 24.09 (Megatron-Core, Transformer Engine), BF16, sequence parallelism and
    # the distributed optimizer on, as NeMo's recipes run; no activation recomputation.
    PublishedRun("NeMo GPT-3 175B (128 GPUs)", _gpt(96, 12288, 96, 51200, flash=True), 2048,
                 "dp=4,tp=4,pp=8,vpp=12,sp=1,mb=1,gbs=256,zero=1,dtype=bf16", "H100-SXM", 128, _DGX_H100,
                 "step_s", 8.309, f"{_DGXC} nemo_megatron/README_175b.md (BF16, TP=4, PP=8, VP=12, MBS=1, "
                 "128x H100, GBS=256: 8.309 s per step)", calibration=True,
                 tp_comm_overlap=True, fused_kernels=True, overlap_source=_UB_GPT3),
    PublishedRun("NeMo GPT-3 175B (2048 GPUs)", _gpt(96, 12288, 96, 51200, flash=True), 2048,
                 "dp=64,tp=4,pp=8,vpp=12,sp=1,mb=1,gbs=4096,zero=1,dtype=bf16", "H100-SXM", 2048, _DGX_H100,
                 "step_s", 8.49, f"{_DGXC} nemo_megatron/README_175b.md (BF16, 2048x H100, GBS=4096: "
                 "8.49 s per step)", tp_comm_overlap=True, fused_kernels=True, overlap_source=_UB_GPT3),
    PublishedRun("NeMo Llama 3.1 8B (8 GPUs)", _llama(32, 4096, 32, 8, 14336), 8192,
                 "dp=4,cp=2,mb=1,gbs=128,zero=1,dtype=bf16", "H100-SXM", 8, _DGX_H100,
                 "step_s", 12.91, f"{_DGXC} llama3.1/README_8b.md (24.09 BF16, TP=1, PP=1, CP=2, MBS=1, "
                 "GA=32, 8x H100, GBS=128: 12.91 s per step)", fused_kernels=True),
    PublishedRun("NeMo Llama 3.1 70B (64 GPUs)", _llama(80, 8192, 64, 8, 28672), 8192,
                 "dp=2,tp=4,pp=4,vpp=5,cp=2,sp=1,mb=1,gbs=128,zero=1,dtype=bf16", "H100-SXM", 64, _DGX_H100,
                 "step_s", 14.72, f"{_DGXC} llama3.1/README_70b.md (24.09 BF16, TP=4, PP=4, CP=2, VP=5, "
                 "MBS=1, GA=64, 64x H100, GBS=128: 14.72 s per step)",
                 tp_comm_overlap=True, fused_kernels=True, overlap_source=_UB_70B),
    PublishedRun("NeMo Llama 3.1 405B (576 GPUs)", _llama(126, 16384, 128, 8, 53248), 8192,
                 "dp=4,tp=8,pp=9,vpp=7,cp=2,sp=1,mb=1,gbs=252,zero=1,dtype=bf16", "H100-SXM", 576, _DGX_H100,
                 "step_s", 17.20, f"{_DGXC} llama3.1/README_405b.md (24.09 BF16, TP=8, PP=9, CP=2, VP=7, "
                 "MBS=1, GA=63, 576x H100, GBS=252: 17.20 s per step)",
                 tp_comm_overlap=True, fused_kernels=True, overlap_source=_UB_405B,
                 note="the recipe trains on synthetic data with a GPT-2 tokenizer as a proxy; the 128256 "
                      "vocabulary of its own model-FLOPs formula is kept (the LM head is 0.5% of the FLOPs)"),
)


def calibration_rows(device: str) -> list[PublishedRun]:
    """The rows `device`'s sustained efficiency is fitted on."""
    return [r for r in ROWS if r.calibration and r.device == device]


def check_rows() -> list[PublishedRun]:
    """The rows the model was not tuned on."""
    return [r for r in ROWS if not r.calibration]
