"""sgprun: the command it builds and the requests it refuses (no MPI), then real launches."""
from __future__ import annotations

import dataclasses
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from hvd_sgp.runner import launch
from hvd_sgp.runner.launch import Host, LaunchError, Site

OPEN_MPI_5 = Site("/venv/bin/mpirun", "openmpi", 5, cores=4, euid=1000)
HYDRA = Site("/usr/bin/mpiexec", "mpich", 0, cores=4, euid=1000)
SRUN = Site("/usr/bin/srun", "srun", 0, cores=4, euid=1000)
BASE_ENV = {"PATH": "/venv/bin:/usr/bin", "HOME": "/root", "HOROVOD_FUSION_THRESHOLD": "0"}


def command(argv: list[str], site: Site = OPEN_MPI_5, env: dict | None = None) -> list[str]:
    return launch.build_command(launch.parse_args(argv), BASE_ENV if env is None else env, site)


def flag_value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


# ---------------------------------------------------------------- hosts and hostfiles

def test_parse_hosts_with_and_without_slots():
    assert launch.parse_hosts("a:4, b ,c:1") == [Host("a", 4), Host("b", 1), Host("c", 1)]


@pytest.mark.parametrize("spec", ["", "a:", "a:0", "a:x", "a,,b", "a:2:3", "a b:2"])
def test_parse_hosts_rejects_malformed_entries(spec):
    with pytest.raises(ValueError, match="malformed"):
        launch.parse_hosts(spec)


