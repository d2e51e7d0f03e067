"""The example models traced on the meta device, as every shardc command traces a user's model.

Tests of the cost model and of the solver price these graphs and no hand-built ones, so a
figure a test checks is the figure `shardc estimate` or `shardc plan` prints for the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from shardc.frontend import trace
from shardc.frontend.spec import load_model
from shardc.ir import Graph, Layer
from shardc.passes.apply_plan import apply_plan
from shardc.passes.group_layers import group_layers, layer_of_path
from shardc.plan.parallel import ParallelPlan

ROOT = Path(__file__).resolve().parent.parent


def traced(spec: str) -> Graph:
    """The model `spec` names (`examples/llama.py:llama_7b?seq=2048&batch=2`), traced on the
    meta device with its layers grouped: what `shardc plan` searches. A relative path is read
    from the repository root, so tests run from anywhere."""
    loaded = load_model(spec if spec.startswith("/") else f"{ROOT}/{spec}", device="meta")
    graph = trace(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names)
    return group_layers(graph)


def gpt_graph(*, layers: int, hidden: int, heads: int, vocab: int, seq: int, batch: int, dropout: float = 0.1,
              dp: int = 1, tp: int = 1, pp: int = 1, vpp: int = 1, sequence_parallel: bool = False,
              recompute: str = "none", zero: int = 0, dtype: str = "bf16") -> Graph:
    """`examples/gpt.py:gpt` at these sizes with `batch` sequences per micro-batch across the dp
    group, partitioned by apply-plan with Megatron's rules (what `shardc estimate` prices).
    As in Megatron, `recompute` applies to the repeated blocks only (apply-plan gives it to every
    layer, the LM head included)."""
    spec = (f"examples/gpt.py:gpt?n_layer={layers}&n_embd={hidden}&n_head={heads}&vocab_size={vocab}"
            f"&seq={seq}&batch={batch}&dropout={dropout}")
    # One traced micro-batch; a 1F1B pipeline records pp of them (torch runs no fewer).
    gbs = batch * pp if pp > 1 and vpp == 1 else None
    plan = ParallelPlan(dp=dp, tp=tp, pp=pp, vpp=vpp, sp=sequence_parallel, mb=batch // dp, gbs=gbs,
                        recompute=recompute, zero=zero, dtype=dtype)
    graph = apply_plan(traced(spec), plan)
    for name, layer in graph.layers.items():
        if layer_of_path(name) != name:  # not a repeated block
            graph.layers[name] = Layer(name, layer.block, replace(layer.annotation, recompute="none"))
    return graph


@dataclass(frozen=True, slots=True)
class TransformerDims:
    """Sizes of `examples/gpt.py:gpt` (`style="gpt"`) or `examples/llama.py:llama` ("llama")."""

    name: str = "tiny"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 32
    batch: int = 2
    ffn: int | None = None
    kv_heads: int | None = None
    style: str = "gpt"

    def __post_init__(self) -> None:
        if self.style not in ("gpt", "llama"):
            raise ValueError(f"style must be gpt or llama, got {self.style!r}")
        if self.style == "gpt" and (self.ffn is not None or self.kv_heads is not None):
            raise ValueError("examples/gpt.py has an MLP of 4*hidden and no grouped-query attention")

    @property
    def spec(self) -> str:
        """The model spec of these sizes. The GPT's LM head is untied: with a tied one, the
        solver's evaluation and the estimate disagree on non-uniform plans (a known gap)."""
        shape = f"vocab_size={self.vocab}&seq={self.seq}&batch={self.batch}"
        if self.style == "gpt":
            return (f"examples/gpt.py:gpt?n_layer={self.layers}&n_embd={self.hidden}&n_head={self.heads}&tie=false"
                    f"&{shape}")
        ffn = self.ffn or 256 * ((8 * self.hidden // 3 + 255) // 256)
        return (f"examples/llama.py:llama?n_layer={self.layers}&dim={self.hidden}&n_head={self.heads}"
                f"&n_kv_head={self.kv_heads or self.heads}&ffn_hidden={ffn}&{shape}")


# Sizes from the papers and model cards. Batch 2: the registry binds a batch of one as a
# broadcast dim, which no mesh axis can split.
PRESETS: dict[str, TransformerDims] = {
    "tiny": TransformerDims("tiny", 2, 64, 4, 128, 32, 2),
    "gpt2_1.5b": TransformerDims("gpt2_1.5b", 48, 1600, 25, 50257, 1024, 2),
    "gpt3_175b": TransformerDims("gpt3_175b", 96, 12288, 96, 51200, 2048, 2),
    "llama_7b": TransformerDims("llama_7b", 32, 4096, 32, 32000, 4096, 2, 11008, None, "llama"),
    "llama_70b": TransformerDims("llama_70b", 80, 8192, 64, 32000, 4096, 2, 28672, 8, "llama"),
}


def transformer_graph(dims: TransformerDims) -> Graph:
    """The example model of these sizes, traced (see `traced`)."""
    return traced(dims.spec)
