"""The one model syntax every command accepts, parsed here and nowhere else.

- `path/to/file.py[:factory][?k=v&...]`: the factory (default: one named `default`) returns
  `(model, example_inputs)`; the query gives it keyword arguments.
- `hf:MODEL_TYPE[?k=v&...]`: a transformers model built offline with random weights; keys that
  are config fields set the config, `batch` and `seq` set the shape of the example token ids,
  `task=seq2seq|masked|causal|base` picks the head (default: the first of these transformers has
  for the type, so encoder-decoders get their conditional-generation head). Encoder-decoders
  (T5, BART) take `decoder_input_ids` too, shaped like `input_ids` unless `decoder_seq` is given.
  `labels=true` passes `labels` (the token ids the head predicts: the decoder's ids for an
  encoder-decoder, else the input ids, which causal heads shift themselves) so the model returns
  its own loss first, and training trains on that loss.
- `path/to/model.onnx[?seed=N&NAME=DxD...]`: imported by `shardc.frontend.onnx.load_onnx_module`;
  keys other than `seed` give static shapes to dynamic inputs.

Query values are parsed as int, float, `true`/`false`, `none`, else kept as strings. The model is
built under `with torch.device(device)`, so `device="meta"` builds even a 175B model for free.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardc.ir.diagnostics import ShardcError

_FILE_SPEC = re.compile(r"^(?P<path>.+?\.py)(?::(?P<factory>[^?]*))?(?:\?(?P<query>.*))?$")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to trace: the module, its example inputs, a graph name and the input names."""

    model: torch.nn.Module
    example_inputs: tuple[Any, ...]
    name: str
    input_names: tuple[str, ...]


def parse_value(text: str) -> Any:
    """A query value: int, float, bool (`true`/`false`), None (`none`), else the string itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_query(query: str | None, spec: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not query:
        return out
    for part in query.split("&"):
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq or not key.isidentifier():
            raise ShardcError(f"model spec {spec!r}: query part {part!r} is not key=value with an identifier key")
        out[key] = parse_value(value)
    return out


def load_model(spec: str, *, device: str | torch.device = "cpu",
               input_shapes: dict[str, tuple[int, ...]] | None = None) -> LoadedModel:
    """Build the model a spec names, on `device`, with its example inputs (see module docstring).

    `input_shapes` (ONNX only) gives static shapes to dynamic inputs, like the query's NAME=DxD."""
    base, _, query = spec.partition("?")
    if base.startswith("hf:"):
        return _load_hf(base[3:], parse_query(query, spec), spec, device)
    if base.endswith(".onnx"):
        return _load_onnx(base, parse_query(query, spec), spec, device, input_shapes)
    match = _FILE_SPEC.match(spec)
    if match is None:
        raise ShardcError(f"model spec {spec!r} is not understood",
                          hint="write path/to/file.py:factory[?k=v&...], hf:MODEL_TYPE[?k=v&...] or path/to/model.onnx")
    return _load_file(match["path"], match["factory"] or None, parse_query(match["query"], spec), spec, device)


# ---- python files -------------------------------------------------------------------------

def _import_file(path: Path) -> Any:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    mod_name = f"shardc_user_{stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ShardcError(f"cannot import model file {path}")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module  # dataclasses in the file look their module up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[mod_name]
        raise ShardcError(f"importing model file {path} failed: {type(err).__name__}: {err}") from err
    return module


def factories(module: Any) -> list[str]:
    """Public functions defined in a model file (candidates for `file.py:factory`)."""
    return sorted(name for name, obj in vars(module).items()
                  if inspect.isfunction(obj) and not name.startswith("_")
                  and getattr(obj, "__module__", None) == module.__name__)


