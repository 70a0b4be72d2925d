"""sgprun: the command it builds and the requests it refuses (no MPI), then real launches."""
from __future__ import annotations

import dataclasses
import json
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


# ---------------------------------------------------------------- every horovodrun flag

HOROVOD_FLAGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "horovod_names_0.28.1.tsv")
# The fault-tolerance launcher declares these (min/max processes, discovery, elastic timing).
ELASTIC = {"--min-np", "--min-num-proc", "--max-np", "--max-num-proc", "--elastic-timeout",
           "--reset-limit", "--blacklist-cooldown-range", "--host-discovery-script"}
# A value horovodrun accepts for each flag that takes one.
SAMPLE = {"-np": "2", "--num-proc": "2", "--start-timeout": "30", "--network-interfaces": "eth0",
          "--network-interface": "eth0", "--output-filename": "out/r", "--config-file": None,
          "-p": "22", "--ssh-port": "22", "-i": "key", "--ssh-identity-file": "key",
          "--fusion-threshold-mb": "64", "--cycle-time-ms": "2.5", "--cache-capacity": "1024",
          "--autotune-log-file": "t.csv", "--autotune-warmup-samples": "3",
          "--autotune-steps-per-sample": "10", "--autotune-bayes-opt-max-samples": "20",
          "--autotune-gaussian-process-noise": "0.8", "--slots-per-host": "4",
          "--timeline-filename": "tl.json", "--stall-check-warning-time-seconds": "60",
          "--stall-check-shutdown-time-seconds": "120", "--mpi-args": "--mca x y",
          "--binding-args": "--bind-to core", "--num-nccl-streams": "2", "--thread-affinity": "0",
          "--gloo-timeout-seconds": "30", "--log-level": "INFO", "-H": "localhost:2",
          "--hosts": "localhost:2", "-hostfile": None, "--hostfile": None}


def horovodrun_spellings() -> list[str]:
    with open(HOROVOD_FLAGS, encoding="utf-8") as handle:
        rows = [line.split("\t") for line in handle if line.startswith("horovodrun\t")]
    return [spelling for row in rows for spelling in row[1].split()]


def test_the_sample_covers_horovodrun_0_28_1():
    spellings = horovodrun_spellings()
    assert len(spellings) == 71 and "--binding-args" in spellings
    takes_value = {s for s in spellings if s in SAMPLE}
    assert set(SAMPLE) == takes_value


@pytest.mark.parametrize("spelling", [s for s in horovodrun_spellings()
                                      if s not in ELASTIC | {"-v", "--version"}])
def test_sgprun_accepts_every_horovodrun_flag(spelling, tmp_path):
    argv = ["-np", "2", spelling] if spelling not in ("-np", "--num-proc") else [spelling]
    if spelling in SAMPLE:
        value = SAMPLE[spelling]
        if value is None:  # a file horovodrun reads
            path = tmp_path / "file"
            path.write_text("localhost slots=2\n" if "host" in spelling else "")
            value = str(path)
        argv.append(value)
    if spelling == "--config-file":
        pytest.importorskip("yaml")
    args = launch.parse_args([*argv, "python", "train.py"])
    assert args.command == ["python", "train.py"]


def test_horovodrun_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.parse_args(["--version"])
    assert exit_info.value.code == 0 and "hvd_sgp" in capsys.readouterr().out


def test_each_flag_is_declared_once_with_a_known_status():
    from hvd_sgp.runner import horovod_flags

    spellings = [s for f in horovod_flags.FLAGS for s in f.spellings + f.off]
    assert len(spellings) == len(set(spellings))
    assert {f.status for f in horovod_flags.FLAGS} == {"same", "differs", "ignored", "refused"}
    assert all(f.note for f in horovod_flags.FLAGS)


@pytest.mark.parametrize("argv", [
    ["--gloo", "--mpi"],  # one controller, as in horovodrun
    ["--hierarchical-allreduce", "--no-hierarchical-allreduce"],
    ["--log-without-timestamp", "-prefix-timestamp"],
    ["--fusion-threshold-mb", "-1"],
    ["--cycle-time-ms", "fast"],
    ["--autotune-gaussian-process-noise", "1.5"],
    ["--stall-check-warning-time-seconds", "0"],
    ["--stall-check-shutdown-time-seconds", "soon"],
    ["--num-nccl-streams", "x"],
])
def test_bad_horovodrun_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.parse_args(["-np", "2", *argv, "python"])
    assert exit_info.value.code == 2
    assert "sgprun: error:" in capsys.readouterr().err


