"""One table printer for the benchmark scripts: markdown for the README, or a rich table."""

from __future__ import annotations

from collections.abc import Sequence

RIGHT = ("predicted", "published", "error")  # numeric columns, right-aligned in the rich table


def show(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], footer: str | None,
         markdown: bool) -> None:
    """`rows` under `header`, then `footer` (a summary line) when given."""
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        if footer:
            print(f"\n{footer}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right" if h in RIGHT else "left")
    for r in rows:
        table.add_row(*r)
    console = Console(width=max(Console().width, 160))  # the plan column is long; a pipe is not a terminal
    console.print(table)
    if footer:
        console.print(footer)
