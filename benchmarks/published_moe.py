"""Published Mixture-of-Experts training runs, predicted (issue 15): the rows and their errors.

    .venv/bin/python benchmarks/published_moe.py [--only TEXT] [--markdown] [--sources]

(`benchmarks/published_runs.py` prints this table after the dense one; the README states its
errors and `tests/test_published_moe.py` holds them.) Every row is one MoE run
someone else measured and published: the model (a transformers `hf:` spec at the published
sizes, built on the meta device), the plan it ran, the cluster, the published figure and where it
was published. As for the dense rows (`published_data.py`), figures are copied from their source
and none of these rows is used for calibration: the devices keep the one efficiency fitted on the
dense calibration rows.

How a Megatron plan maps onto shardc's: shardc's `ep` axis sits inside `dp` and every op but the
experts splits each micro-batch over it, so Megatron's data-parallel size D with expert-parallel
size E (E dividing D, experts not folded onto tp) is `dp=D/E, ep=E`, and its per-rank micro-batch
MBS is `mb=MBS*E` (one micro-batch of the ep group). Under tp the experts run expert tensor
parallelism (each expert's intermediate dim split over tp, Megatron's default ETP = TP), and the
tokens reach them as Megatron-Core's alltoall dispatcher moves them
(`EstimateOptions.expert_dispatch="megatron"`, `shardc.cost.moe`): each tp rank dispatches its
own sequence-parallel share over ep, the received rows are all-gathered over tp, the results
reduce-scattered over tp and sent back; not as the torch backend does (every tp rank
dispatching the tp group's tokens: tp times the all-to-all volume). Megatron-Core's distributed
optimizer is textbook ZeRO-1 (`zero_runtime="zero"`): fp32 master weights and Adam's moments
sharded, gradients held in the dtype they are reduced in, dense weights sharded over the whole
data-parallel group (ep included), expert weights over their expert-data-parallel group.

Runs left out, and why (each was read from its source):
- DeepSeek-V3 671B on 512/1024 H100 (NVIDIA/dgxc-benchmarking deepseek_v3/pretraining, 48.9 /
  52.0 s per step): it runs EP=64 folded over TP x DP (Megatron's MoE parallel folding, ETP=1),
  which shardc's `ep` inside `dp` cannot express (ep=32 at most: the same expert FLOPs per rank,
  twice the expert weights), NeMo's performance script puts 64/PP - 1 layers on the first stage and
  64/PP - 2 on the last (shardc's even split differs) and adds a token-drop callback whose capacity
  the README does not state; too many guesses for a check.
- Megatron-Bridge's H100 MoE rows (Qwen3 30B-A3B, Qwen3 235B-A22B, DeepSeek-V3) run FP8, which
  shardc does not price; its one BF16 H100 MoE row is GPT-OSS 120B, whose experts (biases,
  clamped SwiGLU) transformers does not build with the 3-D expert block shardc captures.
- Mixtral 8x22B: Megatron-Core's README gives its reference mapping but no throughput.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_data import PublishedRun  # noqa: E402
from published_runs import Prediction  # noqa: E402
from tables import show

from shardc.cost import estimate
from shardc.cost.compose import EstimateOptions
from shardc.cost.moe import default_routing_skew
from shardc.frontend import trace
from shardc.frontend.spec import load_model
from shardc.hardware import Cluster, make_cluster
from shardc.ir import Graph, Layer
from shardc.passes.apply_plan import apply_plan
from shardc.passes.group_layers import group_layers, layer_of_path
from shardc.plan.parallel import ParallelPlan

METRICS = ("step_s", "tflops")


@dataclass(frozen=True, slots=True)
class MegatronFlops:
    """What Megatron-Core counts as one sequence's model FLOPs (`num_floating_point_operations`
    in megatron/training/training.py, v0.8; Narayanan et al. 2021, appendix): 3 passes x 2 GEMMs
    x 2 FLOPs per multiply-add, attention over the full s x s, the MLP at top-k experts with
    SwiGLU's 3/2, the LM head; no router, no recomputation."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    top_k: int
    vocab: int
    head_dim: int

    def per_sequence(self, seq: int) -> float:
        q_ratio = self.head_dim * self.heads / self.hidden
        attention = (1 + self.kv_heads / self.heads + seq / self.hidden) * q_ratio
        mlp = self.ffn / self.hidden * self.top_k * 1.5
        logit = self.vocab / (2 * self.layers * self.hidden)
        return 12.0 * seq * self.layers * self.hidden ** 2 * (attention + mlp + logit)


