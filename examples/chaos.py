"""A chaos run: training under ``sgprun --fault-tolerant --max-np`` while ranks die at random.

    python examples/chaos.py --np 8 --local-size 2 --failures 200 --out /tmp/chaos

launches examples/chaos_train.py (digits, Horovod's elastic API, a commit per step) and, one
after another, orders a random rank to die: how (SIGKILL, ``os._exit(1)``, SIGSTOP), who (any
rank, rank 0, a node's local master, the replacement spawned last, a survivor while the others
repair, a warm spare waiting to be called up under ``--spares``) and when (between steps, in
the in-node reduce, the SGP exchange, an AllReduce stage, a Horovod collective,
``hvd.join()``, a commit). A frozen rank is resumed ``--stop-seconds``
later (it then finds itself excluded and leaves). The next failure comes once the world is
whole again and a few steps have passed.

The run fails when no step completes for ``--hang-seconds`` (60), when rank 0 reports
``--repair-loop`` (10) repairs in a row that found nobody lost (a livelock: steps go on, slowly,
between repairs of nothing), when the PushSum weights do
not sum to the world's size after any step or at the end (a message counted twice adds
weight), when sgprun's status is not 0, or, with ``--baseline``, when the
final accuracy is more than ``MAX_ACCURACY_LOSS`` (1 point) below the failure-free run's.
It prints, and writes to
``OUT/summary.json``: the failures by kind, victim and moment, recovery time (a death to the
first step completed after it) p50/p95 per kind, the repairs as rank 0 reported them (time,
and the unusual ones), final accuracy, and goodput (useful steps x a
failure-free step time / wall time); ``--baseline`` runs the same without failures first and
compares the accuracies. ``--plot`` draws world size and loss over time (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from typing import Optional

from hvd_sgp.common import options

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("kill", "exit", "stop")
MOMENTS = ("step", "in-node", "gossip", "allreduce", "collective", "join", "commit")
ORDER_SECONDS = 30.0
MAX_ACCURACY_LOSS = 0.01  # below the failure-free run's final accuracy (issue 26)
VICTIMS = ("any", "rank0", "local-master", "replacement", "mid-repair", "spare")


class ChaosFailed(RuntimeError):
    """The run broke a promise: a hang, a wrong mass, a failed job."""


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=8)
    p.add_argument("--local-size", type=int, default=1, help="ranks per SGP node (1 or 2)")
    p.add_argument("--failures", type=int, default=20)
    p.add_argument("--no-replace", action="store_true", help="without --max-np: the world "
                   "shrinks by one each failure, to 3 ranks (the repair alone, no spawn)")
    p.add_argument("--spares", type=int, default=0, help="sgprun's --spares: warm spares "
                   "that replace lost ranks (with replacements only)")
    p.add_argument("--replace-at", choices=options.BY_NAME["replace_at"].choices,
                   help="sgprun's --replace-at: when replacements join")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--moments", default=",".join(MOMENTS))
    p.add_argument("--victims", default=",".join(VICTIMS))
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--detector-timeout", type=float, default=None, help="sgprun's (default: "
                   "sgprun's own)")
    p.add_argument("--timeout", type=float, default=10.0, help="HVD_SGP_TIMEOUT for the ranks "
                   "(a frozen rank is excluded after it; at load 50 a slow wait past it "
                   "revokes the world for nothing: a repair that finds nobody lost)")
    p.add_argument("--gap", type=int, default=3, help="steps on the whole world between "
                   "failures")
    p.add_argument("--stop-seconds", type=float, default=20.0, help="how long a frozen rank "
                   "stays frozen (longer than the detector timeout: it is declared dead)")
    p.add_argument("--hang-seconds", type=float, default=60.0)
    p.add_argument("--repair-loop", type=int, default=10, help="repairs in a row that find "
                   "nobody lost, which fail the run")
    p.add_argument("--start-seconds", type=float, default=600.0, help="how long the first "
                   "step may take (8 ranks importing torch on a loaded machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true", help="a failure-free run first")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--out", default="/tmp/hvd_sgp_chaos")
    args = p.parse_args(argv)
    for name, allowed in (("kinds", KINDS), ("moments", MOMENTS), ("victims", VICTIMS)):
        chosen = getattr(args, name).split(",")
        wrong = [c for c in chosen if c not in allowed]
        if wrong:
            p.error(f"--{name}: {wrong} not in {allowed}")
        setattr(args, name, chosen)
    if args.np < 3:
        p.error("--np must be at least 3 (a victim and two survivors)")
    return args


def schedule(epochs: int) -> str:
    """1-peer SGP with 5 steps of AllReduce SGD every 30 (the allreduce moment); in steps, as
    the engine counts them (an epoch would need the script to call set_epoch)."""
    return ",".join(f"{s}s:sgp,{s + 25}s:allreduce" for s in range(0, 100 * epochs, 30))


def launch(args: argparse.Namespace, run_dir: str) -> subprocess.Popen:
    os.makedirs(run_dir, exist_ok=True)
    env = dict(os.environ, HVD_SGP_LOCAL_SIZE=str(args.local_size), OMP_NUM_THREADS="1",
               HVD_SGP_TIMEOUT=f"{args.timeout:g}", HVD_SGP_SCHEDULE=schedule(args.epochs),
               OMPI_MCA_mpi_yield_when_idle="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "hvd_sgp.runner.launch", "-np", str(args.np),
           "--fault-tolerant"]
    if not args.no_replace:
        cmd += ["--max-np", str(args.np)] + (["--spares", str(args.spares)] if args.spares
                                             else [])
        cmd += ["--replace-at", args.replace_at] if args.replace_at else []
    if args.detector_timeout is not None:
        cmd += ["--detector-timeout", f"{args.detector_timeout:g}"]
    cmd += [sys.executable, os.path.join(HERE, "chaos_train.py"), "--dir", run_dir,
            "--epochs", str(args.epochs), "--hidden", str(args.hidden),
            "--whole", str(0 if args.no_replace else args.np)]
    out = open(os.path.join(run_dir, "sgprun.out"), "w")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def lines(run_dir: str, name: str) -> list:
    try:
        with open(os.path.join(run_dir, name)) as log:
            return [line.split() for line in log if line.strip()]
    except FileNotFoundError:
        return []


def ranks(run_dir: str) -> dict:
    """origin -> the rank's latest report, for processes still alive."""
    found = {}
    folder = os.path.join(run_dir, "ranks")
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if not name.isdigit():  # a report being written
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                info = json.load(f)
            os.kill(info["pid"], 0)
        except (ValueError, OSError):
            continue
        found[int(name)] = info
    return found


