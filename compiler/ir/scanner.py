"""The lexical layer of the IR parser: a position in the text, whitespace and `//` comments
skipped, literals, keywords, names, strings and integers read in place, and every error a
`ParseError` that starts with `file:line:column:` and says what was expected and what was found.
`shardc.ir.parser` builds the grammar on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import NoReturn, TypeVar

from shardc.ir.diagnostics import ParseError

WORD = re.compile(r"[A-Za-z0-9_.\-]+")
_INT = re.compile(r"-?\d+")
_SPACE = re.compile(r"(?:\s+|//[^\n]*)+")

T = TypeVar("T")


class Scanner:
    """Reads the text in place (the IR's lexical rules depend on context: a layer name may be
    `0`, a module path may hold `:`, so there is no separate token stream)."""

    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.filename = filename
        self.pos = 0

    # ---- positions and errors -------------------------------------------------------------
    def where(self, pos: int | None = None) -> str:
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return f"{self.filename}:{line}:{column}"

    def found(self) -> str:
        if self.pos >= len(self.text):
            return "end of file"
        m = WORD.match(self.text, self.pos)
        if m:
            return f"'{m.group()}'"
        return f"'{self.text[self.pos]}'"

    def fail(self, message: str, pos: int | None = None) -> NoReturn:
        raise ParseError(f"{self.where(pos)}: {message}")

    def expected(self, what: str) -> NoReturn:
        self.fail(f"expected {what}, found {self.found()}")

    # ---- lexical helpers ------------------------------------------------------------------
    def skip(self) -> None:
        if self.pos < len(self.text) and self.text[self.pos] not in " \t\r\n/":
            return
        m = _SPACE.match(self.text, self.pos)
        if m:
            self.pos = m.end()

    def peek(self, literal: str) -> bool:
        self.skip()
        return self.text.startswith(literal, self.pos)

    def peek_keyword(self, word: str) -> bool:
        self.skip()
        m = WORD.match(self.text, self.pos)
        return m is not None and m.group() == word

    def accept(self, literal: str) -> bool:
        if self.peek(literal):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str, context: str = "") -> None:
        if not self.accept(literal):
            self.expected(f"'{literal}'" + (f" {context}" if context else ""))

    def keyword(self, word: str, context: str = "") -> None:
        if not self.peek_keyword(word):
            self.expected(f"'{word}'" + (f" {context}" if context else ""))
        self.pos += len(word)

    def regex(self, pattern: re.Pattern[str], what: str) -> str:
        self.skip()
        m = pattern.match(self.text, self.pos)
        if not m or not m.group():
            self.expected(what)
        self.pos = m.end()
        return m.group()

    def string(self) -> str:
        self.skip()
        if not self.text.startswith('"', self.pos):
            self.expected("a string")
        start = self.pos
        try:
            value, end = json.decoder.scanstring(self.text, self.pos + 1)  # type: ignore[attr-defined]
        except json.JSONDecodeError as err:
            line_end = self.text.find("\n", start)
            if '"' not in self.text[start + 1: line_end if line_end >= 0 else len(self.text)]:
                self.fail("unterminated string: expected a closing '\"' on the same line", start)
            self.fail(f"malformed string: {err.msg.removesuffix(' at')} at column {err.colno}", start)
        self.pos = end
        return value

    def name(self, what: str) -> str:
        """A bare name (`blocks.0`) or a JSON-quoted one."""
        if self.peek('"'):
            return self.string()
        return self.regex(WORD, what)

    def integer(self, what: str) -> int:
        return int(self.regex(_INT, what))

    def build(self, start: int, make: Callable[[], T]) -> T:
        """Construct an IR value; its own checks become parse errors at `start`."""
        try:
            return make()
        except (ValueError, TypeError) as err:
            self.fail(str(err), start)

    def separated(self, item: Callable[[], T], close: str) -> list[T]:
        """`item (, item)*` up to (not including) `close`; possibly empty."""
        items: list[T] = []
        if self.peek(close):
            return items
        items.append(item())
        while self.accept(","):
            items.append(item())
        return items
