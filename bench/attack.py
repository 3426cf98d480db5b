"""``kvbench attack``: attacks on a real daemon (started here, loopback only, tenants on), each
ending with the daemon alive and the victim tenant's chunks checked byte for byte.

- fuzz: malformed and hostile messages to every RPC, garbage to the bulk port (``--messages``);
- flood: a connection flood on both ports with the daemon short of descriptors (``--seconds``);
- dying: client processes SIGKILLed mid-Get, mid-Put and holding pins (``--rounds``);
- kill9: the daemon SIGKILLed during durable put storms, restarted, every acknowledged durable
  chunk checked (``--rounds``);
- tenants: one tenant trying every RPC on every path against another's keys;
- soak: client processes of three tenants mixing every RPC, reads checked, the daemon's RSS
  sampled (``--seconds``, ``--workers``);
- fairness: a well-behaved tenant's latency and refusals alone, then beside each abusive
  pattern of another (idle streams, withheld bulk frames, tiny chunks pinned, promote and pin,
  Pause and Contains floods, one-byte pieces), the health check asked throughout
  (``--seconds`` in all; ``--control``: each pattern also aimed at a second daemon).

Exit status 1 if any attack found something (a bug status, a leak, a wrong byte, a lost
durable chunk, a daemon that did not recover); re-puts lost to the Store's finding #2 are
reported apart and do not count.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from bench.cli import UsageError

MODES = ("fuzz", "flood", "dying", "kill9", "tenants", "soak", "fairness")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("attack", help="fuzz, flood, kill and soak a daemon; check it survives intact")
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--messages", type=int, default=10_000, help="fuzz: messages to send")
    p.add_argument("--seconds", type=float, default=600.0, help="soak: how long; flood: a tenth of it, at most 30 s")
    p.add_argument("--workers", type=int, default=6, help="soak: client processes")
    p.add_argument("--rounds", type=int, default=3, help="dying, kill9: rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control", action="store_true",
                   help="fairness: each pattern once more aimed at a second daemon, the victim's slowdown from the machine alone")
    p.add_argument("--json", default=None, help="write the reports as JSON here")
    p.set_defaults(func=run)


def _found(mode: str, report: dict) -> list[str]:
    """What in ``report`` is a failure."""
    problems = []
    if report.get("daemon_serving") is False:
        problems.append("the daemon stopped serving")
    if report.get("victim_bad"):
        problems.append(f"{report['victim_bad']} victim chunks lost or wrong")
    if mode == "fuzz" and report["bugs"]:
        problems.append(f"bug answers: {report['bugs'][:3]}")
    if mode in ("dying", "soak", "flood") and report.get("wrong"):
        problems.append(f"{report['wrong']} wrong reads")
    if mode == "soak" and report["errors"]:
        problems.append(f"{report['errors']} failed operations")
    if mode == "flood" and not report["new_client_ok"]:
        problems.append("no new client after the flood")
    if mode == "kill9" and report["lost_count"]:
        problems.append(f"{report['lost_count']} acknowledged durable chunks lost: {report['lost']}")
    if mode == "tenants" and report["leaks"]:
        problems.append(f"leaks: {report['leaks'][:3]}")
    if mode == "fairness":
        for pattern, phase in report.items():
            if not isinstance(phase, dict):
                continue
            if phase["victim_refused"] or phase["health_failed"]:
                problems.append(f"{pattern}: {phase['victim_refused']} victim requests refused, "
                                f"{phase['health_failed']} health checks failed")
            if (phase.get("p99_slowdown") or 0) > 2:
                problems.append(f"{pattern}: the victim's P99 {phase['p99_slowdown']}x its P99 alone")
    return problems


def _one(mode: str, args, root: str) -> dict:
    from bench.attacks import dying, fairness, flood, fuzz, kill9, soak, tenants  # here: they import torch
    from bench.attacks.target import start

    if mode == "kill9":
        return kill9.run(root, args.rounds).as_dict()
    fair = mode == "fairness"
    target = start(root, max_open_files=512 if mode == "flood" else None, prefault=mode == "soak",
                   extra=fairness.LIMITS if fair else "", tenant_extra=fairness.TENANT_EXTRA if fair else None)
    try:
        if mode == "fuzz":
            report = fuzz.run(target, args.messages, args.seed).as_dict()
        elif mode == "flood":
            report = flood.run(target, 2000, min(30.0, args.seconds / 10)).as_dict()
        elif mode == "dying":
            report = dying.run(target, args.rounds, args.seed).as_dict()
        elif mode == "tenants":
            report = tenants.run(target).as_dict()
        elif fair:  # the victim alone, then beside each pattern
            report = _fairness(target, args, root)
        else:
            report = soak.run(target, args.seconds, args.workers).as_dict()
        report["daemon_serving"] = target.serving()
        return report
    finally:
        target.process.stop()


def _fairness(target, args, root: str) -> dict:
    from bench.attacks import fairness
    from bench.attacks.target import start

    phases = 1 + len(fairness.PATTERNS) * (2 if args.control else 1)
    control = None
    if args.control:
        os.makedirs(os.path.join(root, "control"))
        control = start(os.path.join(root, "control"), victims=0, extra=fairness.LIMITS,
                        tenant_extra=fairness.TENANT_EXTRA)
    try:
        return fairness.run(target, args.seconds / phases, control)
    finally:
        if control is not None:
            control.process.stop()


def run(args) -> int:
    if args.messages <= 0 or args.seconds <= 0 or args.workers <= 0 or args.rounds <= 0:
        raise UsageError("--messages, --seconds, --workers and --rounds must be positive")
    modes = MODES if args.mode == "all" else (args.mode,)
    reports, failed = {}, False
    for mode in modes:
        root = tempfile.mkdtemp(prefix=f"kvbench-attack-{mode}-")
        try:
            reports[mode] = report = _one(mode, args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        problems = _found(mode, report)
        failed |= bool(problems)
        print(f"{mode:8} {'FAILED: ' + '; '.join(problems) if problems else 'ok'}  {json.dumps(report)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 1 if failed else 0