class Chaos:
    """Injects the failures and watches for hangs while one sgprun runs."""

    def __init__(self, args: argparse.Namespace, run_dir: str):
        self.args, self.dir = args, run_dir
        self.rng = random.Random(args.seed)
        self.planned: list = []  # (time, origin, kind, victim, moment, pid)
        self.stopped: list = []  # (resume at, pid)
        self.size = 0  # the world's size at the latest step
        self.withdrawn = 0  # orders whose moment did not come
        self.frozen: set = set()  # (time, origin) of the stop deaths already scheduled
        self.read = 0  # how far sgprun's output has been read for repairs (``repair_loop``)
        self.empty_repairs = 0  # repairs in a row that found nobody lost

    def pick(self, alive: dict) -> Optional[tuple]:
        """(origin, victim class) or None when no rank fits the class drawn (or none has
        reported yet)."""
        if not alive:
            return None
        victim = self.rng.choice(self.args.victims)
        size = max(info["size"] for info in alive.values())
        current = {o: i for o, i in alive.items() if i["size"] == size}
        if victim == "rank0":
            pool = [o for o, i in current.items() if i["rank"] == 0]
        elif victim == "local-master":
            pool = [o for o, i in current.items() if i["local_rank"] == 0]
        elif victim == "replacement":
            pool = [max(current)] if max(current) >= self.args.np else []
        elif victim == "spare":  # (a pid: a waiting spare has no origin yet)
            pool = waiting_spares(self.dir, {info["pid"] for info in alive.values()})
        else:
            pool = list(current)
        return (self.rng.choice(pool), victim) if pool else None

    def inject(self, alive: dict) -> bool:
        chosen = self.pick(alive)
        if chosen is None:
            return False
        origin, victim = chosen
        kind, moment = self.rng.choice(self.args.kinds), self.rng.choice(self.args.moments)
        if victim == "spare":  # it runs no step: killed or stopped by signal, here
            kind = "stop" if kind == "stop" else "kill"
            self.planned.append((time.time(), origin, kind, victim, "waiting", origin))
            self.signal(origin, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
            if kind == "stop":
                self.stopped.append((time.time() + self.args.stop_seconds, origin))
            return True
        if victim == "mid-repair":  # two at once: a first death, then a survivor by signal
            others = [o for o in alive if o != origin]
            second = self.rng.choice(others)
            self.order(origin, "kill", "step")
            if not self.wait_for_death(origin, 30):
                return False
            time.sleep(self.rng.uniform(0.05, 1.0))  # the survivors are repairing now
            pid = alive[second]["pid"]
            self.planned.append((time.time(), second, "kill", "mid-repair", "repair", pid))
            self.signal(pid, signal.SIGKILL)
            return True
        self.order(origin, kind, moment)
        self.planned.append((time.time(), origin, kind, victim, moment, alive[origin]["pid"]))
        return True

    def order(self, origin: int, kind: str, moment: str) -> None:
        path = os.path.join(self.dir, "orders", str(origin))
        with open(path + ".tmp", "w") as f:
            f.write(f"{kind} {moment}")
        os.replace(path + ".tmp", path)

    @staticmethod
    def signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def wait_for_death(self, origin: int, seconds: float) -> bool:
        end = time.time() + seconds
        while time.time() < end:
            if any(int(d[1]) == origin for d in lines(self.dir, "deaths.log")):
                return True
            time.sleep(0.05)
        return False

    def run(self, job: subprocess.Popen) -> None:
        """Inject until --failures are done, then let the job finish; raise on a hang."""
        started = time.time()
        last_step_at, seen, whole_since = started, 0, None
        while job.poll() is None:
            time.sleep(0.1)
            now = time.time()
            for resume_at, pid in list(self.stopped):
                if now >= resume_at:
                    self.signal(pid, signal.SIGCONT)
                    self.stopped.remove((resume_at, pid))
            for death in lines(self.dir, "deaths.log"):
                key = (float(death[0]), int(death[1]))
                pid = ranks_pid(self.dir, key[1])
                if death[2] == "stop" and key not in self.frozen and pid:
                    self.frozen.add(key)
                    self.stopped.append((key[0] + self.args.stop_seconds, pid))
            steps = lines(self.dir, "steps.log")
            if len(steps) > seen:
                seen, last_step_at = len(steps), now
            limit = self.args.start_seconds if seen == 0 else self.args.hang_seconds
            if now - last_step_at > limit:
                raise ChaosFailed(f"no step completed for {now - last_step_at:.0f} s "
                                  f"(after {seen} steps): a hang")
            self.repair_loop()
            if len(self.planned) >= self.args.failures or not steps:
                continue
            if self.pending():
                whole_since = None
                continue
            size = int(steps[-1][2])
            if size < (3 if self.args.no_replace else self.args.np) or size != self.size:
                self.size, whole_since = size, None  # wait for the world to be whole
                continue
            whole_since = whole_since if whole_since is not None else len(steps)
            if len(steps) - whole_since >= self.args.gap:
                if self.inject(ranks(self.dir)):
                    whole_since = None

    def repair_loop(self) -> None:
        """Raise once rank 0 has reported --repair-loop repairs in a row that found nobody
        lost: something revokes the repaired world over and over (a livelock a chaos run
        fell into, which the hang rule missed: a step still completed every few seconds)."""
        try:
            with open(os.path.join(self.dir, "sgprun.out"), "rb") as out:
                out.seek(self.read)
                raw = out.read()
        except OSError:
            return
        whole = raw.rfind(b"\n") + 1  # (a line still being written waits for the next look)
        self.read += whole
        text = raw[:whole].decode(errors="replace")
        for lost, _, _ in REPAIR.findall(text):
            self.empty_repairs = 0 if lost.strip() else self.empty_repairs + 1
            if self.empty_repairs >= self.args.repair_loop:
                raise ChaosFailed(f"{self.empty_repairs} repairs in a row found nobody lost: "
                                  "a livelock")

    def pending(self) -> bool:
        """An order not yet carried out (its rank has not reached the moment); one older than
        ORDER_SECONDS is withdrawn (the moment does not come in this run, or the rank died
        otherwise)."""
        folder = os.path.join(self.dir, "orders")
        waiting = False
        for name in os.listdir(folder):
            try:
                if time.time() - os.path.getmtime(os.path.join(folder, name)) > ORDER_SECONDS:
                    os.remove(os.path.join(folder, name))
                    self.withdrawn += 1
                else:
                    waiting = True
            except FileNotFoundError:
                pass
        return waiting


def _processes_of(run_dir: str) -> dict:
    """pid -> whether it is a spare, for the ranks and warm spares of this run (Python running
    chaos_train.py, or ``-m hvd_sgp.spare`` with it, on the run's directory)."""
    found = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        spare = argv[1:3] == [b"-m", b"hvd_sgp.spare"]
        script = argv[3 if spare else 1] if len(argv) > 3 else b""
        if script.endswith(b"chaos_train.py") and run_dir.encode() in argv:
            found[int(name)] = spare
    return found


def waiting_spares(run_dir: str, ranks: set) -> list:
    """The pids of this run's warm spares still waiting (not yet a rank)."""
    return sorted(pid for pid, spare in _processes_of(run_dir).items()
                  if spare and pid not in ranks)


def ranks_pid(run_dir: str, origin: int) -> Optional[int]:
    try:
        with open(os.path.join(run_dir, "ranks", str(origin))) as f:
            return json.load(f)["pid"]
    except (OSError, ValueError):
        return None


def percentile(values: list, q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def quantiles(values: list) -> dict:
    """How many, the median and the 95th percentile."""
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95)}


