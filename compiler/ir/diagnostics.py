"""One error type for everything shardc tells a user: what went wrong, where, what to do.

A `ShardcError` may carry the offending node (printed in IR form with its location), the pass
that was running, and a hint. The CLI prints it without a stack trace.
"""

from __future__ import annotations

from shardc.ir import Node


class ShardcError(Exception):
    """A user-facing error. `str(err)` is the whole message: what, where, and what to do."""

    def __init__(self, message: str, *, node: Node | None = None, hint: str = "", where: str = "") -> None:
        self.message = message
        self.node = node
        self.hint = hint
        self.where = where
        super().__init__(self.render())

    def render(self) -> str:
        from shardc.ir.printer import format_node

        parts = []
        if self.where:
            parts.append(f"{self.where}: ")
        parts.append(self.message)
        if self.node is not None:
            loc = self.node.location
            if loc.module_path or loc.source:
                parts.append(f"\n  at module {loc.module_path or '?'}" + (f" ({loc.source})" if loc.source else ""))
            parts.append(f"\n  node: {format_node(self.node)}")
        if self.hint:
            parts.append(f"\n  hint: {self.hint}")
        return "".join(parts)


class VerificationError(ShardcError):
    """The IR breaks an invariant; raised by the verifier."""


class ParseError(ShardcError):
    """Malformed IR text; the message starts with file:line:column."""