@dataclass(frozen=True, slots=True)
class MoeRun(PublishedRun):
    """One published MoE run: a dense row's fields (`published_data.PublishedRun`; `model` here an
    `hf:` spec without seq/batch, `plan` with `ep`, `runtime` Megatron's) and the MoE ones:
    `routing_skew`, the skew the run had when its source says (`skew_source`), else None for the
    measured default (`shardc.cost.moe.default_routing_skew`); `flops`, the publisher's FLOP
    count, which a `tflops` figure is divided by (the dense rows take shardc's own count)."""

    routing_skew: float | None = None
    skew_source: str = ""
    flops: MegatronFlops | None = None

    def __post_init__(self) -> None:
        PublishedRun.__post_init__(self)
        if self.metric not in METRICS:
            raise ValueError(f"{self.name}: metric {self.metric!r} is not one of {METRICS}")
        if self.metric == "tflops" and self.flops is None:
            raise ValueError(f"{self.name}: a TFLOP/s figure needs the publisher's FLOP count (flops)")
        if self.routing_skew is not None and not self.skew_source:
            raise ValueError(f"{self.name}: routing_skew {self.routing_skew} needs the source that sets it (skew_source)")
        if self.calibration:
            raise ValueError(f"{self.name}: MoE rows are checks, never calibration")
        if self.runtime != "megatron":
            raise ValueError(f"{self.name}: runtime {self.runtime!r}: MoE rows price Megatron-Core's (megatron)")


def _mixtral(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, experts: int, top_k: int,
             vocab: int, act: str = "silu") -> str:
    return (f"hf:mixtral?labels=true&num_hidden_layers={layers}&hidden_size={hidden}&num_attention_heads={heads}"
            f"&num_key_value_heads={kv_heads}&intermediate_size={ffn}&num_local_experts={experts}"
            f"&num_experts_per_tok={top_k}&vocab_size={vocab}&hidden_act={act}")


_DGX_H100 = "DGX H100: NVLink4 + 8x NDR 400 Gb/s InfiniBand per node"
_MCORE_MOE = "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md at 0b981f9c53 (MCore v0.8, 2024-08)"
_MIXTRAL_FLOPS = MegatronFlops(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, top_k=2, vocab=32000,
                               head_dim=128)
_DGXC_GROK = "NVIDIA/dgxc-benchmarking grok1/README_314b.md at 8f5cbb3 (v25.02, NeMo 24.12)"
_GROK_CFG = ("NVIDIA/dgxc-benchmarking grok1/grok1_314b.yaml and grok1/configure.sh at 8f5cbb3")
# Grok-1 as NeMo's configuration builds it: 64 layers, hidden 6144, FFN 32768, 48 heads in 8
# query groups, RMSNorm, RoPE, GeGLU ("fast-geglu": tanh GELU), no biases, 8 experts top-2,
# untied embeddings, the Llama-3-70B tokenizer (128256 tokens). transformers' mixtral is that
# architecture (Grok-1's extra norms and logit soft-capping are elementwise).
_GROK = _mixtral(64, 6144, 48, 8, 32768, 8, 2, 128256, act="gelu_pytorch_tanh")
# The capacity factor 1.0 with padding (`moe_expert_capacity_factor: 1.0`,
# `moe_pad_expert_input_to_capacity: true`): every expert computes exactly its balanced share.
_GROK_SKEW = f"{_GROK_CFG}: moe_expert_capacity_factor 1.0 with moe_pad_expert_input_to_capacity"
_GROK_UB = f"{_GROK_CFG}: configure.sh overrides model.ub_tp_comm_overlap=true"

