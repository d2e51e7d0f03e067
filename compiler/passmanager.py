"""Passes, pipelines and `run_pipeline`, which runs them (`shardc.driver` runs every command through it).

A pass is a frozen dataclass with a kebab-case `name` and `apply(graph, ctx) -> Graph`; its
options are its dataclass fields. `@register_pass` files it by name; every module of the
`shardc.passes` package is imported on first lookup, so a pass exists by existing there.

A pipeline is a string, `"annotate-cost,group-layers,solve{time-limit=30,seed=1}"`: passes
separated by commas, options in braces (separated by commas or spaces) with kebab-case names
mapping to the fields (`time-limit` -> `time_limit`), values typed by each field's annotation
(`int`, `float`, `str`, `bool`, unions with `None`, `Literal[...]`, tuples written
`a+b+c`). `run_pipeline` verifies
the IR after every pass, can print it after each (`--print-after-all`) and time each pass
(`--time-passes`); an exception inside a pass comes out as a `PassError` naming the pass, the
passes that ran before it and the node, if the cause named one.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import sys
import time
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TextIO

from shardc.ir import Graph, Mesh
from shardc.ir.diagnostics import ShardcError, VerificationError

_KEBAB = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


@dataclass(frozen=True, slots=True)
class PassTiming:
    """Seconds spent in one pass and in verifying its result."""

    name: str
    seconds: float
    verify_seconds: float = 0.0


@dataclass(frozen=True)
class PassContext:
    """What passes may read besides the graph. Seeds and limits are explicit, never global.

    `plan` is the plan the passes apply or check: plan text, a `ParallelPlan`, or a partitioned
    graph that records one (passes read it through `ParallelPlan.of`); `options` holds free-form
    settings and what passes leave for the caller (`estimate`, `search`); `timings` is filled by
    `run_pipeline`.
    """

    mesh: Mesh | None = None
    cluster: Any = None
    plan: Any = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    timings: list[PassTiming] = field(default_factory=list)

    def the_cluster(self, who: str | None = None) -> Any:
        """The context's cluster (its text parsed: `8xH100`, `local2`); None when there is none,
        or a ShardcError naming the pass `who` when that pass needs one."""
        if self.cluster is None:
            if who is None:
                return None
            raise ShardcError(f"the {who} pass needs a cluster",
                              hint="give the command a --cluster (or PassContext(cluster='8xH100'))")
        if isinstance(self.cluster, str):
            from shardc.hardware import parse_cluster

            return parse_cluster(self.cluster)
        return self.cluster


@dataclass(frozen=True)
class Pass:
    """Base of every pass: subclasses set `name` and implement `apply`; options are fields."""

    name: ClassVar[str] = ""

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        raise NotImplementedError(f"pass {self.name} does not implement apply()")

    def __str__(self) -> str:
        return pass_text(self)


def _option_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "+".join(_option_text(v) for v in value)
    if isinstance(value, str) and (not value or any(c in value for c in ',{}"= \t')):
        return f'"{value}"'  # a path or text with separators reads back whole
    return str(value)


def _options(cls: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "name"}


def pass_text(p: Any) -> str:
    """The pipeline text of a pass instance: its name and the options that differ from defaults."""
    opts = []
    for f in _options(p).values():
        value = getattr(p, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        opts.append(f"{f.name.replace('_', '-')}={_option_text(value)}")
    return p.name + ("{" + ",".join(opts) + "}" if opts else "")


class PassError(ShardcError):
    """A pass raised, or left IR that fails verification."""


_PASSES: dict[str, type[Pass]] = {}
_IMPORT_FAILURES: dict[str, str] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make `cls` available to pipelines under `cls.name` (kebab-case, unique)."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not _KEBAB.fullmatch(name):
        raise ValueError(f"pass class {cls.__qualname__} needs a kebab-case `name`, got {name!r}")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"pass {name} must be a dataclass (options are its fields)")
    if not callable(getattr(cls, "apply", None)):
        raise TypeError(f"pass {name} needs an apply(graph, ctx) method")
    old = _PASSES.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"pass name {name!r} is taken by {old.__module__}.{old.__qualname__}")
    _PASSES[name] = cls
    return cls


def _discover() -> None:
    """Import every module of `shardc.passes` once, so their `@register_pass` run."""
    import shardc.passes as package

    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if info.name in sys.modules or info.name in _IMPORT_FAILURES:
            continue
        try:
            importlib.import_module(info.name)
        except Exception as err:  # one broken pass module must not hide the others
            _IMPORT_FAILURES[info.name] = f"{type(err).__name__}: {err}"


def available_passes() -> dict[str, type[Pass]]:
    """Every registered pass by name, after importing the whole `shardc.passes` package."""
    _discover()
    return dict(sorted(_PASSES.items()))


def get_pass(name: str, registry: Mapping[str, type] | None = None) -> type[Pass]:
    """The pass class called `name` (in `registry` when given, else among all registered passes)."""
    passes = available_passes() if registry is None else dict(registry)
    if name not in passes:
        broken = "".join(f"\n  (module {m} failed to import: {e})" for m, e in _IMPORT_FAILURES.items()
                         if registry is None)
        raise ShardcError(f"unknown pass {name!r}; known passes: {', '.join(passes) or 'none'}{broken}")
    return passes[name]


# ---- pipeline strings -------------------------------------------------------------------------

def _split_top(text: str, seps: str) -> list[str]:
    """Split at separators outside braces and quotes."""
    parts: list[str] = []
    current: list[str] = []
    depth, quote = 0, False
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote and ch == "{":
            depth += 1
        elif not quote and ch == "}":
            depth -= 1
        if not quote and depth == 0 and ch in seps:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _convert(text: str, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if text.lower() == "none" and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(text, arg, where)
            except ShardcError as err:
                errors.append(str(err))
        raise ShardcError(errors[0] if errors else f"{where}: cannot read {text!r}")
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        for choice in choices:
            if str(choice) == text:
                return choice
        raise ShardcError(f"{where}: {text!r} is not one of {', '.join(map(str, choices))}")
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ShardcError(f"{where}: expected true or false, got {text!r}")
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            raise ShardcError(f"{where}: expected {'an integer' if annotation is int else 'a number'}, "
                              f"got {text!r}") from None
    if origin in (tuple, list):
        args = typing.get_args(annotation)
        item = args[0] if args else str
        values = [_convert(t.strip(), item, where) for t in text.split("+") if t.strip()]
        return tuple(values) if origin is tuple else values
    if annotation is str or annotation is Any:
        return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
    raise ShardcError(f"{where}: options of type {annotation} cannot be set from a pipeline string")


def make_pass(name: str, options: dict[str, str], registry: Mapping[str, type] | None = None) -> Pass:
    """Instantiate pass `name` from kebab-case option texts, typed by its fields."""
    cls = get_pass(name, registry)
    hints = typing.get_type_hints(cls)
    fields = _options(cls)
    kwargs: dict[str, Any] = {}
    for key, text in options.items():
        attr = key.replace("-", "_")
        if attr not in fields:
            valid = ", ".join(f.replace("_", "-") for f in fields) or "none"
            raise ShardcError(f"pass {name} has no option {key!r}; its options: {valid}")
        kwargs[attr] = _convert(text, hints.get(attr, str), f"option {key} of pass {name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ShardcError(f"pass {name}: {err}") from None


def parse_pipeline(text: str, registry: Mapping[str, type] | None = None) -> list[Pass]:
    """`"a,b{k=v,k2=v2},c"` -> pass instances; unknown passes or options list the valid ones.

    `registry` (name -> pass class) replaces the registered passes, for tests and tools.
    """
    passes: list[Pass] = []
    for item in _split_top(text, ","):
        m = re.fullmatch(r"([A-Za-z0-9_\-]+)\s*(?:\{(.*)\})?", item, re.DOTALL)
        if not m:
            raise ShardcError(f"cannot read pipeline element {item!r}; write name or name{{option=value,...}}")
        options: dict[str, str] = {}
        for opt in _split_top(m.group(2) or "", ", \t\n"):
            key, eq, value = opt.partition("=")
            if not eq or not key.strip():
                raise ShardcError(f"pass {m.group(1)}: option {opt!r} needs the form name=value")
            if key.strip() in options:
                raise ShardcError(f"pass {m.group(1)}: option {key.strip()} is given twice")
            options[key.strip()] = value.strip()
        passes.append(make_pass(m.group(1), options, registry))
    return passes


# ---- the driver -------------------------------------------------------------------------------

def _wrap(err: Exception, p: Pass, done: Sequence[Pass], what: str) -> PassError:
    before = ", ".join(x.name for x in done) or "none"
    node = getattr(err, "node", None)
    message = err.message if isinstance(err, ShardcError) else f"{type(err).__name__}: {err}"
    hint = err.hint if isinstance(err, ShardcError) else ""
    return PassError(f"{what}: {message}\n  passes run before it: {before}", node=node, hint=hint,
                     where=f"pass {pass_text(p)}")


def print_timings(timings: Sequence[PassTiming], out: TextIO) -> None:
    """A rich table: per pass its time, its verification time and its share of the total."""
    from rich.console import Console
    from rich.table import Table

    total = sum(t.seconds + t.verify_seconds for t in timings) or 1e-12
    table = Table(title="pass timings")
    for col in ("pass", "time (s)", "verify (s)", "share"):
        table.add_column(col, justify="left" if col == "pass" else "right")
    for t in timings:
        table.add_row(t.name, f"{t.seconds:.4f}", f"{t.verify_seconds:.4f}",
                      f"{100 * (t.seconds + t.verify_seconds) / total:.1f}%")
    table.add_row("total", f"{sum(t.seconds for t in timings):.4f}",
                  f"{sum(t.verify_seconds for t in timings):.4f}", "100.0%")
    Console(file=out, highlight=False, soft_wrap=True, width=100).print(table)


def run_pipeline(
    graph: Graph, pipeline: str | Sequence[Pass], ctx: PassContext | None = None, *, verify: bool = True,
    print_after_all: bool = False, time_passes: bool = False, out: TextIO | None = None,
    allow_uneven: bool = False,
) -> Graph:
    """Run the passes in order and return the final graph; `ctx.timings` gets one row per pass.

    With `verify` the IR is verified after every pass; a failure there, or any exception
    inside a pass, is raised as `PassError` naming the pass, the passes run before it and the
    node. `print_after_all` prints `// ----- IR after <pass> -----` and the IR after each
    pass; `time_passes` prints a timing table at the end. Output goes to `out` (stdout).
    `allow_uneven` lets verification accept a dim split unevenly (padded shards).
    """
    from shardc.ir.printer import print_graph
    from shardc.ops.verifier import verify as verify_graph

    ctx = ctx if ctx is not None else PassContext()
    out = out if out is not None else sys.stdout
    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
    done: list[Pass] = []
    timings: list[PassTiming] = []
    for p in passes:
        start = time.perf_counter()
        try:
            result = p.apply(graph, ctx)
        except Exception as err:
            raise _wrap(err, p, done, "failed") from err
        if not isinstance(result, Graph):
            raise PassError(f"returned {type(result).__name__}, not a Graph", where=f"pass {pass_text(p)}")
        graph = result
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        if verify:
            try:
                verify_graph(graph, allow_uneven=allow_uneven)
            except VerificationError as err:
                raise _wrap(err, p, done, "left IR that fails verification") from err
        timings.append(PassTiming(p.name, seconds, time.perf_counter() - start))
        done.append(p)
        if print_after_all:
            out.write(f"// ----- IR after {p.name} -----\n{print_graph(graph)}")
    ctx.timings.extend(timings)
    if time_passes:
        print_timings(timings, out)
    return graph
