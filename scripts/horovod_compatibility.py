"""docs/horovod_compatibility.md: every Horovod 0.28.1 public name and horovodrun flag against
hvd_sgp as the code stands when this runs.

Usage, from the project root (``PYTHONPATH`` at the tree; torch and TensorFlow installed):

    python scripts/horovod_compatibility.py            # print the markdown
    python scripts/horovod_compatibility.py --write    # rewrite docs/horovod_compatibility.md
    python scripts/horovod_compatibility.py extract HOROVOD_SRC   # refresh the names file

Horovod's names live in ``docs/horovod_names_0.28.1.tsv`` (made once by ``extract`` from a
Horovod 0.28.1 source tree: a module's ``__all__`` where it has one, else every public name its
``__init__`` binds except Horovod's internal helpers; horovodrun's flags from its argument
parser). Each row may carry a note: ``differs: how`` (used while hvd_sgp has the name) or
``n/a: why`` (used while it has not). The verdicts are not kept anywhere: a name is ``same`` or
``differs`` when hvd_sgp's module has it (``differs`` also when it lacks one of Horovod's
parameters), ``not applicable`` or ``missing`` when it has not; a flag's verdict comes from
sgprun's flag table (``hvd_sgp/runner/horovod_flags.py``), or from sgprun's parser for a flag
declared elsewhere. Re-run it after other work lands.
"""
from __future__ import annotations

import argparse
import ast
import csv
import importlib
import inspect
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES_FILE = os.path.join(ROOT, "docs", "horovod_names_0.28.1.tsv")
DOC_FILE = os.path.join(ROOT, "docs", "horovod_compatibility.md")
SUITE_FILE = os.path.join(ROOT, "docs", "horovod_suite_results.tsv")
FIELDS = ("module", "name", "kind", "parameters", "note")
RUNNER = "horovodrun"
# Horovod module -> the hvd_sgp module a user imports instead.
MODULES = {
    "horovod.torch": "hvd_sgp.torch",
    "horovod.torch.elastic": "hvd_sgp.torch.elastic",
    "horovod.tensorflow": "hvd_sgp.tensorflow",
    "horovod.tensorflow.elastic": "hvd_sgp.tensorflow.elastic",
    "horovod.tensorflow.keras": "hvd_sgp.tensorflow.keras",
    "horovod.tensorflow.keras.callbacks": "hvd_sgp.tensorflow.keras.callbacks",
    "horovod.tensorflow.keras.elastic": "hvd_sgp.tensorflow.keras.elastic",
    "horovod.keras": "hvd_sgp.keras",
    "horovod.keras.callbacks": "hvd_sgp.keras.callbacks",
    "horovod.keras.elastic": "hvd_sgp.keras.elastic",
}
# Imported by Horovod's modules for their own use, not part of the API.
INTERNAL_SOURCES = ("horovod.common.util", "horovod.tensorflow.util")
INTERNAL_NAMES = ("run_fn",)
VERDICTS = ("same", "differs", "not applicable", "missing")


@dataclass
class Row:
    module: str
    name: str
    kind: str
    parameters: str
    note: str = ""


# ---------------------------------------------------------------- extract (run once per release)

def _source(src: str, module: str) -> str:
    base = os.path.join(src, *module.split("."))
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def _module_level(body: list) -> list:
    """Module-level statements, inside if/try blocks too (Horovod binds names conditionally)."""
    out = []
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            out += _module_level(node.body) + _module_level(node.orelse)
            for handler in getattr(node, "handlers", []):
                out += _module_level(handler.body)
        else:
            out.append(node)
    return out


def _parameters(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                     and n.name == "__init__"), None)
        return _parameters(init)[len("self, "):] if init else ""
    if not isinstance(node, ast.FunctionDef):
        return ""
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    return ", ".join(names)


def _definition(src: str, module: str, name: str, hops: int = 4) -> tuple[str, str]:
    """(kind, parameters) of ``name`` as ``module`` binds it, following re-exports."""
    path = _source(src, module)
    if os.path.isdir(os.path.join(src, *module.split("."), name)) or os.path.isfile(
            os.path.join(src, *module.split("."), name + ".py")):
        return "module", ""
    if not os.path.isfile(path):
        return "unknown", ""
    for node in _module_level(ast.parse(open(path, encoding="utf-8").read()).body):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return ("class" if isinstance(node, ast.ClassDef) else "function"), _parameters(node)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                for t in node.targets):
            return "assigned", ""
        if isinstance(node, ast.ImportFrom) and hops and (node.module or "").startswith("horovod"):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _definition(src, node.module, alias.name, hops - 1)
    return "unknown", ""