ROWS: tuple[MoeRun, ...] = (
    # Megatron-Core's headline: "Mixtral 8X7B bf16 training ... 438 TFLOPS as of MCore v0.8",
    # with the same README's "reference parallel mappings of MCore v0.8": 64 GPUs, seq 4096, TP1
    # EP8 PP4 VP8 MBS1 GBS256, all-to-all dispatcher, on 8xH100 nodes with 8x400 Gb/s IB, dropless.
    # The benchmark's own script is not published: the runtime flags are assumed from the same
    # README's Mixtral example (distributed optimizer, --overlap-grad-reduce, --overlap-param-gather,
    # bf16, whose gradients Megatron reduces in fp32 by default) and Transformer Engine layers.
    MoeRun("Megatron-Core Mixtral 8x7B", _mixtral(32, 4096, 32, 8, 14336, 8, 2, 32000), 4096,
           "dp=2,ep=8,pp=4,vpp=8,mb=8,gbs=256,zero=1,dtype=bf16", "H100-SXM", 64, _DGX_H100,
           "tflops", 438.0, f"{_MCORE_MOE}: \"438 TFLOPS\" and \"Reference Best Parallel Mapping\" "
           "(Mixtral 8x7B, 64 GPUs, TP1 EP8 PP4 VP8 MBS1 GBS256, seq 4096)", runtime="megatron",
           flops=_MIXTRAL_FLOPS,
           note="the README states the figure and the mapping apart (both 'as of MCore v0.8'); it is the only "
                "8x7B H100 mapping it gives. MCore v0.9 raised the figure to 468 TFLOPS (same mapping table)"),
    # Grok-1 314B, NeMo 24.12 on H100, BF16, 64 layers at seq 8192: TP4 (+SP) PP8 VP8 CP2 EP8,
    # MBS1, GBS = 16 per node; Megatron's data-parallel size 8/16/32 holds EP8.
    *(MoeRun(f"NeMo Grok-1 314B ({n} GPUs)", _GROK, 8192,
             f"dp={n // 512},ep=8,tp=4,pp=8,vpp=8,cp=2,sp=1,mb=8,gbs={2 * n},zero=1,dtype=bf16", "H100-SXM", n,
             _DGX_H100, "step_s", t, f"{_DGXC_GROK}: BF16 training step time {t} s on {n}x H100 (64 layers, "
             f"TP4 PP8 CP2 EP8 VP8 MBS1 GBS{2 * n}); model from {_GROK_CFG}", runtime="megatron",
             routing_skew=1.0, skew_source=_GROK_SKEW, gradient_reduce="compute", tp_comm_overlap=True,
             overlap_source=_GROK_UB,
             note="optim.grad_sync_dtype bf16; vocabulary 128256 (Megatron pads it to 128512)")
      for n, t in ((512, 21.01), (1024, 21.20), (2048, 21.29))),
)


@dataclass(frozen=True, slots=True)
class UnpricedRun:
    """A published MoE run with a sourced figure that the table cannot price honestly: `why`
    names what the model lacks or what the source leaves unstated. Printed under the table."""

    name: str
    device: str
    gpus: int
    figure: str
    source: str
    why: str


_DSV3 = "DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv 2412.19437), Table 1 and sec. 3.1-3.3"
_DSV2 = "DeepSeek-AI, DeepSeek-V2 (arXiv 2405.04434), sec. 3.1.3 (infrastructures) and 3.2"
UNPRICED: tuple[UnpricedRun, ...] = (
    UnpricedRun("DeepSeek-V3 671B pre-training", "H800", 2048,
                "2,664K H800 GPU hours for 14.8T tokens (180K per trillion; 2,788K with context extension "
                "and post-training)", _DSV3,
                "FP8 mixed-precision training: the `H800` preset has the data sheet's fp8 peak (1979 TFLOP/s), but "
                "a plan computes in fp32, bf16 or fp16 (`PLAN_DTYPES`) and no runtime shardc prices keeps FP8 "
                "GEMMs with fine-grained (1x128, 128x128) scaling beside bf16 ones, so a bf16 price would be "
                "another run's (its GEMMs at half the rate); the figure averages a batch "
                "ramped from 3072 to 15360 sequences. The layout itself is expressible as a plan (not traced at "
                "this size): pp=16, ep=64 inside dp=128 (`dp=2,ep=64,pp=16`), no tp, DualPipe ~ torch's dualpipev; node-limited routing "
                "(<= 4 nodes per token) is not modelled"),
    UnpricedRun("DeepSeek-V2 236B pre-training", "H800", 0,
                "172.8K GPU hours per trillion tokens", _DSV2,
                "the `H800` preset prices the device, and the report states the parallelism (16-way zero-bubble "
                "pipeline, 8-way expert parallelism, ZeRO-1 data parallelism), but not the GPU count, the batch the "
                "figure was measured at (it ramps) or the stage split; device-limited routing (M=3) is not modelled"),
)


def print_unpriced(rows: tuple[UnpricedRun, ...] = UNPRICED) -> None:
    print("published MoE runs not priced:")
    for r in rows:
        gpus = f"{r.gpus}x {r.device}" if r.gpus else r.device
        print(f"- {r.name} ({gpus}): {r.figure}. Source: {r.source}. Not priced: {r.why}.")


def row_options(row: MoeRun) -> EstimateOptions:
    """Megatron-Core's runtime as the dense NeMo rows price it: no torch pipelining buffers, the
    distributed optimizer as textbook ZeRO-1, gradients reduced during backward; its alltoall
    token dispatcher under expert tensor parallelism (module docstring)."""
    return EstimateOptions(pipeline_runtime="none", zero_runtime="zero", gradient_reduce=row.gradient_reduce,
                           tp_comm_overlap=row.tp_comm_overlap, expert_dispatch="megatron")


