"""Plain-text tables shared by every printable result (plans, blocks, costs, sweeps, benches)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["counted", "format_table"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in the number it takes: "1 micro-batch", "3 micro-batches"."""
    return f"{n:,} {noun if n == 1 else plural or noun + ('es' if noun.endswith(('s', 'sh', 'ch', 'x')) else 's')}"


def format_table(rows: Sequence[Sequence[str]], align: str) -> str:
    """``rows`` (the first is the header) as aligned columns with a rule under the header.

    ``align`` holds one letter per column: ``l`` (left) or ``r`` (right).
    """
    if not rows:
        return ""
    if len(align) != len(rows[0]) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one 'l' or 'r' per column ({len(rows[0])}), got {align!r}")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(align))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths), *(line(r) for r in rows[1:])])