def _load_file(path_text: str, factory: str | None, kwargs: dict[str, Any], spec: str,
               device: str | torch.device) -> LoadedModel:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ShardcError(f"model spec {spec!r}: file {path_text} does not exist (looked at {path})")
    module = _import_file(path)
    names = factories(module)
    name = factory or "default"
    fn = getattr(module, name, None)
    if not callable(fn):
        what = f"has no factory {name!r}" if factory else "names no factory and defines no `default`"
        raise ShardcError(f"model spec {spec!r}: {path_text} {what}",
                          hint=f"factories in {path_text}: {', '.join(names) or 'none'}")
    _check_kwargs(fn, kwargs, f"{path_text}:{name}", spec)
    with torch.device(device):
        try:
            result = fn(**kwargs)
        except (TypeError, ValueError) as err:
            raise ShardcError(f"model spec {spec!r}: factory {path_text}:{name} failed: {err}") from err
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ShardcError(f"factory {path_text}:{name} must return (model, example_inputs), "
                          f"got {type(result).__name__}")
    model, inputs = result
    inputs = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    real_name = getattr(fn, "__name__", name)
    graph_name = re.sub(r"\W", "_", f"{path.stem}_{real_name}")
    return LoadedModel(model, inputs, graph_name, _input_names(model, inputs))


def _check_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any], what: str, spec: str) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # the factory forwards **overrides; it reports unknown keys itself
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise ShardcError(f"model spec {spec!r}: factory {what} takes no argument {', '.join(map(repr, unknown))}",
                          hint=f"its arguments: {', '.join(params) or 'none'}")


def _input_names(model: torch.nn.Module, inputs: tuple[Any, ...]) -> tuple[str, ...]:
    """The forward arguments the example inputs bind to, positionally."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return tuple(params[i] if i < len(params) else f"input{i}" for i in range(len(inputs)))


# ---- transformers -------------------------------------------------------------------------

_SHAPE_KEYS = ("batch", "seq", "decoder_seq", "task", "labels")


def _load_hf(model_type: str, kwargs: dict[str, Any], spec: str, device: str | torch.device) -> LoadedModel:
    try:
        import transformers
    except ImportError as err:
        raise ShardcError(f"model spec {spec!r} needs transformers: pip install transformers") from err
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        close = [k for k in CONFIG_MAPPING if model_type.lower() in k or k in model_type.lower()][:10]
        raise ShardcError(f"model spec {spec!r}: transformers has no model type {model_type!r}",
                          hint=f"close matches: {', '.join(close) or 'none'}; e.g. hf:gpt2, hf:llama, hf:bert")
    defaults = CONFIG_MAPPING[model_type]()
    fields = {k: v for k, v in kwargs.items() if k not in _SHAPE_KEYS}
    unknown = [k for k in fields if not hasattr(defaults, k)]
    if unknown:
        known = sorted(k for k in defaults.to_dict() if not k.startswith("_"))
        raise ShardcError(f"model spec {spec!r}: {', '.join(map(repr, unknown))} is not a field of the "
                          f"{model_type} config and not batch, seq, decoder_seq, task or labels",
                          hint=f"{model_type} config fields: {', '.join(known)}")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    _fit_heads(config, defaults, set(fields))
    cls = _hf_class(transformers, config, kwargs.get("task"), spec)
    with torch.device(device):
        try:
            model = cls.from_config(config)
        except (ValueError, TypeError) as err:
            raise ShardcError(f"model spec {spec!r}: transformers rejected the config: {err}") from err
        vocab = int(getattr(config, "vocab_size", 0) or 2)
        limit = int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 128)
        batch, seq = int(kwargs.get("batch", 2)), int(kwargs.get("seq", min(128, limit)))
        inputs = {"input_ids": torch.randint(0, vocab, (batch, seq))}
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = torch.randint(0, vocab, (batch, int(kwargs.get("decoder_seq", seq))))
        elif "decoder_seq" in kwargs:
            raise ShardcError(f"model spec {spec!r}: decoder_seq is for encoder-decoder models; {model_type} is not one")
    if kwargs.get("labels", False) is True:
        inputs["labels"] = inputs.get("decoder_input_ids", inputs["input_ids"]).clone()
    elif kwargs.get("labels", False) is not False:
        raise ShardcError(f"model spec {spec!r}: labels={kwargs['labels']!r}; write labels=true (the model "
                          "returns its own loss) or leave it out")
    if list(inputs) != ["input_ids"]:
        _call_by_keyword(model, tuple(inputs))
    return LoadedModel(model, tuple(inputs.values()), re.sub(r"\W", "_", f"hf_{model_type}"), tuple(inputs))


def _keyword_class(base: type[torch.nn.Module], names: tuple[str, ...]) -> type:
    """`base` with a forward taking exactly `names` (input_ids, then decoder_input_ids and/or
    labels) positionally and passing them on by keyword: transformers' forwards put attention
    masks and caches between them."""
    def seq2seq(self: Any, input_ids: Any, decoder_input_ids: Any, labels: Any = None) -> Any:
        return base.forward(self, input_ids=input_ids, decoder_input_ids=decoder_input_ids, labels=labels)

    def with_labels(self: Any, input_ids: Any, labels: Any) -> Any:
        return base.forward(self, input_ids=input_ids, labels=labels)

    forward = seq2seq if "decoder_input_ids" in names else with_labels
    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def _call_by_keyword(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Make `model(*inputs)` mean `model(**dict(zip(names, inputs)))`, keeping its class's name,
    parameters and module paths (a wrapper module would prefix every path)."""
    model.__class__ = _keyword_class(type(model), names)