def summarize(run_dir: str, chaos: Chaos, wall: float, step_seconds: Optional[float]) -> dict:
    steps = [(float(s[0]), int(s[1]), int(s[2]), float(s[3])) for s in lines(run_dir,
                                                                             "steps.log")]
    deaths = [(float(d[0]), int(d[1]), d[2], d[3]) for d in lines(run_dir, "deaths.log")]
    deaths += [(t, o, k, m) for t, o, k, v, m, _ in chaos.planned if m == "repair"]
    recovery: dict = {}
    whole = []  # a death to the first step on the full world again (with replacements)
    redone = []  # committed steps taken again after a death (a commit per step: at most 1)
    for when, _, kind, _ in deaths:
        before = [step for t, step, *_ in steps if t < when]
        after = [(t, step) for t, step, *_ in steps if t > when]
        if after:
            recovery.setdefault(kind, []).append(after[0][0] - when)
            if before:
                redone.append(max(0, before[-1] - after[0][1] + 1))
        full = [t for t, _, size, _ in steps if t > when and size >= chaos.args.np]
        if full and not chaos.args.no_replace:
            whole.append(full[0] - when)
    ledger = [(f"step {s[1]}", int(s[2]), float(s[4])) for s in lines(run_dir, "steps.log")]
    ledger += [(" ".join(e[1:e.index("size")]), int(e[e.index("size") + 1]), float(e[-1]))
               for e in lines(run_dir, "ledger.log")]
    bad = [f"{where}: {size} ranks hold mass {mass!r}" for where, size, mass in ledger
           if abs(mass - size) > 1e-6 * size]
    results = [json.loads(" ".join(r)) for r in lines(run_dir, "result.log")]
    summary = {
        "failures": len(deaths),
        "by_kind": count(d[2] for d in deaths),
        "by_moment": count(d[3] for d in deaths),
        "by_victim": count(p[3] for p in chaos.planned),
        "spares_lost": sum(1 for p in chaos.planned if p[3] == "spare"),  # (not in failures)
        "orders_withdrawn": chaos.withdrawn,
        "recovery_seconds": {k: {"n": len(v), "p50": percentile(v, 50),
                                 "p95": percentile(v, 95), "max": max(v)}
                             for k, v in sorted(recovery.items())},
        "full_world_seconds": quantiles(whole),
        "steps_redone": {"deaths": len(redone), "max": max(redone, default=0),
                         "total": sum(redone), "data_back": data_back(run_dir)},
        "wall_seconds": wall, "ledger_checks": len(ledger), "ledger_bad": bad,
        "repairs": repairs(run_dir),
        "result": results[-1] if results else None,
    }
    if step_seconds and results:
        summary["goodput"] = results[-1]["steps"] * step_seconds / wall
    return summary


