"""The check's budget, and its results: results.json and table.md rewritten
whole after every phase."""

import json
import os
import time

class Budget:
    """Seconds since the start against `--budget_seconds`."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds = seconds
        self._clock = clock
        self._start = clock()

    def used(self) -> float:
        return self._clock() - self._start

    def left(self) -> float:
        return self.seconds - self.used()

    def fits(self, estimate: float) -> bool:
        return estimate <= self.left()


class Results:
    """results.json and table.md, rewritten whole (beside their names, then
    renamed) after every phase."""

    def __init__(self, out: str, header: dict):
        self.out = out
        self.data = {"header": header, "phases": {}, "skipped": {}}

    def phase(self, name: str, rows: dict) -> None:
        self.data["phases"][name] = rows
        self.write()

    def skip(self, name: str, why: str) -> None:
        self.data["skipped"][name] = why
        self.write()

    def write(self) -> None:
        for name, text in (("results.json", json.dumps(self.data, indent=1)),
                           ("table.md", self.table())):
            path = os.path.join(self.out, name)
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)

    def table(self) -> str:
        header = self.data["header"]
        lines = [f"# GPU node check: {header['title']}", "",
                 *(f"- {k}: {v}" for k, v in header.items() if k != "title"),
                 "", "| phase | check | result |", "|---|---|---|"]
        for phase, rows in self.data["phases"].items():
            for check, row in rows.items():
                lines.append(f"| {phase} | {check} | {_cells(row)} |")
        for phase, why in self.data["skipped"].items():
            lines.append(f"| {phase} | skipped | {why} |")
        return "\n".join(lines) + "\n"


def _cells(row) -> str:
    if not isinstance(row, dict):
        return str(row)
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in row.items())
