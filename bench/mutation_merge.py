"""Combine several bench/mutation.py reports of one module into its final status, mutant by mutant.

    python bench/mutation_merge.py MODULE RUN1/mutation.json RUN2/mutation.json ...   (oldest first)

Each mutant of the module's current source takes the status of the latest report that ran the same
mutation (column, mutation and source text; not the line number, so a report from before lines moved
still counts for an unchanged line); notes in bench/mutation_equivalent.txt apply as in a run. Prints
mutants, equivalent, killed, not killed, the share of non-equivalent mutants killed, and the mutants not
killed and never run (lines changed since every report given).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation as mt  # noqa: E402


def main(argv: list[str]) -> int:
    module, reports = argv[0], argv[1:]
    path = mt.MODULES[module][0]
    current = mt.find_mutants(path)
    notes = mt.read_equivalent()
    status: dict[tuple[int, str, str], tuple[str, str]] = {}
    for report in reports:
        for r in json.loads(Path(report).read_text())["modules"]:
            if r["module"] == module:
                for o in r["outcomes"]:
                    m = o["mutant"]
                    status[(m["start"][1], m["mutation"], m["source_line"])] = (o["status"], report)
    counts = {"killed": 0, "equivalent": 0, "not killed": 0, "never run": 0}
    listed: dict[str, list[str]] = {"not killed": [], "never run": []}
    for m in current:
        st, report = status.get((m.start[1], m.mutation, m.source_line), ("never run", ""))
        if st in ("survived", "not covered") and notes.get((module, m.mutation, m.source_line, m.start[1])):
            st = "equivalent"
        kind = "killed" if st in ("killed", "timeout") else st if st in ("equivalent", "never run") else "not killed"
        counts[kind] += 1
        if kind in listed:
            listed[kind].append(
                f"- {path}:{m.line}:{m.start[1]}  {m.mutation}  in `{m.source_line}`  -- {st} ({report})"
            )
    ran = len(current) - counts["never run"]
    live = ran - counts["equivalent"]
    print(f"{module}: {len(current)} mutants in the current source, {ran} run: {counts['equivalent']} equivalent, "
          f"{counts['killed']} killed, {counts['not killed']} not killed; "
          f"{100 * counts['killed'] / live if live else 100:.1f}% of the non-equivalent killed; "
          f"{counts['never run']} never run")
    for kind, lines in listed.items():
        if lines:
            print(f"\n{kind.capitalize()}:\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