def test_hostfile_accepts_open_mpi_and_mpich_syntax(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=4\n\nnode2:2   # comment\nnode3\n")
    assert launch.read_hostfile(str(path)) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


@pytest.mark.parametrize("text", ["node1 slots=x\n", "node1 4\n", "node1 slots=0\n",
                                  "node1:2 slots=2\n", "# nothing\n"])
def test_hostfile_rejects_bad_lines_and_empty_files(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError, match="malformed|names no hosts"):
        launch.read_hostfile(str(path))


def test_missing_hostfile_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.parse_args(["-np", "2", "--hostfile", str(tmp_path / "none"), "python"])
    assert exit_info.value.code == 2
    assert "not found" in capsys.readouterr().err


# ---------------------------------------------------------------- flags

@pytest.mark.parametrize("argv", [
    ["-np", "0", "python"],
    ["-np", "two", "python"],
    ["-np", "2", "--topology", "star", "python"],
    ["-np", "2", "--peers", "0", "python"],
    ["-np", "2", "--max-delay", "0", "python"],
    ["-np", "2", "--timeout", "-1", "python"],
    ["-np", "2", "--log-level", "loud", "python"],
    ["-np", "2", "-H", "a:x", "python"],
    ["-np", "2", "-H", "a:1", "--hostfile", "f", "python"],
    ["-np", "2", "--launcher", "ssh", "python"],
    ["-np", "2", "--no-such-flag", "python"],
])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.parse_args(argv)
    assert exit_info.value.code == 2
    assert "sgprun: error:" in capsys.readouterr().err


def test_program_arguments_are_left_alone():
    args = launch.parse_args(["-np", "2", "python", "train.py", "-np", "9", "--peers", "3"])
    assert args.np == 2 and args.peers is None
    assert args.command == ["python", "train.py", "-np", "9", "--peers", "3"]
    assert launch.parse_args(["-np", "2", "--", "python"]).command == ["python"]


def test_launcher_imports_the_core_without_loading_mpi():
    """The launcher, the options table and topologies load no MPI library at all; the runtime
    loads it without starting it."""
    import subprocess, sys
    code = ("import sys, hvd_sgp.runner.launch, hvd_sgp.common, hvd_sgp.common.options, "
            "hvd_sgp.common.topology; assert 'mpi4py.MPI' not in sys.modules, 'loaded'; "
            "from hvd_sgp.common import runtime; from mpi4py import MPI; "
            "assert not MPI.Is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------- validation before launch

def test_too_few_slots_is_refused():
    args = launch.parse_args(["-np", "5", "-H", "localhost:2,127.0.0.1:2", "python"])
    with pytest.raises(LaunchError, match="more than the 4 slots"):
        launch.validate(args)


def test_unresolvable_host_is_refused_without_connecting():
    looked_up = []

    def resolve(name: str) -> str:
        looked_up.append(name)
        if name == "ghost":
            raise socket.gaierror(-2, "Name or service not known")
        return "10.0.0.1"

    args = launch.parse_args(["-np", "3", "-H", "localhost:1,good:1,ghost:1", "python"])
    with pytest.raises(LaunchError, match="'ghost' cannot be resolved"):
        launch.validate(args, resolve=resolve)
    assert looked_up == ["good", "ghost"]  # local names are never looked up


def test_missing_program_and_np_are_refused():
    with pytest.raises(LaunchError, match="no program"):
        launch.validate(launch.parse_args(["-np", "2"]))
    with pytest.raises(LaunchError, match="-np is required"):
        launch.validate(launch.parse_args(["python"]))


def test_main_exits_2_before_starting_anything(capsys):
    assert launch.main(["-np", "3", "-H", "localhost:2", "python", "-c", "pass"]) == 2
    assert "sgprun: error: -np 3 is more than the 2 slots" in capsys.readouterr().err


# ---------------------------------------------------------------- which MPI

@pytest.mark.parametrize("text, expected", [
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to ...", ("openmpi", 5)),
    ("mpirun (Open MPI) 4.1.2\n", ("openmpi", 4)),
    ("HYDRA build details:\n    Version:  4.1.2\n", ("mpich", 0)),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", ("mpich", 0)),
])
def test_mpi_flavour(text, expected):
    assert launch.mpi_flavour(text) == expected


def test_unknown_mpi_is_refused():
    with pytest.raises(LaunchError, match="cannot tell which MPI"):
        launch.mpi_flavour("some launcher 1.0")


def _fake_tool(directory, name: str, version_text: str) -> str:
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{version_text}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_slurm_job_uses_srun_unless_an_mpirun_is_named(tmp_path):
    _fake_tool(tmp_path, "srun", "slurm 23.02")
    mpiexec = _fake_tool(tmp_path, "mpiexec", "HYDRA build details:")
    env = {"PATH": str(tmp_path), "SLURM_JOB_ID": "42"}
    site = launch.detect_site(launch.parse_args(["-np", "2", "python"]), env)
    assert (site.flavour, site.launcher) == ("srun", str(tmp_path / "srun"))
    site = launch.detect_site(launch.parse_args(["-np", "2", "--mpi-launcher", mpiexec, "x"]), env)
    assert (site.flavour, site.launcher) == ("mpich", mpiexec)


def test_srun_asked_but_absent_is_refused(tmp_path):
    args = launch.parse_args(["-np", "2", "--launcher", "srun", "python"])
    with pytest.raises(LaunchError, match="srun"):
        launch.detect_site(args, {"PATH": str(tmp_path)})


# ---------------------------------------------------------------- Open MPI command

def test_open_mpi_command_binds_maps_and_forwards_like_horovodrun():
    cmd = command(["-np", "2", "--topology", "ring", "--peers", "2", "--overlap",
                   "--max-delay", "3", "--schedule", "warmup=1", "--timeout", "30",
                   "--timeline-filename", "/tmp/t.json", "python", "train.py", "--lr", "0.1"])
    assert cmd[:3] == ["/venv/bin/mpirun", "-np", "2"]
    assert "--bind-to none --map-by slot" in " ".join(cmd)
    assert cmd[-4:] == ["python", "train.py", "--lr", "0.1"]
    exported = {cmd[i + 1] for i, word in enumerate(cmd) if word == "-x"}
    assert exported == {"PATH", "HOROVOD_FUSION_THRESHOLD", "HVD_SGP_TOPOLOGY", "HVD_SGP_PEERS",
                        "HVD_SGP_OVERLAP", "HVD_SGP_MAX_DELAY", "HVD_SGP_SCHEDULE",
                        "HVD_SGP_TIMEOUT", "HVD_SGP_TIMELINE"}
    assert "--oversubscribe" not in cmd and "-H" not in cmd


def test_sgp_choices_reach_the_job_environment():
    args = launch.parse_args(["-np", "2", "--topology", "Exponential", "--peers", "1",
                              "--no-overlap", "--max-delay", "1", "--timeout", "2.5",
                              "--timeline-filename", "tl.json", "--start-timeout", "60",
                              "--log-level", "debug", "--network-interface", "eth1",
                              "--mode", "dpsgd", "--no-push-sum", "--local-size", "1",
                              "--metrics", "m.jsonl", "--metrics-every", "5", "x"])
    env = launch.job_environment(args, BASE_ENV, OPEN_MPI_5)
    assert {k: v for k, v in env.items() if k.startswith("HVD_SGP_")} == {
        "HVD_SGP_TOPOLOGY": "exponential", "HVD_SGP_PEERS": "1", "HVD_SGP_OVERLAP": "0",
        "HVD_SGP_MAX_DELAY": "1", "HVD_SGP_TIMEOUT": "2.5", "HVD_SGP_TIMELINE": "tl.json",
        "HVD_SGP_MODE": "dpsgd",
        "HVD_SGP_PUSH_SUM": "0", "HVD_SGP_LOCAL_SIZE": "1", "HVD_SGP_METRICS": "m.jsonl",
        "HVD_SGP_METRICS_EVERY": "5"}
    assert env["NCCL_SOCKET_IFNAME"] == "eth1" and env["HOME"] == "/root"
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in env


def test_root_gets_open_mpi_consent_only_for_open_mpi():
    args = launch.parse_args(["-np", "2", "x"])
    as_root = launch.job_environment(args, BASE_ENV, dataclasses.replace(OPEN_MPI_5, euid=0))
    assert as_root["OMPI_ALLOW_RUN_AS_ROOT"] == as_root["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    hydra_root = launch.job_environment(args, BASE_ENV, dataclasses.replace(HYDRA, euid=0))
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in hydra_root


def test_oversubscribe_only_past_local_cores_without_hosts():
    assert "--oversubscribe" in command(["-np", "5", "x"])
    assert "--oversubscribe" not in command(["-np", "4", "x"])
    cmd = command(["-np", "6", "-H", "a:4,b:2", "x"])
    assert "--oversubscribe" not in cmd and flag_value(cmd, "-H") == "a:4,b:2"


def test_hostfile_goes_to_the_launcher_as_a_host_list(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb:2\n")
    assert flag_value(command(["-np", "4", "--hostfile", str(path), "x"]), "-H") == "a:2,b:2"
    assert flag_value(command(["-np", "4", "--hostfile", str(path), "x"], HYDRA),
                      "-hosts") == "a:2,b:2"


def test_ssh_port_network_interface_output_and_mpi_args():
    cmd = command(["-np", "2", "-p", "2222", "--network-interface", "eth0",
                   "--output-filename", "logs/run", "--mpi-args", "--mca pml ucx -x 'A=b c'",
                   "x"])
    text = " ".join(cmd)
    assert "--mca plm_ssh_args -p 2222" in text
    assert "--mca btl_tcp_if_include eth0" in text
    assert flag_value(cmd, "--output-filename") == "logs/run"
    assert cmd[-6:] == ["--mca", "pml", "ucx", "-x", "A=b c", "x"]
    open_mpi_4 = Site("/m", "openmpi", 4, 4, 1000)
    assert "plm_rsh_args" in command(["-np", "2", "-p", "2222", "x"], open_mpi_4)


# ---------------------------------------------------------------- MPICH hydra and srun

def test_hydra_command_uses_hydra_flags():
    cmd = command(["-np", "4", "-H", "a:2,b:2", "--network-interface", "ib0", "--peers", "2",
                   "--output-filename", "out/r", "python", "t.py"], HYDRA)
    assert cmd[:3] == ["/usr/bin/mpiexec", "-n", "4"]
    assert flag_value(cmd, "-hosts") == "a:2,b:2" and flag_value(cmd, "-iface") == "ib0"
    assert flag_value(cmd, "-genvlist").split(",") == ["HOROVOD_FUSION_THRESHOLD",
                                                       "HVD_SGP_PEERS", "NCCL_SOCKET_IFNAME",
                                                       "PATH"]
    assert flag_value(cmd, "-outfile-pattern") == "out/r.%r.out"
    assert "-x" not in cmd and "--bind-to" not in cmd and cmd[-2:] == ["python", "t.py"]


def test_hydra_refuses_ssh_port():
    with pytest.raises(LaunchError, match="ssh"):
        command(["-np", "2", "-p", "22", "x"], HYDRA)


def test_srun_command():
    cmd = command(["-np", "8", "-H", "n1:4,n2:4", "--mpi-args=--mpi=pmix", "python", "t.py"],
                  SRUN)
    assert cmd == ["/usr/bin/srun", "--ntasks=8", "--cpu-bind=none", "--kill-on-bad-exit=1",
                   "--nodelist=n1,n2", "--mpi=pmix", "python", "t.py"]


def test_signals_map_to_128_plus_n():
    assert [launch.exit_status(code) for code in (0, 3, -9, -15)] == [0, 3, 137, 143]


# ---------------------------------------------------------------- real launches

SGPRUN = os.path.join(os.path.dirname(sys.executable), "sgprun")

PROBE = textwrap.dedent("""
    import os, sys
    from hvd_sgp.common import options, runtime
    runtime.init()
    sgp = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("HVD_SGP_"))
    print(f"rank {runtime.rank()} of {runtime.size()}:", " ".join(sgp), flush=True)
    chosen = options.resolve()  # the core accepts what sgprun passed
    print("options", chosen.topology, chosen.peers, chosen.overlap, chosen.max_delay,
          chosen.timeout, flush=True)
    if runtime.rank() == 1 and len(sys.argv) > 1:
        sys.exit(int(sys.argv[1]))
""")


def run_sgprun(argv: list[str], timeout: float = 120,
               extra_env: dict | None = None) -> subprocess.CompletedProcess:
    # As a user would start it: without Open MPI's root consent (sgprun must add it).
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env.update(extra_env or {})
    return subprocess.run([SGPRUN, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return str(path)


def test_sgprun_launches_two_ranks_with_the_sgp_environment(probe):
    result = run_sgprun(["-np", "2", "--topology", "ring", "--peers", "1", "--no-overlap",
                         "--max-delay", "2", "--timeout", "30", "--timeline-filename", "tl.json",
                         sys.executable, probe])
    assert result.returncode == 0, result.stderr
    expected = ("HVD_SGP_MAX_DELAY=2 HVD_SGP_OVERLAP=0 HVD_SGP_PEERS=1 HVD_SGP_TIMELINE=tl.json "
                "HVD_SGP_TIMEOUT=30.0 HVD_SGP_TOPOLOGY=ring")
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank 0 of 2: {expected}", f"rank 1 of 2: {expected}"]
    assert result.stdout.count("options ring 1 False 2 30.0") == 2


def test_sgprun_fails_when_one_rank_fails(probe):
    result = run_sgprun(["-np", "2", sys.executable, probe, "3"])
    assert result.returncode == 3, result.stderr  # mpirun reports the first failed status


def test_check_build_reports_mpi_and_frameworks():
    result = run_sgprun(["--check-build"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    from hvd_sgp.version import __version__

    assert out.startswith(f"hvd_sgp {__version__}")
    assert "[X] MPI: " in out and "MPI_THREAD_MULTIPLE" in out and "CUDA-aware MPI" in out
    for line in ("PyTorch", "TensorFlow", "Horovod", "NCCL"):
        assert f"] {line}" in out
    for forced, mark in (("1", "[X]"), ("0", "[ ]")):  # the override beats MPI's answer
        forced_out = run_sgprun(["--check-build"], extra_env={"HVD_SGP_CUDA_AWARE": forced})
        assert f"{mark} CUDA-aware MPI" in forced_out.stdout, forced_out.stdout