def _fit_heads(config: Any, defaults: Any, user_keys: set[str]) -> None:
    """A hidden size set without a head count keeps the default head width (64 for GPT-2), so
    `hf:gpt2?n_embd=128` gets 2 heads instead of failing on 128 % 12; key/value heads follow."""
    aliases = {v: k for k, v in getattr(config, "attribute_map", {}).items()}
    named = user_keys | {aliases.get(k, k) for k in user_keys}
    try:
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = int(defaults.hidden_size) // int(defaults.num_attention_heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return
    if "num_attention_heads" not in named and hidden % heads:
        heads = hidden // head_dim if head_dim and hidden % head_dim == 0 and hidden >= head_dim else \
            max(d for d in range(1, heads + 1) if hidden % d == 0)
        config.num_attention_heads = heads
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and "num_key_value_heads" not in named and heads % kv:
        config.num_key_value_heads = heads


def _hf_class(transformers: Any, config: Any, task: str | None, spec: str) -> Any:
    from transformers.models.auto import modeling_auto as auto

    heads: dict[str, tuple[Any, Any]] = {
        "masked": (transformers.AutoModelForMaskedLM, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        "causal": (transformers.AutoModelForCausalLM, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "base": (transformers.AutoModel, auto.MODEL_MAPPING_NAMES),
        "seq2seq": (transformers.AutoModelForSeq2SeqLM, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
    }
    if task is not None:
        if task not in heads:
            raise ShardcError(f"model spec {spec!r}: task={task!r}; use task=seq2seq, task=masked, task=causal "
                              "or task=base")
        if config.model_type not in heads[task][1]:
            raise ShardcError(f"model spec {spec!r}: {config.model_type} has no {task} head in transformers")
        return heads[task][0]
    for name in ("seq2seq", "masked", "causal", "base"):
        if config.model_type in heads[name][1]:
            return heads[name][0]
    raise ShardcError(f"model spec {spec!r}: transformers has no model class for {config.model_type}")


# ---- onnx -----------------------------------------------------------------------------------

def _load_onnx(path: str, kwargs: dict[str, Any], spec: str, device: str | torch.device,
               input_shapes: dict[str, tuple[int, ...]] | None = None) -> LoadedModel:
    """`model.onnx?seed=0&input_ids=8x128`: query keys other than `seed` give static input shapes."""
    if not Path(path).is_file():
        raise ShardcError(f"model spec {spec!r}: ONNX file {path} does not exist")
    try:
        onnx_frontend = importlib.import_module("shardc.frontend.onnx")
    except ImportError as err:
        raise ShardcError(f"model spec {spec!r}: the ONNX frontend (shardc.frontend.onnx) is not available: {err}") from err
    shapes = dict(input_shapes or {})
    for key, value in kwargs.items():
        if key == "seed":
            continue
        try:
            shapes[key] = tuple(int(d) for d in str(value).lower().split("x"))
        except ValueError:
            raise ShardcError(f"model spec {spec!r}: {key}={value!r} is not a shape like 8x128",
                              hint="ONNX query keys are seed and input names with static shapes (NAME=DxD)") from None
    with torch.device(device):
        module, inputs = onnx_frontend.load_onnx_module(path, input_shapes=shapes or None, seed=int(kwargs.get("seed", 0)))
    graph = getattr(module, "shardc_graph", None)
    names = tuple(v.name for v in graph.inputs) if graph is not None else _input_names(module, tuple(inputs))
    return LoadedModel(module, tuple(inputs), re.sub(r"\W", "_", Path(path).stem), names)
