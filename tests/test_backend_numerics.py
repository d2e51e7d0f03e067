"""Numerics of the torch backend on real gloo process groups.

Every case trains a tiny model for 3 AdamW steps, partitioned by a plan, on 2 or 4 CPU processes,
and compares the loss at every step (averaged over ranks) and every parameter afterwards
(gathered to full tensors) with the same training in one process: 1e-5 relative (fp32).
Several cases share one spawned process group, to keep the suite fast.
"""

from __future__ import annotations

import functools

import pytest
import torch
from shared_spawn import SharedRuns, spawn_jobs

from shardc.backends.torch.launch import spawn

STEPS = 3
# A gradient that is zero in exact arithmetic (the key bias of attention: softmax ignores a
# shift shared by all keys) is round-off noise, which Adam's normalisation would blow up to
# +-lr in a direction that depends on summation order; eps well above that noise keeps such
# parameters still, while real gradients (1e-4 and up here) stay in Adam's normalised regime.
LR = 1e-3
EPS = 1e-4
GPT = "examples/gpt.py:tiny?batch=4"
LLAMA = "examples/llama.py:tiny?batch=4"
HF_GPT2 = ("hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=128&n_positions=32&seq=16&batch=4"
           "&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0")


class WithLoss(torch.nn.Module):
    """A transformers LM head model with the next-token loss inside (what we train)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(spec: str, device: str = "cpu") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], tuple[str, ...]]:
    """The model (same weights in every process: seeded) and its example inputs."""
    from shardc.frontend.spec import load_model

    torch.manual_seed(0)
    loaded = load_model(spec, device=device)
    model, inputs, names = loaded.model, tuple(loaded.example_inputs), tuple(loaded.input_names)
    if spec.startswith("hf:"):
        model = WithLoss(model)
        inputs, names = (inputs[0], inputs[0].clone()), ("input_ids", "labels")
    return model, inputs, names


def gpt_init(name: str, tensor: torch.Tensor) -> None:
    """What `plan.parallelize(meta_model, init=gpt_init)` fills each full tensor with."""
    if name.endswith("future"):
        n = tensor.shape[-1]
        tensor.copy_(torch.ones(n, n, dtype=torch.bool).triu(1).view(tensor.shape))
    elif tensor.dim() >= 2:
        tensor.normal_(0.0, 0.05)
    else:
        tensor.uniform_(-0.1, 0.1)


def materialize(model: torch.nn.Module, seed: int = 0) -> None:
    """The single-process twin of the meta-device path: the same init, seeded per name."""
    import zlib

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):  # tied ones once
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed + zlib.crc32(name.encode()))
            gpt_init(name, t)


def batches(inputs: tuple[torch.Tensor, ...], vocab: int = 128) -> list[tuple[torch.Tensor, ...]]:
    """STEPS batches of token ids shaped like the example inputs (the same in every process)."""
    g = torch.Generator().manual_seed(1234)
    return [tuple(torch.randint(0, vocab, x.shape, generator=g) for x in inputs) for _ in range(STEPS)]


def train(module: torch.nn.Module, data: list[tuple[torch.Tensor, ...]], average: bool) -> list[float]:
    import torch.distributed as dist

    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in data:
        loss = module(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if average:  # each rank's loss is its share's mean: the global mean is their average
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return losses


def compile_case(spec: str, plan: str, edit: str) -> object:
    import shardc

    model, inputs, names = build(spec)
    # fp32: compared with the fp32 model (a plan's default dtype is bf16, which the backend runs)
    return shardc.compile(model, inputs, plan=f"{plan},dtype=fp32", input_names=names, before_lower=EDITS.get(edit))


def run_cases(rank: int, world: int, cases: list[tuple[str, object, str]]) -> list[tuple[list[float], dict] | str]:
    """On every rank: parallelize each compiled plan on a fresh copy of its model and train it.
    `mode` "meta" builds the model on the meta device and materialises it with `gpt_init`;
    "world" and "shape" expect the bad-input errors and return their messages."""
    from shardc.ir.diagnostics import ShardcError

    torch.use_deterministic_algorithms(True)
    results: list[tuple[list[float], dict] | str] = []
    for spec, compiled, mode in cases:
        model, inputs, _ = build(spec, device="meta" if mode == "meta" else "cpu")
        try:
            module = compiled.parallelize(model, init=gpt_init if mode == "meta" else None)  # type: ignore[attr-defined]
            if mode == "shape":
                module(*(x[:, : x.shape[1] // 2] for x in inputs))
        except ShardcError as err:
            results.append(str(err))
            continue
        losses = train(module, batches(inputs), average=True)
        full = compiled.full_state_dict(module)  # type: ignore[attr-defined]
        results.append((losses, {k: v.clone() for k, v in full.items()} if rank == 0 else {}))
    return results


@functools.cache
def reference(spec: str, meta: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process trained STEPS steps on `spec`: deterministic, so computed once per suite run
    for every plan compared with it (callers only read it)."""
    torch.use_deterministic_algorithms(True)
    model, inputs, _ = build(spec)
    if meta:
        materialize(model)
    losses = train(model, batches(inputs), average=False)
    state = dict(model.named_parameters())  # tied weights once, under the name the graph uses
    return losses, {k: v.detach() for k, v in state.items()}