def row_cluster(row: MoeRun) -> Cluster:
    return make_cluster(row.device, max(1, row.gpus // 8), min(8, row.gpus))


def row_plan(row: MoeRun) -> ParallelPlan:
    """The row's plan priced with Transformer Engine's fused kernels (`compile=1`), as the dense
    Megatron-Core/NeMo rows are."""
    return ParallelPlan.parse(f"{row.plan},compile=1")


def row_graph(row: MoeRun) -> tuple[Graph, ParallelPlan]:
    """The row's model traced on the meta device at one micro-batch across its data-parallel
    group and partitioned by apply-plan; the row's routing skew set on the graph."""
    plan = row_plan(row)
    loaded = load_model(f"{row.model}&seq={row.seq}&batch={plan.dp * plan.mb}", device="meta")
    graph = group_layers(trace(loaded.model, loaded.example_inputs, name=loaded.name,
                               input_names=loaded.input_names))
    graph = apply_plan(graph, plan)
    for name, layer in graph.layers.items():
        if layer_of_path(name) != name:  # embedding, final norm, LM head: never checkpointed
            graph.layers[name] = Layer(name, layer.block, replace(layer.annotation, recompute="none"))
    if row.routing_skew is not None:
        graph.attrs["routing_skew"] = row.routing_skew
    return graph, plan


def row_skew(row: MoeRun) -> float:
    """The routing skew the row is priced at: its own, else the measured default for its ep."""
    return row.routing_skew if row.routing_skew is not None else default_routing_skew(ParallelPlan.parse(row.plan).ep)


@dataclass(frozen=True, slots=True)
class MoePrediction(Prediction):
    """One row predicted (`published_runs.Prediction`: the figure in its metric, the step time,
    whether it fits) and the all-to-all time per step on the busiest stage."""

    ep_comm_s: float


def predict(row: MoeRun, graph: Graph | None = None) -> MoePrediction:
    """The row's prediction in its published metric (`graph`: `row_graph`'s, to reuse one). A
    TFLOP/s figure is the publisher's FLOP count over the predicted step time, so its error is
    the step time's alone."""
    graph, plan = (graph, row_plan(row)) if graph is not None else row_graph(row)
    e = estimate(graph, row_cluster(row), plan, options=row_options(row))
    if row.metric == "step_s":
        value = e.step_time_s
    else:
        assert row.flops is not None
        value = row.flops.per_sequence(row.seq) * e.global_batch / e.step_time_s / row.gpus / 1e12
    ep_comm = max((s.time.get("ep_comm", 0.0) for s in e.stages), default=0.0)
    return MoePrediction(row, value, e.step_time_s, e.fits, ep_comm)


def summary(predictions: list[MoePrediction]) -> tuple[float, float]:
    """(mean, worst) absolute error over the rows."""
    errs = [abs(p.error) for p in predictions]
    return (sum(errs) / len(errs), max(errs)) if errs else (0.0, 0.0)


_UNIT = {"step_s": "s/step", "tflops": "TFLOP/s/GPU"}


def table_rows(predictions: list[MoePrediction]) -> list[list[str]]:
    def fmt(v: float) -> str:
        return f"{v:,.1f}" if v >= 100 else f"{v:.3g}" if v < 10 else f"{v:.1f}"

    return [[p.row.name, f"{p.row.device} x{p.row.gpus}", p.row.plan, _UNIT[p.row.metric], fmt(p.predicted),
             fmt(p.row.published), f"{p.error:+.1%}" + ("" if p.fits else " (does not fit)"),
             f"{row_skew(p.row):.2f}" + (" (measured default)" if p.row.routing_skew is None else "")]
            for p in predictions]


HEADER = ["MoE run", "GPUs", "plan", "metric", "predicted", "published", "error", "routing skew"]


def print_table(predictions: list[MoePrediction], markdown: bool) -> None:
    mean, worst = summary(predictions)
    show("published MoE runs: predicted vs published (checks, none calibrated)", HEADER, table_rows(predictions),
         f"published MoE runs: mean |error| {mean:.1%}, worst {worst:.1%}", markdown)


def print_sources(rows: list[MoeRun]) -> None:
    for r in rows:
        print(f"- {r.name} ({r.gpus}x {r.device}; {r.interconnect}): {r.source}"
              + (f" Routing skew: {r.skew_source}" if r.skew_source else "")
              + (f" TP overlap: {r.overlap_source}" if r.tp_comm_overlap else "")
              + (f" Note: {r.note}" if r.note else ""))


def select(only: str | None) -> list[MoeRun]:
    return [r for r in ROWS if not only or only.lower() in r.name.lower()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="rows whose name contains this text")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (the README's)")
    parser.add_argument("--sources", action="store_true", help="list every row's interconnect and source")
    args = parser.parse_args(argv)
    rows = select(args.only)
    if args.sources:
        print_sources(rows)
    elif rows:
        print_table([predict(r) for r in rows], args.markdown)
    if not args.only:
        print_unpriced()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