def data_back(run_dir: str) -> int:
    """How often the data went back (the sampler's epoch and samples done, after each step):
    samples taken again after a death. A commit that saved the sampler's next epoch with the
    training loop's old one had a death in an epoch's first step take the whole epoch again."""
    done = [(int(s[5]), int(s[6])) for s in lines(run_dir, "steps.log") if len(s) > 6]
    return sum(1 for before, after in zip(done, done[1:]) if after <= before)


REPAIR = re.compile(r"hvd_sgp: lost rank\(s\) \[([0-9, ]*)\]; .*?(?:(\d+) replacement\(s\) "
                    r"joined.*)?after a repair of ([0-9.]+) s")
TAKE_IN = re.compile(r"hvd_sgp: (\d+) replacement\(s\) joined .*after a take-in of ([0-9.]+) s")


def repairs(run_dir: str) -> dict:
    """What rank 0 said of each repair in sgprun's output: how many, how long (all of them,
    and those that replaced one lost rank), and the unusual ones: a repair that found nobody
    lost, one that started over (a death inside it), a spawning rank that left (a death cut
    its MPI_Comm_spawn or a take-in's connect short), a rank that left stuck in one of the
    repair's collectives (recovery.blocked_in) and a stopped peer killed by the sentinel
    (stopped.py)."""
    try:
        with open(os.path.join(run_dir, "sgprun.out"), errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    found = [(len([r for r in lost.split(",") if r.strip()]), int(joined or 0), float(t))
             for lost, joined, t in REPAIR.findall(text)]
    single = [t for lost, joined, t in found if lost == 1 and joined == 1]
    every = [t for _, _, t in found]
    taken = [float(t) for _, t in TAKE_IN.findall(text)]
    return {"count": len(found),
            "seconds": {"p50": percentile(every, 50), "p95": percentile(every, 95)},
            "one_lost_one_joined_seconds": quantiles(single),
            "take_ins": quantiles(taken),
            "nobody_lost": sum(1 for lost, _, _ in found if lost == 0),
            "started_over": text.count("the repair starts over"),
            "spawning_rank_left": text.count("MPI_Comm_connect do not return after that"),
            "stuck_rank_left": text.count("in the repair of the world, though ULFM would"),
            "stopped_peers_killed": text.count("was stopped for")}


def count(items) -> dict:
    out: dict = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def run_once(args: argparse.Namespace, run_dir: str, failures: int) -> tuple:
    """One sgprun with ``failures`` injected: (Chaos, wall seconds, status)."""
    if os.path.isdir(run_dir):
        for sub in ("orders", "ranks"):
            for name in os.listdir(os.path.join(run_dir, sub)) if os.path.isdir(
                    os.path.join(run_dir, sub)) else ():
                os.remove(os.path.join(run_dir, sub, name))
        for name in ("steps.log", "deaths.log", "ledger.log", "result.log"):
            if os.path.exists(os.path.join(run_dir, name)):
                os.remove(os.path.join(run_dir, name))
    os.makedirs(os.path.join(run_dir, "orders"), exist_ok=True)
    chaos = Chaos(argparse.Namespace(**{**vars(args), "failures": failures}), run_dir)
    began = time.time()
    job = launch(args, run_dir)
    try:
        chaos.run(job)
    except BaseException as error:
        if isinstance(error, ChaosFailed):  # every process's stacks (chaos_train.py), first
            for pid in _processes_of(run_dir):
                chaos.signal(pid, signal.SIGUSR1)
            time.sleep(2)
            with open(os.path.join(run_dir, "planned.json"), "w") as f:
                json.dump(chaos.planned, f)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        raise
    for _, pid in chaos.stopped:
        chaos.signal(pid, signal.SIGCONT)
    return chaos, time.time() - began, job.wait()


def plot(run_dir: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [(float(s[0]), int(s[2]), float(s[3])) for s in lines(run_dir, "steps.log")]
    deaths = [float(d[0]) for d in lines(run_dir, "deaths.log")]
    t0 = steps[0][0]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5))
    top.step([t - t0 for t, _, _ in steps], [n for _, n, _ in steps], where="post")
    top.set_ylabel("world size")
    for d in deaths:
        top.axvline(d - t0, color="red", alpha=0.3, lw=0.8)
    bottom.plot([t - t0 for t, _, _ in steps], [loss for _, _, loss in steps], lw=0.8)
    bottom.set_ylabel("training loss")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds (red: a rank dies)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list] = None) -> dict:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    step_seconds, baseline = None, None
    if args.baseline:
        _, wall, status = run_once(args, os.path.join(args.out, "baseline"), 0)
        if status != 0:
            raise ChaosFailed(f"the failure-free run ended with status {status}")
        base = [float(s[0]) for s in lines(os.path.join(args.out, "baseline"), "steps.log")]
        baseline = json.loads(" ".join(lines(os.path.join(args.out, "baseline"),
                                             "result.log")[-1]))
        step_seconds = (base[-1] - base[0]) / (len(base) - 1)
    run_dir = os.path.join(args.out, "chaos")
    chaos, wall, status = run_once(args, run_dir, args.failures)
    summary = summarize(run_dir, chaos, wall, step_seconds)
    summary.update(status=status, load=os.getloadavg(), args=vars(args))
    if baseline:
        summary["baseline"] = baseline
        summary["failure_free_step_seconds"] = step_seconds
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.plot:
        plot(run_dir, os.path.join(args.out, "chaos.png"))
    print(json.dumps(summary, indent=1))
    if status != 0:
        raise ChaosFailed(f"sgprun ended with status {status} (see {run_dir}/sgprun.out)")
    if summary["ledger_bad"]:
        raise ChaosFailed(f"the mass ledger broke: {summary['ledger_bad']}")
    if summary["result"] is None:
        raise ChaosFailed("the training did not finish")
    if summary["steps_redone"]["data_back"]:
        raise ChaosFailed(f"samples were taken again after a death "
                          f"({summary['steps_redone']['data_back']} time(s))")
    if baseline and summary["result"]["accuracy"] < baseline["accuracy"] - MAX_ACCURACY_LOSS:
        raise ChaosFailed(f"final accuracy {summary['result']['accuracy']:.4f} is more than "
                          f"{MAX_ACCURACY_LOSS:.0%} below the failure-free run's "
                          f"{baseline['accuracy']:.4f}")
    return summary


if __name__ == "__main__":
    main()