def check(spec: str, plan: str, losses: list[float], full: dict[str, torch.Tensor], meta: bool = False) -> None:
    ref_losses, ref_state = reference(spec, meta)
    assert losses == pytest.approx(ref_losses, rel=1e-5), f"{spec} {plan}: losses {losses} vs {ref_losses}"
    assert set(ref_state) <= set(full), f"{spec} {plan}: parameters missing: {set(ref_state) - set(full)}"
    for name, want in ref_state.items():
        # |got - want| <= 1e-6 + 1e-5 |want| elementwise (parameters are ~0.1 in size)
        torch.testing.assert_close(full[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{spec} {plan} {n}: {m}")


# ---- hand edits of a partitioned graph, before lowering ----------------------------------

_ELEMENTWISE = ("gelu", "silu", "mul", "add", "pow", "tanh")
_SEQUENCE_DIM = {"linear": "e1", "matmul": "m"}  # matmul: HF Conv1D on (batch*seq, features)


def _sequence_chunks(graph: object) -> None:
    """Cut the sequence of every MLP (its matmuls and elementwise activation ops) into 2 steps:
    a temporal split, no rotation. Elementwise ops split their dim 1 (sequence of a 3-d tensor)
    or dim 0 (the flattened batch*seq rows of HF's Conv1D)."""
    from shardc.ir import Partition, TemporalSplit

    edited = 0
    for node in graph.nodes:  # type: ignore[attr-defined]
        if ".mlp" not in node.location.module_path or node.partition is None:
            continue
        if node.op in _SEQUENCE_DIM:
            seq_dim = _SEQUENCE_DIM[node.op]
        elif node.op in _ELEMENTWISE:
            seq_dim = "d1" if len(node.output.type.shape) == 3 else "d0"
        else:
            continue
        node.partition = Partition(node.partition.spatial, (TemporalSplit(seq_dim, 2),), node.partition.strides)
        edited += 1
    assert edited, "no MLP node to chunk: the edit no longer matches the model's graph"


_DOWN_PROJECTIONS = ("mlp.fc2", "mlp.w2", "mlp.c_proj")  # GPT, Llama, HF GPT2


def _rotating_fc2(graph: object) -> None:
    """PrimePar-style: every MLP's down projection (fc2 / w2 / c_proj) contracts k in 2 steps
    whose input shard rotates along tp."""
    from shardc.ir import Partition, TemporalSplit

    edited = 0
    for node in graph.nodes:  # type: ignore[attr-defined]
        if node.location.module_path.endswith(_DOWN_PROJECTIONS) and node.op in ("linear", "matmul"):
            spatial = tuple((a, d) for a, d in node.partition.spatial if a != "tp") + (("tp", "n"),)
            node.partition = Partition(spatial, (TemporalSplit("k", 2, "tp"),))
            for v in node.inputs[1:]:
                v.layout = None  # held again as this partition reads them (weight rows by n)
            edited += 1
    assert edited, "no MLP down projection to rotate: the edit no longer matches the model's graph"


def _head_chunks(graph: object) -> None:
    """Cut the LM head's token rows (its sequence dim e1) into 4 chunks: with the loss after it,
    it runs as one chunked linear cross entropy (`shardc.analysis.head_loss`; the fusion itself is
    checked in `tests/test_head_loss.py`)."""
    from shardc.analysis.head_loss import head_chain
    from shardc.ir import Partition, TemporalSplit

    users = graph.users()  # type: ignore[attr-defined]
    heads = [c[0] for n in graph.nodes if (c := head_chain(n, users)) is not None]  # type: ignore[attr-defined]
    assert len(heads) == 1, "no LM head before a loss to chunk: the edit no longer matches the model's graph"
    part = heads[0].partition or Partition(())
    heads[0].partition = Partition(part.spatial, (TemporalSplit("e1", 4),), part.strides)


EDITS = {"": None, "chunks": _sequence_chunks, "rotate": _rotating_fc2, "head-chunks": _head_chunks}


def compile_cases(cases: list[tuple[str, str, str]]) -> list[tuple[str, object, str]]:
    """Every (spec, plan, edit) compiled, as `run_cases` takes them."""
    return [(spec, compile_case(spec, plan, edit), edit) for spec, plan, edit in cases]


def check_cases(cases: list[tuple[str, str, str]], results: list[tuple[list[float], dict] | str]) -> list[str]:
    """Rank 0's `run_cases` results: the training ones checked, the error messages returned."""
    errors = []
    for (spec, plan, edit), result in zip(cases, results):
        if isinstance(result, str):
            errors.append(result)
            continue
        assert edit not in ("world", "shape"), f"{spec} {plan}: expected a {edit} error"
        check(spec, plan + (f" +{edit}" if edit else ""), *result, meta=edit == "meta")
    return errors


def run_and_check(world: int, cases: list[tuple[str, str, str]]) -> list[str]:
    """Spawn `world` processes for all cases; check the training ones, return the error messages."""
    return check_cases(cases, spawn(run_cases, world, compile_cases(cases), timeout_s=600)[0])


GPT_CASES = [
    (GPT, "dp=2,tp=2", ""),                          # dp x tp
    (GPT, "dp=4", ""),                               # DDP
    (GPT, "dp=4,zero=1", ""),                        # FSDP2, no reshard after forward
    (GPT, "dp=4,zero=2", ""),
    (GPT, "dp=2,tp=2,zero=3", ""),                   # FSDP2 + TP
    (GPT, "tp=2,sp=1,dp=2,recompute=full", ""),      # TP + SP, checkpointed layers
    (GPT, "tp=4", ""),                               # TP: vocab-parallel embedding and loss
    (GPT, "dp=2,cp=2", ""),                          # context parallel (keys all-gathered)
    (GPT, "dp=2,tp=2", "rotate"),                    # PrimePar-style rotating fc2
    (GPT, "dp=2,tp=2", "chunks"),                    # sequence chunking (temporal, no rotation)
    (GPT, "dp=2,tp=2", "meta"),                      # meta-device model, materialised shard by shard
    (GPT, "dp=4", "head-chunks"),                    # LM head + loss over 4 token chunks, fused
    (GPT, "dp=2,tp=2", "head-chunks"),               # the same, vocab-parallel
]
LLAMA_CASES = [
    (LLAMA, "dp=2,tp=2", ""),
    (LLAMA, "cp=2,tp=2", ""),                        # ring attention (sdpa) + TP
    (LLAMA, "tp=2,sp=1,dp=2,zero=2", ""),
    (LLAMA, "cp=4,recompute=full", ""),              # ring of 4
    (LLAMA, "dp=4", ""),                             # DDP (tp=4 is refused: kv_heads=2)
    (LLAMA, "dp=4,zero=1", ""),
    (LLAMA, "dp=2,tp=2,zero=3", ""),
    (LLAMA, "dp=2,tp=2", "rotate"),                  # rotating w2
    (LLAMA, "dp=2,tp=2", "chunks"),                  # w1, silu, w3, mul, w2 in 2 sequence chunks
    (HF_GPT2, "dp=2,tp=2", "rotate"),                # HF Conv1D c_proj (a matmul) rotating
    (HF_GPT2, "dp=2,tp=2", "chunks"),
]
HF_CASES = [
    (HF_GPT2, "tp=2", ""),
    (HF_GPT2, "cp=2", ""),
    (HF_GPT2, "dp=2,zero=3", ""),
    (HF_GPT2, "dp=2", ""),                           # DDP
    (HF_GPT2, "dp=2", "head-chunks"),                # LM head + loss over 4 token chunks, fused
    (HF_GPT2, "dp=2,zero=1", ""),
    (HF_GPT2, "dp=2,zero=2", ""),
    (HF_GPT2, "tp=2,sp=1,recompute=full", ""),       # TP + SP, checkpointed layers
    (HF_GPT2, "dp=4", "world"),                      # a plan for 4 devices on 2 processes
    (HF_GPT2, "tp=2", "shape"),                      # inputs shorter than the traced ones
]


@pytest.fixture(scope="module")
def on_four_processes() -> SharedRuns:
    """The four-process tests' cases trained in one spawned group (`tests/shared_spawn.py`)."""
    return spawn_jobs(4, [lambda: (run_cases, (compile_cases(GPT_CASES),)),
                          lambda: (run_cases, (compile_cases(LLAMA_CASES),))], timeout_s=600)


@pytest.fixture(scope="module")
def on_two_processes() -> SharedRuns:
    """The two-process tests' cases trained in one spawned group."""
    return spawn_jobs(2, [lambda: (run_cases, (compile_cases(HF_CASES),)),
                          lambda: (run_cases, (compile_cases(MIXED_CASES),))], timeout_s=600)


def test_gpt_plans_match_single_process(on_four_processes: SharedRuns) -> None:
    assert check_cases(GPT_CASES, on_four_processes[0][0]) == []


def test_llama_and_transformers_gpt2_four_process_plans_match_single_process(on_four_processes: SharedRuns) -> None:
    assert check_cases(LLAMA_CASES, on_four_processes[1][0]) == []


def test_transformers_gpt2_plans_match_single_process_and_bad_inputs_fail_clearly(
        on_two_processes: SharedRuns) -> None:
    world, shape = check_cases(HF_CASES, on_two_processes[0][0])
    assert "the world has 2 processes but the plan's mesh<pp=1, dp=4, cp=1, tp=1> needs 4" in world
    assert "input input_ids has shape (4, 8), but the plan was compiled for (4, 16)" in shape


class EmbeddingIntoMLP(torch.nn.Module):
    """An embedding read both by a column-parallel linear and by the residual add (no norm
    between): under tp its replicated output gets a partial gradient from one reader and a
    replicated one from the other."""

    def __init__(self, vocab: int = 128, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        x = x + self.fc2(torch.relu(self.fc1(x)))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def embedding_into_mlp(batch: int = 4, seq: int = 16) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    ids = torch.randint(0, 128, (batch, seq))
    return EmbeddingIntoMLP(), (ids, ids.roll(-1, 1))


MIXED = "tests/test_backend_numerics.py:embedding_into_mlp"
MIXED_CASES = [(MIXED, "tp=2", "")]


def test_a_value_read_split_and_whole_reduces_only_the_split_readers_gradient(on_two_processes: SharedRuns) -> None:
    # One all_reduce forward serves both readers; the backward all_reduce (`grad_all_reduce`) sits
    # only in front of the column-parallel fc1: summing the residual's replicated gradient too
    # counted it twice (wte.weight off by up to 3e-3 on two processes).
    import re

    lowered = str(compile_case(MIXED, "tp=2", "").graph)  # type: ignore[attr-defined]

    def readers(value: str) -> list[str]:
        """The ops reading `value` (as a whole operand, not a prefix of another name)."""
        pattern = re.compile(rf"[(,] ?{re.escape(value)}[,)]")
        return sorted(line.split("= ")[1].split("[")[0].split("(")[0] for line in lowered.splitlines()
                      if " = " in line and pattern.search(line.split(" : ")[0]))

    embedded = next(line.split(" = ")[0].strip() for line in lowered.splitlines() if "embedding(" in line)
    assert readers(embedded) == ["all_reduce"]
    # the residual reads the reduced value whole, fc1 through the marker (backward all_reduce)
    assert readers(f"{embedded}.all_reduce") == ["add", "grad_all_reduce"]
    assert check_cases(MIXED_CASES, on_two_processes[1][0]) == []
