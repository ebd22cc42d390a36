"""The main job: the seed's RL workflow, end to end, on a local boxd.

1. A base machine ``rl-base``: ``pip install gymnasium numpy`` and a warm-up, once.
2. Eight rollouts, each a fork of the warm base (the seed's ThreadPoolExecutor loop).
3. The seed's check: two forks with seed 42 print the same digest; other seeds differ.

Prints the results and where the time went. Re-running reuses ``rl-base`` when it
already has gymnasium (``--fresh`` rebuilds it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from boxd import Boxd, NotFound

HERE = Path(__file__).resolve().parent
BASE = "rl-base"
# Wide enough for the table when the output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 120)
boxd = Boxd()  # reads BOXD_API_KEY; with no BOXD_URL it starts a local daemon


def run_checked(machine: str, command: str, timeout: float) -> str:
    result = boxd.machines.exec(machine, command, timeout=timeout)
    if result.exit_code != 0:
        console.print(f"[red]{command!r} failed with exit code {result.exit_code}[/red]")
        console.print(result.stdout[-2000:], result.stderr[-2000:])
        sys.exit(1)
    return result.stdout


def prepare_base(fresh: bool) -> dict[str, float]:
    """The one-time setup; returns how long each step took."""
    timings: dict[str, float] = {}
    existing = {machine.name for machine in boxd.machines.list()}
    if BASE in existing and not fresh:
        boxd.machines.wait_until_ready(BASE)
        if boxd.machines.exec(BASE, "python3 -c 'import gymnasium, numpy'").exit_code == 0:
            console.print(f"reusing the warm {BASE} (run with --fresh to rebuild it)")
            return timings
    if BASE in existing:
        boxd.machines.delete(BASE)
    started = time.perf_counter()
    with console.status(f"booting {BASE}"):
        boxd.machines.new(BASE)
        boxd.machines.wait_until_ready(BASE)
    timings["boot"] = time.perf_counter() - started
    started = time.perf_counter()
    with console.status("pip install gymnasium numpy (inside the machine)"):
        run_checked(BASE, "pip install --no-warn-script-location gymnasium numpy", timeout=1200)
    timings["pip install"] = time.perf_counter() - started
    for script in ("warm_up.py", "rollout.py"):
        boxd.machines.files.upload(BASE, f"/home/boxd/{script}", open(HERE / script).read())
    started = time.perf_counter()
    with console.status("warm-up: loading the simulator"):
        console.print(run_checked(BASE, "python3 /home/boxd/warm_up.py", timeout=600).strip())
    timings["warm-up"] = time.perf_counter() - started
    return timings


def rollout(name: str, seed: int) -> dict:
    """The seed's rollout: fork the base, run one episode, report, disappear."""
    started = time.perf_counter()
    fork = boxd.machines.fork(BASE, name)
    boxd.machines.wait_until_ready(fork.id)
    ready = time.perf_counter() - started
    result = boxd.machines.exec(fork.id, f"python3 /home/boxd/rollout.py --seed {seed}")
    boxd.machines.delete(fork.id)
    if result.exit_code != 0:
        raise RuntimeError(f"rollout {name} failed: {result.stderr[-1000:]}")
    return {"name": name, "seed": seed, "fork_ready_s": ready,
            "total_s": time.perf_counter() - started, "result": result.stdout.strip()}


def clean_leftovers() -> None:
    for machine in boxd.machines.list():
        if machine.name.startswith(("rollout-", "check-")):
            try:
                boxd.machines.delete(machine.id)
            except NotFound:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh", action="store_true", help="rebuild rl-base even if it is already warm")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--batches", type=int, default=1,
                        help="run the concurrent rollouts this many times (a soak: every fork must succeed)")
    options = parser.parse_args()

    clean_leftovers()
    setup = prepare_base(options.fresh)

    batches, failures = [], []
    for batch in range(options.batches):
        started = time.perf_counter()
        with console.status(f"batch {batch + 1}/{options.batches}: {options.rollouts} rollouts, each a fork of {BASE}"):
            with ThreadPoolExecutor(max_workers=8) as pool:
                attempts = [pool.submit(rollout, f"rollout-{s}", s) for s in range(options.rollouts)]
                done = []
                for attempt in attempts:
                    try:
                        done.append(attempt.result())
                    except Exception as error:  # noqa: BLE001 - counted and reported, the soak goes on
                        failures.append(f"batch {batch + 1}: {type(error).__name__}: {error}")
        batches.append((done, time.perf_counter() - started))
        clean_leftovers()
    rollouts, batch_s = batches[0]
    with console.status("the seed's check: two forks, seed 42"):
        with ThreadPoolExecutor(max_workers=2) as pool:
            a, b = pool.map(lambda name: rollout(name, seed=42), ["check-a", "check-b"])

    table = Table(title=f"{options.rollouts} rollouts forked from {BASE}")
    for column in ("rollout", "seed", "steps", "reward", "trajectory digest", "fork ready (s)", "total (s)"):
        table.add_column(column)
    for row in [*rollouts, a, b]:
        episode = json.loads(row["result"])
        table.add_row(
            row["name"], str(row["seed"]), str(episode["steps"]), f"{episode['reward']:.0f}", episode["digest"],
            f"{row['fork_ready_s']:.2f}", f"{row['total_s']:.2f}",
        )
    console.print(table)

    digests = {row["seed"]: json.loads(row["result"])["digest"] for row in rollouts}
    same = json.loads(a["result"])["digest"] == json.loads(b["result"])["digest"]
    distinct = len(set(digests.values())) == len(digests)
    console.print(f"seed 42 twice: {'same digest' if same else 'DIFFERENT digests'}; "
                  f"seeds 0..{options.rollouts - 1}: {'all different' if distinct else 'some equal'}")
    fork_ready = statistics.median(row["fork_ready_s"] for row in rollouts)
    console.print(f"{options.rollouts} rollouts in {batch_s:.1f} s; median fork ready in {fork_ready:.2f} s")
    if options.batches > 1:
        every = sorted(row["fork_ready_s"] for done, _ in batches for row in done)
        console.print(
            f"{options.batches} batches of {options.rollouts} concurrent rollouts: {len(every)} forks ready, "
            f"{len(failures)} failed; fork ready median {statistics.median(every):.2f} s, "
            f"slowest {every[-1]:.2f} s; batch median {statistics.median(s for _, s in batches):.1f} s"
        )
    for failure in failures:
        console.print(f"[red]{failure}[/red]")
    if setup:
        cold = sum(setup.values())
        steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in setup.items())
        console.print(f"a fresh machine needs {cold:.1f} s ({steps}): a fork is ready {cold / fork_ready:.0f}x sooner")
    assert not failures, f"{len(failures)} rollouts failed"
    assert same, "same starting bytes + same seed should give the same trajectory"
    assert distinct, "different seeds should give different trajectories"


if __name__ == "__main__":
    main()