def test_stall_check_flags_reach_the_collectives():
    args = launch.parse_args(["-np", "2", "--no-stall-check", "--stall-check-warning-time-seconds",
                              "30", "--stall-check-shutdown-time-seconds", "90", "x"])
    env = launch.job_environment(args, BASE_ENV, OPEN_MPI_5)
    assert (env["HOROVOD_STALL_CHECK_DISABLE"], env["HOROVOD_STALL_CHECK_TIME_SECONDS"],
            env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"]) == ("1", "30", "90")
    assert env["HVD_SGP_TIMEOUT"] == "90.0"  # the shutdown time bounds every wait
    on = launch.job_environment(launch.parse_args(["-np", "2", "--stall-check", "x"]),
                                BASE_ENV, OPEN_MPI_5)
    assert on["HOROVOD_STALL_CHECK_DISABLE"] == "0" and "HVD_SGP_TIMEOUT" not in on


@pytest.mark.parametrize("argv, env, timeout", [
    (["--stall-check-shutdown-time-seconds", "90", "--timeout", "20"], {}, "20.0"),  # flag wins
    (["--stall-check-shutdown-time-seconds", "90"], {"HVD_SGP_TIMEOUT": "7"}, "7"),  # so does env
    (["--stall-check-shutdown-time-seconds", "0"], {}, None),  # 0: Horovod never shuts down
    (["--stall-check-shutdown-time-seconds", "50"], {}, None),  # not past the 60 s warning
    (["--stall-check-warning-time-seconds", "10", "--stall-check-shutdown-time-seconds", "50"],
     {}, "50.0"),
])
def test_stall_shutdown_sets_the_deadline_only_when_none_is_given(argv, env, timeout):
    args = launch.parse_args(["-np", "2", *argv, "x"])
    job = launch.job_environment(args, {**BASE_ENV, **env}, OPEN_MPI_5)
    assert job.get("HVD_SGP_TIMEOUT") == timeout


def test_timeline_tcp_and_interfaces_like_horovodrun():
    cmd = command(["-np", "2", "--timeline-filename", "tl.json", "--timeline-mark-cycles",
                   "--tcp", "--network-interface", "eth0", "--network-interfaces", "eth1,eth0",
                   "x"])
    exported = {cmd[i + 1] for i, word in enumerate(cmd) if word == "-x"}
    assert {"HVD_SGP_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES", "NCCL_IB_DISABLE",
            "NCCL_SOCKET_IFNAME"} <= exported
    text = " ".join(cmd)
    assert "--mca btl_tcp_if_include eth0,eth1" in text
    assert "--mca pml ob1 --mca btl self,sm,tcp" in text
    open_mpi_4 = Site("/m", "openmpi", 4, 4, 1000)
    assert "btl self,vader,tcp" in " ".join(command(["-np", "2", "--tcp", "x"], open_mpi_4))
    args = launch.parse_args(["-np", "2", "--no-timeline-mark-cycles", "--tcp", "x"])
    env = launch.job_environment(args, BASE_ENV, OPEN_MPI_5)
    assert env["HOROVOD_TIMELINE_MARK_CYCLES"] == "0" and env["NCCL_IB_DISABLE"] == "1"


def test_binding_ssh_identity_and_timestamps_reach_the_launcher():
    cmd = command(["-np", "2", "--binding-args=--bind-to core --map-by socket", "-p", "2222",
                   "-i", "/keys/id rsa", "-prefix-timestamp", "x"])
    assert cmd[1:7] == ["-np", "2", "--bind-to", "core", "--map-by", "socket"]
    assert "none" not in cmd
    assert flag_value(cmd, "plm_ssh_args") == "-p 2222 -i '/keys/id rsa'"
    assert flag_value(cmd, "--output") == "timestamp"
    open_mpi_4 = Site("/m", "openmpi", 4, 4, 1000)
    assert "--timestamp-output" in command(["-np", "2", "-prefix-timestamp", "x"], open_mpi_4)
    hydra = command(["-np", "2", "--binding-args", "-bind-to core", "x"], HYDRA)
    assert hydra[1:5] == ["-n", "2", "-bind-to", "core"]


@pytest.mark.parametrize("argv, site", [
    (["-i", "key"], HYDRA), (["-prefix-timestamp"], HYDRA),
    (["-i", "key"], SRUN), (["--prefix-output-with-timestamp"], SRUN),
    (["--binding-args", "--bind-to core"], SRUN),
])
def test_flags_only_open_mpi_honours_are_refused_elsewhere(argv, site):
    with pytest.raises(LaunchError):
        command(["-np", "2", *argv, "x"], site)


@pytest.mark.parametrize("flag", ["--gloo", "--jsrun"])
def test_gloo_and_jsrun_are_refused_with_the_reason(flag, capsys):
    assert launch.main(["-np", "2", flag, "python", "-c", "pass"]) == 2
    from hvd_sgp.runner import horovod_flags

    err = capsys.readouterr().err
    assert f"sgprun: error: {flag}: {horovod_flags.BY_DEST[flag[2:]].note}" in err


def test_mpi_and_disable_cache_change_nothing():
    plain = command(["-np", "2", "x"])
    assert command(["-np", "2", "--mpi", "--disable-cache", "--verbose", "x"]) == plain


def test_ignored_flags_are_named_in_one_warning_line():
    from hvd_sgp.runner import horovod_flags

    args = launch.parse_args(["-np", "2", "--fusion-threshold-mb", "32", "--no-autotune",
                              "--cycle-time-ms", "5", "--log-hide-timestamp", "--stall-check",
                              "x"])
    line = horovod_flags.warning(args)
    assert "\n" not in line and line.startswith("sgprun: warning: ")
    for spelled in ("--fusion-threshold-mb", "--no-autotune", "--cycle-time-ms",
                    "--log-hide-timestamp"):
        assert spelled in line
    assert "--stall-check" not in line  # mapped, not ignored
    assert horovod_flags.warning(launch.parse_args(["-np", "2", "--tcp", "x"])) is None
    # Ignored flags set no variable: nothing reads them.
    env = launch.job_environment(args, BASE_ENV, OPEN_MPI_5)
    assert not {"HOROVOD_FUSION_THRESHOLD", "HOROVOD_AUTOTUNE", "HOROVOD_CYCLE_TIME"} & (
        set(env) - set(BASE_ENV))


CONFIG = """
params:
  fusion_threshold_mb: 32
  hierarchical_allreduce: false
autotune:
  enabled: true
  warmup_samples: 5
timeline:
  filename: from_config.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 40
  shutdown_time_seconds: 100
library_options:
  num_nccl_streams: 2
logging:
  level: DEBUG
  with_timestamp: true
"""


def test_config_file_is_read_as_horovodrun_reads_it(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    args = launch.parse_args(["-np", "2", "--config-file", str(path),
                              "--stall-check-warning-time-seconds", "25", "x"])
    assert args.stall_check_warning_time_seconds == 25  # the command line wins
    assert (args.fusion_threshold_mb, args.hierarchical_allreduce, args.autotune) == (32, False,
                                                                                      True)
    assert (args.timeline_filename, args.timeline_mark_cycles) == ("from_config.json", True)
    assert (args.stall_check, args.stall_check_shutdown_time_seconds) == (False, 100)
    assert (args.log_level, args.log_with_timestamp, args.num_nccl_streams) == ("DEBUG", True, 2)
    env = launch.job_environment(args, BASE_ENV, OPEN_MPI_5)
    assert (env["HVD_SGP_TIMELINE"], env["HOROVOD_STALL_CHECK_DISABLE"],
            env["HOROVOD_STALL_CHECK_TIME_SECONDS"], env["HVD_SGP_TIMEOUT"]) == (
        "from_config.json", "1", "25", "100.0")
    from hvd_sgp.runner import horovod_flags

    line = horovod_flags.warning(args, args.config_unknown)
    assert "params.fusion_threshold_mb (config file)" in line and "autotune.enabled" in line


@pytest.mark.parametrize("text", ["params:\n  fusion_threshold_mb: -5\n",
                                  "stall_check:\n  enabled: maybe\n",
                                  "controller: ucx\n", "- a list\n", "params: [unclosed\n"])
def test_bad_config_files_exit_2(tmp_path, text, capsys):
    pytest.importorskip("yaml")
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        launch.parse_args(["-np", "2", "--config-file", str(path), "x"])
    assert exit_info.value.code == 2
    assert "--config-file" in capsys.readouterr().err


def test_config_controller_and_unknown_keys(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "config.yaml"
    path.write_text("controller: gloo\nparams:\n  fusion_treshold_mb: 1\nextra: 1\n")
    args = launch.parse_args(["-np", "2", "--config-file", str(path), "x"])
    assert args.gloo and args.config_unknown == ["params.fusion_treshold_mb", "extra"]
    with pytest.raises(LaunchError, match="MPI"):
        launch.validate(args)
    mpi = launch.parse_args(["-np", "2", "--mpi", "--config-file", str(path), "x"])
    assert mpi.mpi and not mpi.gloo  # the command line's controller wins


def test_config_file_without_pyyaml_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    path = tmp_path / "config.yaml"
    path.write_text("params: {}\n")
    with pytest.raises(SystemExit):
        launch.parse_args(["-np", "2", "--config-file", str(path), "x"])
    assert "needs PyYAML" in capsys.readouterr().err


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


def test_check_build_reports_mpi_and_frameworks(monkeypatch):
    result = run_sgprun(["--check-build"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    from hvd_sgp.runner import check_build
    from hvd_sgp.version import __version__

    assert out.startswith(f"hvd_sgp {__version__}")
    assert "[X] MPI: " in out and "MPI_THREAD_MULTIPLE" in out and "CUDA-aware MPI" in out
    for line in ("PyTorch", "TensorFlow", "Horovod", "NCCL"):
        assert f"] {line}" in out
    # the override beats MPI's answer in the probe's own process; the report marks it
    for forced, mark in (("1", "[X]"), ("0", "[ ]")):
        probe = subprocess.run([sys.executable, "-m", "hvd_sgp.runner.check_build", "--probe",
                                "mpi"], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "HVD_SGP_CUDA_AWARE": forced})
        facts = json.loads(probe.stdout.strip().splitlines()[-1])
        assert facts["cuda_aware"] is (forced == "1"), probe.stdout + probe.stderr
        monkeypatch.setattr(check_build, "gather", lambda: {
            "mpi": facts, "torch": {"missing": True}, "tensorflow": {"missing": True}})
        assert f"{mark} CUDA-aware MPI" in check_build.report()


HOROVOD_PROBE = textwrap.dedent("""
    import os
    from hvd_sgp.common import runtime
    runtime.init()
    names = ("HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS",
             "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_TIMELINE_MARK_CYCLES",
             "HVD_SGP_TIMELINE", "HVD_SGP_TIMEOUT", "NCCL_IB_DISABLE")
    print(f"rank {runtime.rank()}:", " ".join(f"{n}={os.environ.get(n)}" for n in names),
          flush=True)
""")


def test_sgprun_launches_a_horovodrun_command_line(tmp_path):
    """A horovodrun command with mapped, no-op and ignored flags starts 2 ranks over TCP, with
    the mapped variables on every rank and one warning line naming the ignored flags."""
    probe = tmp_path / "probe.py"
    probe.write_text(HOROVOD_PROBE)
    result = run_sgprun(["-np", "2", "--mpi", "--tcp", "--disable-cache", "--verbose",
                         "--binding-args=--bind-to none --map-by slot",
                         "--fusion-threshold-mb", "32", "--autotune", "--cycle-time-ms", "1",
                         "--no-stall-check", "--stall-check-warning-time-seconds", "30",
                         "--stall-check-shutdown-time-seconds", "90",
                         "--timeline-filename", str(tmp_path / "tl.json"),
                         "--timeline-mark-cycles", "-prefix-timestamp",
                         sys.executable, str(probe)])
    assert result.returncode == 0, result.stderr
    expected = (f"HOROVOD_STALL_CHECK_DISABLE=1 HOROVOD_STALL_CHECK_TIME_SECONDS=30 "
                f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=90 HOROVOD_TIMELINE_MARK_CYCLES=1 "
                f"HVD_SGP_TIMELINE={tmp_path / 'tl.json'} HVD_SGP_TIMEOUT=90.0 NCCL_IB_DISABLE=1")
    lines = [line for line in result.stdout.splitlines() if "rank " in line]
    assert sorted(line.split("rank ", 1)[1] for line in lines) == [f"0: {expected}",
                                                                   f"1: {expected}"]
    assert all(line.startswith("[") for line in lines)  # -prefix-timestamp: Open MPI's stamp
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == ["sgprun: warning: ignored, no meaning under SGP: --fusion-threshold-mb, "
                        "--cycle-time-ms, --autotune (see docs/horovod_compatibility.md)"]
