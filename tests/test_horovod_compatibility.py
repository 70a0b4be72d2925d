"""scripts/horovod_compatibility.py: the verdict rules of docs/horovod_compatibility.md, and
every horovodrun flag of Horovod 0.28.1 known to sgprun (the elastic ones come with the
fault-tolerance launcher)."""
import importlib.util
import os
import sys
import types

import pytest

from hvd_sgp.runner.launch import make_parser

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "horovod_compatibility.py")
ELASTIC = {"--min-np", "--max-np", "--slots-per-host", "--elastic-timeout", "--reset-limit",
           "--blacklist-cooldown-range", "--host-discovery-script"}


@pytest.fixture(scope="module")
def compat():
    spec = importlib.util.spec_from_file_location("horovod_compatibility", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def allreduce(tensor, average=None, name=None, op=None):
    return tensor


def test_name_verdicts(compat):
    Row = compat.Row
    module = types.SimpleNamespace(allreduce=allreduce, flexible=lambda tensor, **kwargs: tensor)
    full = Row("horovod.torch", "allreduce", "function", "tensor, average, name, op")
    assert compat.name_verdict(full, module) == ("same", "")
    wider = Row("horovod.torch", "allreduce", "function", "tensor, name, process_set, op")
    assert compat.name_verdict(wider, module) == ("differs", "no parameter `process_set`")
    noted = Row("horovod.torch", "allreduce", "function", "tensor", "differs: gossips")
    assert compat.name_verdict(noted, module) == ("differs", "gossips")
    kwargs = Row("horovod.torch", "flexible", "function", "tensor, process_set")
    assert compat.name_verdict(kwargs, module) == ("same", "")  # **kwargs may take it
    absent = Row("horovod.torch", "ddl_built", "function", "")
    assert compat.name_verdict(absent, module) == ("missing", "")
    na = Row("horovod.tensorflow", "BroadcastGlobalVariablesHook", "class", "", "n/a: TF1 only")
    assert compat.name_verdict(na, module) == ("not applicable", "TF1 only")
    assert compat.name_verdict(full, None) == ("missing", "")  # the module itself is absent


def test_every_horovodrun_flag_has_a_verdict(compat):
    parser = make_parser()
    rows = [row for row in compat.read_names() if row.module == compat.RUNNER]
    assert len(rows) == 61
    verdicts = {row.name: compat.flag_verdict(row, parser) for row in rows}
    for name, (verdict, how) in verdicts.items():
        if set(name.split()) & ELASTIC:
            continue
        assert verdict in ("same", "differs", "not applicable") and how, (name, verdict)
    assert verdicts["--fusion-threshold-mb"][0] == "not applicable"
    assert verdicts["--gloo"] == ("not applicable", "exit 2: hvd_sgp runs over MPI only: drop "
                                                    "--gloo (or use --mpi)")
    assert verdicts["--stall-check-warning-time-seconds"] == ("same",
                                                              "HOROVOD_STALL_CHECK_TIME_SECONDS")


def test_names_file_lists_each_module_of_horovod(compat):
    rows = compat.read_names()
    assert {row.module for row in rows} == {*compat.MODULES, compat.RUNNER}
    names = {(row.module, row.name) for row in rows}
    assert ("horovod.torch", "DistributedOptimizer") in names
    assert ("horovod.tensorflow.keras.callbacks", "BroadcastGlobalVariablesCallback") in names
    assert ("horovod.torch.elastic", "TorchState") in names
    assert all(row.note.split(":")[0] in ("", "differs", "n/a") for row in rows)
