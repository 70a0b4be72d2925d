"""What hvd_sgp/common's source must show: its layers stay layers (the import graph, module-level
imports, those under ``if TYPE_CHECKING`` left out, has no cycle and at most 8 levels:
docs/architecture.md), and no reduction goes through mpi4py's object methods (mpi.py)."""
import ast
from pathlib import Path

COMMON = Path(__file__).resolve().parent.parent / "hvd_sgp" / "common"
MAX_LEVELS = 8


def modules() -> dict[str, Path]:
    found = {}
    for path in COMMON.rglob("*.py"):
        parts = path.relative_to(COMMON.parent.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: set) -> set:
    """The modules of ``known`` that ``path`` imports when it is imported."""
    found, body = set(), list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + [n for h in getattr(node, "handlers", [])
                                               for n in h.body]
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & known


def graph() -> dict[str, set]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_common_has_no_cycle_and_at_most_8_levels():
    edges, levels, visiting = graph(), {}, []

    def level(name: str) -> int:
        assert name not in visiting, f"import cycle: {' -> '.join(visiting + [name])}"
        if name not in levels:
            visiting.append(name)
            levels[name] = 1 + max((level(d) for d in edges[name]), default=0)
            visiting.pop()
        return levels[name]

    deepest = max(edges, key=level)
    assert levels[deepest] <= MAX_LEVELS, (deepest, levels[deepest])


def test_the_graph_sees_imports():
    """The scanner itself: the engine imports the transport, TYPE_CHECKING imports are left out
    (checkpoint imports the engine only for its annotations)."""
    edges = graph()
    assert "hvd_sgp.common.transport" in edges["hvd_sgp.common.engine"]
    assert "hvd_sgp.common.engine" not in edges["hvd_sgp.common.checkpoint"]


OBJECT_REDUCTIONS = {"allreduce", "reduce", "scan", "exscan"}
NOT_A_COMMUNICATOR = ("np.", "collectives")  # numpy's ufunc.reduce, the Horovod-API arrays


def object_reductions(source: str) -> list[str]:
    """Calls ``x.allreduce(...)`` and its kin whose ``x`` may be a communicator."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in OBJECT_REDUCTIONS
                and not ast.unparse(node.func.value).startswith(NOT_A_COMMUNICATOR)):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_common_reduces_with_mpi_collectives_a_revoke_reaches():
    """mpi4py's comm.allreduce runs point to point on a private duplicate that ULFM's revoke
    does not reach: a survivor can wait in it for ever (hvd_sgp/common/mpi.py)."""
    assert object_reductions("world.allreduce(steps, op=MPI.MAX)\nnp.add.reduce(x)\n"
                             "collectives.allreduce(flag)\ncross.scan(1)") == [
        "line 1: world.allreduce", "line 4: cross.scan"]
    found = {path.name: object_reductions(path.read_text()) for path in modules().values()}
    assert not {name: calls for name, calls in found.items() if calls}
