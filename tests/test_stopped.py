"""The stopped-peer sentinel (hvd_sgp/common/stopped.py) on real processes, in one process:
a peer is killed only once the kernel has shown it stopped for the sentinel's time, never while
it runs, and never where its pid now names another process."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from hvd_sgp.common import stopped

pytestmark = pytest.mark.skipif(stopped.identity() is None, reason="no /proc on this system")


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    time.sleep(0.05)
    boot, _, _ = stopped.identity()
    yield proc, (boot, proc.pid, stopped._stat(proc.pid)[1])
    proc.kill()
    proc.wait()


def test_a_running_peer_and_this_process_are_left_alone(sleeper):
    proc, peer = sleeper
    sentinel = stopped.Sentinel(0.0)
    assert sentinel.check([(1, peer), (0, stopped.identity()), (2, None)], now=10.0) == []
    assert proc.poll() is None


def test_a_peer_stopped_for_the_time_is_killed(sleeper):
    proc, peer = sleeper
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.05)
    sentinel = stopped.Sentinel(5.0)
    assert sentinel.check([(3, peer)], now=100.0) == []  # first seen stopped
    assert sentinel.check([(3, peer)], now=104.0) == []  # 4 s: not yet
    assert proc.poll() is None
    assert sentinel.check([(3, peer)], now=105.5) == [3]
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_a_peer_resumed_in_time_starts_over(sleeper):
    proc, peer = sleeper
    sentinel = stopped.Sentinel(5.0)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.05)
    sentinel.check([(3, peer)], now=100.0)
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(0.05)
    assert sentinel.check([(3, peer)], now=103.0) == []
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.05)
    assert sentinel.check([(3, peer)], now=106.0) == []  # stopped again 0 s ago, not 6
    assert proc.poll() is None


def test_a_reused_pid_or_another_machine_is_never_killed(sleeper):
    proc, (boot, pid, start) = sleeper
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.05)
    sentinel = stopped.Sentinel(0.0)
    assert sentinel.check([(3, (boot, pid, start + 1))], now=100.0) == []
    assert sentinel.check([(3, ("another-machine", pid, start))], now=102.0) == []
    assert proc.poll() is None
