"""Where the suite's time and CPU go, by file, from a record of SUITE_CPU_RECORD (see
tests/conftest.py): python scripts/suite_cpu.py FILE [TOP]

Prints the totals (the suite's time from its first test's start to its last test's end, CPU,
the cores busy on average), then per lane (tests/conftest.py) and per file (their tests' wall
times added up), then the TOP slowest tests (20 by default)."""
import collections
import json
import sys


def _totals(rows: list, key) -> dict:
    """[tests, wall, CPU] added up by ``key(row)``."""
    totals: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for row in rows:
        entry = totals[key(row)]
        entry[0] += 1
        entry[1] += row["wall"]
        entry[2] += row["cpu"]
    return totals


def main(path: str, top: int = 20) -> None:
    with open(path, encoding="utf-8") as record:
        rows = [json.loads(line) for line in record]
    for row in rows:
        row["cpu"] = row["cpu_pytest"] + row["cpu_processes"]
    files = _totals(rows, lambda row: row["test"].split("::")[0])
    cpu = sum(r["cpu"] for r in rows)
    if all("began" in r for r in rows):
        wall = max(r["began"] + r["wall"] for r in rows) - min(r["began"] for r in rows)
    else:  # a record from before the lanes: one test after another
        wall = sum(r["wall"] for r in rows)
    print(f"{len(rows)} tests: {wall:.0f} s wall, {cpu:.0f} s CPU, {cpu / wall:.2f} cores busy")
    for name, (count, w, c) in sorted(_totals(rows, lambda row: row.get("lane", "one")).items()):
        print(f"  lane {name}: {count} tests, {w:.0f} s wall, {c:.0f} s CPU")
    print(f"{'file':44s} {'tests':>5s} {'wall s':>7s} {'CPU s':>7s} {'cores':>5s}")
    for name, (count, w, c) in sorted(files.items(), key=lambda item: -item[1][1]):
        print(f"{name:44s} {count:5d} {w:7.1f} {c:7.1f} {c / max(w, 1e-9):5.2f}")
    print()
    for row in sorted(rows, key=lambda r: -r["wall"])[:top]:
        print(f"{row['wall']:7.1f} s {row['cpu']:7.1f} s CPU  {row['test']}")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
