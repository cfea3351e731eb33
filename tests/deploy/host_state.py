"""What a container engine changes on the host, captured before and compared after: firewall rules
and chains (iptables and ip6tables, every table), network links, and processes started from the
engine's own storage.

netavark adds chains and jumps for each compose network and leaves some behind when the network
goes (its base chains, isolation rules naming a bridge that no longer exists): `remove_added_rules`
deletes exactly the rules and chains that were not there before, nothing else.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

FIREWALLS = ("iptables", "ip6tables")


@dataclass(frozen=True)
class Ruleset:
    """One table of one firewall: its user-defined chains and its rules (`-A CHAIN ...` lines)."""

    chains: frozenset[str]
    rules: tuple[str, ...]


@dataclass
class HostState:
    firewall: dict[tuple[str, str], Ruleset] = field(default_factory=dict)
    links: frozenset[str] = frozenset()
    pids: frozenset[int] = frozenset()


def read_firewall(tool: str) -> dict[str, Ruleset]:
    """`<tool>-save` parsed into {table: Ruleset}; {} when the tool is missing or refuses."""
    if shutil.which(f"{tool}-save") is None:
        return {}
    done = subprocess.run([f"{tool}-save"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return {}
    tables: dict[str, tuple[set[str], list[str]]] = {}
    table = None
    for line in done.stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
            tables[table] = (set(), [])
        elif table and line.startswith(":"):
            name, policy = line[1:].split()[:2]
            # A built-in chain (INPUT, FORWARD, ...; its policy is not "-") comes with its table:
            # the first container loads a table that was not there before, and a table cannot be
            # unloaded, so only user-defined chains count as something added.
            if policy == "-":
                tables[table][0].add(name)
        elif table and line.startswith("-A "):
            tables[table][1].append(line)
    return {name: Ruleset(frozenset(chains), tuple(rules)) for name, (chains, rules) in tables.items()}


def read_links() -> frozenset[str]:
    return frozenset(os.listdir("/sys/class/net"))


# The engine's helper programs; aardvark-dns (the networks' DNS) names no path of the engine's own.
ENGINE_PROGRAMS = frozenset({"podman", "conmon", "netavark", "aardvark-dns"})


def processes_using(marker: str) -> dict[int, str]:
    """pid -> command line of every process whose command line mentions `marker`, or that runs
    one of the engine's programs."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            program = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if cmdline and (marker in cmdline or program in ENGINE_PROGRAMS):
            found[int(entry.name)] = cmdline.strip()
    return found


def capture(marker: str) -> HostState:
    firewall = {}
    for tool in FIREWALLS:
        for table, ruleset in read_firewall(tool).items():
            firewall[(tool, table)] = ruleset
    return HostState(firewall, read_links(), frozenset(processes_using(marker)))


def remove_added_rules(before: HostState) -> list[str]:
    """Delete the rules, then the chains, that are in the firewall now but were not `before`;
    return one line per thing removed (`iptables nat: -A POSTROUTING ...`)."""
    removed = []
    for tool in FIREWALLS:
        for table, now in read_firewall(tool).items():
            old = before.firewall.get((tool, table), Ruleset(frozenset(), ()))
            for rule in now.rules:
                if rule not in old.rules:
                    # "-A CHAIN spec..." -> "-D CHAIN spec..."; the save format quotes comments.
                    args = shlex.split(rule)[1:]
                    subprocess.run([tool, "-t", table, "-D", *args], capture_output=True, timeout=30)
                    removed.append(f"{tool} {table}: {rule}")
            for chain in sorted(now.chains - old.chains):
                subprocess.run([tool, "-t", table, "-F", chain], capture_output=True, timeout=30)
                subprocess.run([tool, "-t", table, "-X", chain], capture_output=True, timeout=30)
                removed.append(f"{tool} {table}: chain {chain}")
    return removed


def differences(before: HostState, marker: str) -> list[str]:
    """What is on the host now that was not `before`: rules, chains, links, processes."""
    now = capture(marker)
    out = []
    for key, ruleset in now.firewall.items():
        old = before.firewall.get(key, Ruleset(frozenset(), ()))
        out += [f"{key[0]} {key[1]}: chain {c}" for c in sorted(ruleset.chains - old.chains)]
        out += [f"{key[0]} {key[1]}: {r}" for r in ruleset.rules if r not in old.rules]
    out += [f"network link {name}" for name in sorted(now.links - before.links)]
    out += [f"process {pid}" for pid in sorted(now.pids - before.pids)]
    return out


def end_processes(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each pid, then SIGKILL what is still there after `grace_s`."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