def _public_names(src: str, module: str) -> list[str]:
    tree = ast.parse(open(_source(src, module), encoding="utf-8").read())
    names: dict[str, None] = {}
    for node in _module_level(tree.body):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("horovod"):
            if node.module not in INTERNAL_SOURCES:
                names.update(dict.fromkeys(a.asname or a.name for a in node.names))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = None
    return [n for n in names if not n.startswith("_") and n not in INTERNAL_NAMES]


def _runner_flags(src: str) -> list[Row]:
    """horovodrun's flags from ``parse_args`` in horovod/runner/launch.py."""
    tree = ast.parse(open(os.path.join(src, "horovod", "runner", "launch.py"),
                          encoding="utf-8").read())
    parse_args = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                      and n.name == "parse_args")
    found = []
    for node in ast.walk(parse_args):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            spellings = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if spellings and spellings[0].startswith("-"):
                found.append((node.lineno, Row(RUNNER, " ".join(spellings), "flag", "")))
    return [row for _, row in sorted(found, key=lambda item: item[0])]


def extract(src: str) -> list[Row]:
    """Horovod's names and flags from its source tree, keeping the notes already written."""
    notes = {(row.module, row.name): row.note for row in read_names()} if os.path.exists(
        NAMES_FILE) else {}
    rows = []
    for module in MODULES:
        for name in _public_names(src, module):
            kind, parameters = _definition(src, module, name)
            rows.append(Row(module, name, kind, parameters))
    rows += _runner_flags(src)
    for row in rows:
        row.note = notes.get((row.module, row.name), "")
    return rows


def write_names(rows: list[Row]) -> None:
    with open(NAMES_FILE, "w", encoding="utf-8", newline="") as handle:
        handle.write("# Horovod 0.28.1's public names and horovodrun flags "
                     "(scripts/horovod_compatibility.py extract); notes by hand:\n"
                     "# 'differs: how' applies while hvd_sgp has the name, "
                     "'n/a: why' while it has not.\n")
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
        writer.writerow(FIELDS)
        for row in rows:
            writer.writerow([row.module, row.name, row.kind, row.parameters, row.note])


def read_names() -> list[Row]:
    with open(NAMES_FILE, encoding="utf-8") as handle:
        lines = [line for line in handle if not line.startswith("#")]
    return [Row(**record) for record in csv.DictReader(lines, delimiter="\t")]


# ---------------------------------------------------------------- render (run after every merge)

def _import(module: str):
    """The module, or the attribute a user reaches it by (``hvd.callbacks``); None if absent."""
    try:
        return importlib.import_module(module)
    except ImportError:
        parent, _, name = module.rpartition(".")
        return getattr(_import(parent), name, None) if parent else None


def _lacking(obj: object, parameters: str) -> list[str]:
    """Horovod's parameters that ``obj`` does not take (none when it takes **kwargs)."""
    wanted = [p for p in parameters.split(", ") if p]
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    taken = signature.parameters
    if any(p.kind is p.VAR_KEYWORD for p in taken.values()):
        return []
    return [p for p in wanted if p not in taken]


def name_verdict(row: Row, module: Optional[object]) -> tuple[str, str]:
    """(verdict, how or why) of one Horovod name against hvd_sgp's module (None: absent)."""
    kind, _, text = row.note.partition(":")
    kind, text = kind.strip(), text.strip()
    if module is None or not hasattr(module, row.name):
        return ("not applicable", text) if kind == "n/a" else ("missing", "")
    lacking = _lacking(getattr(module, row.name), row.parameters) if row.parameters else []
    how = [text] if kind == "differs" else []
    if lacking:
        how.append("no parameter " + ", ".join(f"`{p}`" for p in lacking))
    return ("differs", "; ".join(how)) if how else ("same", "")


def flag_verdict(row: Row, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """(verdict, how or why) of one horovodrun flag against sgprun."""
    from hvd_sgp.runner import horovod_flags

    spellings = row.name.split()
    for flag in horovod_flags.FLAGS:
        if set(spellings) & set(flag.spellings + flag.off):
            verdict = {"same": "same", "differs": "differs"}.get(flag.status, "not applicable")
            tag = {"ignored": "accepted, one warning: ", "refused": "exit 2: "}.get(flag.status, "")
            return verdict, tag + flag.note
    known = parser._option_string_actions  # the flags declared outside the table
    if all(s in known for s in spellings):
        return "same", known[spellings[0]].help or ""
    return "missing", ""


def render() -> str:
    from hvd_sgp.runner.launch import make_parser

    rows = read_names()
    modules = {name: _import(target) for name, target in MODULES.items()}
    parser = make_parser()
    results = []
    for row in rows:
        if row.module == RUNNER:
            results.append((row, *flag_verdict(row, parser)))
        else:
            results.append((row, *name_verdict(row, modules[row.module])))
    counts = Counter(verdict for _, verdict, _ in results)
    lines = [
        "# Horovod compatibility",
        "",
        "Generated by `python scripts/horovod_compatibility.py --write` from Horovod 0.28.1's "
        "names (`docs/horovod_names_0.28.1.tsv`) against this tree's hvd_sgp; re-run it when "
        "names land. **same**: hvd_sgp has it, with all of Horovod's parameters, meant to "
        "behave as Horovod's (how far it does: Horovod's own tests at the end); **differs**: "
        "it has it, with the difference given; **not applicable**: it has no meaning under SGP "
        "(why given); **missing**: not there yet.",
        "",
        f"**{len(results)} names and flags: " + ", ".join(
            f"{counts[v]} {v}" for v in VERDICTS) + ".**",
        "",
    ]
    for module in [*MODULES, RUNNER]:
        chosen = [r for r in results if r[0].module == module]
        if not chosen:
            continue
        tally = Counter(verdict for _, verdict, _ in chosen)
        target = MODULES.get(module, "sgprun")
        lines += [f"## `{module}` → `{target}`", "",
                  ", ".join(f"{tally[v]} {v}" for v in VERDICTS if tally[v]), "",
                  "| name | verdict | how / why |", "| --- | --- | --- |"]
        for row, verdict, text in chosen:
            shown = " ".join(f"`{s}`" for s in row.name.split())
            lines.append(f"| {shown} | {verdict} | {text.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines + CHECKPOINTS + _suite_section())


# The checkpoint contract (hvd_sgp/common/checkpoint.py), what each style restores.
CHECKPOINTS = [
    "## Checkpoints", "",
    "An SGP optimizer's state beyond the wrapped optimizer's is of two kinds. **Shared** by "
    "every rank in step: the iteration (the graph's position, the schedule's stage), the "
    "epoch and SlowMo's outer state (taken on exactly averaged models). **Per rank**: the "
    "PushSum weights, int8/top-k gossip's public copies (error feedback lives in them) and "
    "random-k's run weights; they are exact only with the same rank's parameters and its "
    "peers' per-rank state. `optimizer.state_dict()` (torch) carries both under the key "
    "`\"hvd_sgp\"`, as tensors and plain numbers (`torch.load`'s default `weights_only` "
    "reads it), with the rank, the world size and whether anything was in flight. It is "
    "local: Horovod's examples call it on rank 0 alone.", "",
    "| style | what a user does | what it restores |",
    "| --- | --- | --- |",
    "| rank-0 checkpoint (Horovod's) | rank 0 saves `model.state_dict()` and "
    "`optimizer.state_dict()`; to resume, rank 0 loads both, then every rank calls "
    "`broadcast_parameters(model.state_dict(), 0)` and `broadcast_optimizer_state(optimizer, "
    "0)` | rank 0's model and wrapped-optimizer state on every rank, rank 0's shared SGP "
    "state; per-rank state afresh on every rank (weight 1, copies reopened by the next "
    "exact message): the state of a consensus. In one SGP node (no gossip) and in "
    "`mode='allreduce'` the resumed run equals the uninterrupted one. A plain torch or real "
    "Horovod checkpoint (no `\"hvd_sgp\"` entry) loads the same way, at the iteration the "
    "optimizer stands at |",
    "| per-rank checkpoints | every rank saves and loads its own `optimizer.state_dict()` "
    "(and model) | everything, exactly: a run resumed from them equals the uninterrupted one. "
    "Only where every rank loads its own state of the same world with nothing in flight "
    "(Overlap SGP in nodes of several ranks: call `synchronize_gossip()` on every rank "
    "before saving); otherwise every rank keeps the shared part and starts its per-rank "
    "state afresh (e.g. rank 0's file loaded on every rank, or a world of another size) |",
    "| elastic state (`hvd.elastic.TorchState`, `KerasState`) | `state.commit()`; after a "
    "lost rank `hvd.elastic.run` restores the last commit and syncs from rank 0 | the "
    "commit's model and optimizer, synced from rank 0 as in the first style (rank 0's "
    "iteration, weight 1 everywhere); a replacement rank starts in step with the "
    "survivors |", "",
    "Ranks whose loaded state puts them at different iterations (a checkpoint loaded on some "
    "ranks without the broadcasts, or per-rank files of different steps) are found at their "
    "first step: every rank raises `ConsistencyError` naming each rank's iteration, at once. "
    "The check is one small allgather at the first step after an optimizer starts or loads "
    "state, never on other steps. A rank that loads alone into an optimizer that already "
    "stepped waits in that allgather for ranks that never join it: it asks every rank "
    "what it does each second (the watchdog's roll call) and, once one has been inside "
    "another part of the same optimizer's step for 2 s, raises `ConsistencyError` naming "
    "each rank's iteration, and the other ranks end with the same message: 2.4 s after the "
    "load at 4 ranks in each layout (tests/test_stall.py), instead of at `HVD_SGP_TIMEOUT`. "
    "(In fault-tolerant mode there is no roll call: the timeout stays.) "
    "Optimizers can be rebuilt at any time "
    "(every rank at the same point, as Horovod requires): a dropped one closes once it is "
    "collected, at the next step of any optimizer (never inside the collection, which may "
    "run inside an MPI call: hvd_sgp/common/finalizers.py), and several can train side by "
    "side, each with its own iteration. An LR "
    "scheduler's `state_dict()` saves and loads as under Horovod (`broadcast_object` it "
    "from rank 0). Keras: `hvd.load_model` on rank 0 with `initial_epoch` and "
    "`BroadcastGlobalVariablesCallback(0)`, as Horovod's `keras_imagenet_resnet50.py` "
    "(Keras 3 and tf_keras): the callback broadcasts rank 0's model and optimizer variables "
    "(the step count with them) before the first step where every rank's optimizer is built, "
    "else after it, the ranks agreeing which; where only rank 0's is built (it resumes), the "
    "others build theirs at train begin, so the broadcast comes first. The SGP iteration "
    "starts at the optimizer's step count (`iterations`, saved with the model): a resumed "
    "`fit` follows the schedule (and a time-varying graph) as the uninterrupted one; the "
    "per-rank SGP state starts afresh. Horovod's own `pytorch_imagenet_resnet50.py` resumes "
    "unmodified (tests/test_elastic.py, given a Horovod checkout); its "
    "`keras_imagenet_resnet50.py` is TensorFlow 1 code (`tf.ConfigProto`, `tf.Session`) and "
    "does not run on TensorFlow 2.", "",
]


def _suite_section() -> list[str]:
    """Horovod's test_torch.py on hvd_sgp.torch, from the runner's last recorded results."""
    if not os.path.exists(SUITE_FILE):
        return []
    with open(SUITE_FILE, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    runs = [line[2:] for line in lines[1:] if line.startswith("# ")]
    verdicts: dict[str, dict[str, tuple[str, str]]] = {}
    for line in lines:
        if not line.startswith("#"):
            layout, test, verdict, reason = (line.split("\t") + [""])[:4]
            verdicts.setdefault(test, {})[layout] = (verdict, reason)
    layouts = sorted({layout for by_layout in verdicts.values() for layout in by_layout},
                     key=lambda name: name != "default")
    out = ["## Horovod's own test_torch.py", "",
           "Horovod 0.28.1's `test/parallel/test_torch.py` run against `hvd_sgp.torch` by "
           "`scripts/horovod_suite.py --results docs/horovod_suite_results.tsv` (2 ranks; "
           "`default`: all ranks of the machine form one node, exact averaging; `gossip`: "
           "`HVD_SGP_LOCAL_SIZE=1`, every rank its own SGP node). Last recorded run:", ""]
    out += [f"- {run}" for run in runs]
    out += ["", "Every test that does not pass in some layout, with its first error:", "",
            "| test | " + " | ".join(layouts) + " | first error |",
            "| --- | " + " | ".join("---" for _ in layouts) + " | --- |"]
    for test, by_layout in verdicts.items():
        if all(by_layout.get(layout, ("PASS",))[0] in ("PASS", "SKIP") for layout in layouts):
            continue
        reason = next((by_layout[l][1] for l in layouts if l in by_layout and by_layout[l][1]
                       and by_layout[l][0] not in ("PASS", "SKIP")), "")
        cells = " | ".join(by_layout.get(layout, ("-",))[0] for layout in layouts)
        out.append(f"| `{test}` | {cells} | {reason.replace('|', '/')} |")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC_FILE}")
    commands = parser.add_subparsers(dest="command")
    source = commands.add_parser("extract", help="refresh the names file from Horovod's source")
    source.add_argument("src", help="a Horovod 0.28.1 source tree (with horovod/ inside)")
    args = parser.parse_args(argv)
    if args.command == "extract":
        rows = extract(args.src)
        write_names(rows)
        print(f"{len(rows)} names and flags written to {NAMES_FILE}")
        return 0
    text = render()
    if args.write:
        with open(DOC_FILE, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        print(f"wrote {DOC_FILE}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
