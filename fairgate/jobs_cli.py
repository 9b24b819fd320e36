"""`fairgate jobs list | show ID | cancel ID | resume ID | apply ID --backend URL`: tuning jobs
through a gateway's admin API (`/admin/tune-jobs`), for people who prefer a terminal.

    fairgate jobs create --spec job.json|job.yaml (a job spec: `fairgate tune`'s spec fields)
    fairgate jobs list [--json]
    fairgate jobs show ID [--json]
    fairgate jobs cancel ID
    fairgate jobs resume ID
    fairgate jobs apply ID --backend URL [--canary-window S] [--min-requests N] [--wait]

--gateway URL (default http://127.0.0.1:8080, or $FAIRGATE_GATEWAY) and --admin-key KEY
(default $FAIRGATE_ADMIN_KEY). A gateway's error is one line and exit status 1; bad input or
an unreachable gateway, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from fairgate.actions import chosen_action
from gateway.config import ADMIN_KEY_ENV
from protocol.validators import check_http_url
from tuner.outcome import knob_text
from tuner.remote import error_text, request_json

GATEWAY_ENV = "FAIRGATE_GATEWAY"
DEFAULT_GATEWAY = "http://127.0.0.1:8080"
ENDED = ("promoted", "rolled_back")  # a failed apply rolls back, then says failed last


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    create = sub.add_parser("create", help="start a job from a JSON spec file")
    create.add_argument("--spec", required=True, metavar="FILE",
                        help="the job spec (YAML, or JSON if it ends in .json): `fairgate "
                        "tune`'s spec fields a job may set (mode, workload, space, SLOs, "
                        "trials, ...), or captured_minutes")
    listing = sub.add_parser("list", help="every job: state, progress, best so far")
    show = sub.add_parser("show", help="one job with its trials")
    show.add_argument("job_id", metavar="ID", help="the job's id (`fairgate jobs list`)")
    cancel = sub.add_parser("cancel", help="cancel a job (its engine keeps its knobs)")
    cancel.add_argument("job_id", metavar="ID", help="the job's id (`fairgate jobs list`)")
    resume = sub.add_parser("resume", help="queue an interrupted, failed or cancelled job again")
    resume.add_argument("job_id", metavar="ID", help="the job's id (`fairgate jobs list`)")
    apply = sub.add_parser("apply", help="apply a job's best config as a canary, then promote "
                           "or roll back")
    apply.add_argument("job_id", metavar="ID", help="the job's id (`fairgate jobs list`)")
    apply.add_argument("--backend", required=True, metavar="URL", help="the canary replica")
    apply.add_argument("--canary-window", type=float, metavar="S",
                       help="seconds of live traffic to judge it on (default 60)")
    apply.add_argument("--min-requests", type=int, metavar="N",
                       help="requests each side must see (default 20)")
    apply.add_argument("--wait", action="store_true", help="follow it until promoted or "
                       "rolled back")
    for p in (create, listing, show, cancel, resume, apply):
        p.add_argument("--gateway", default=os.environ.get(GATEWAY_ENV, DEFAULT_GATEWAY),
                       metavar="URL", help=f"the gateway (default ${GATEWAY_ENV} or "
                       f"{DEFAULT_GATEWAY})")
        p.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV), metavar="KEY",
                       help=f"its admin key (default ${ADMIN_KEY_ENV})")
    for p in (listing, show):
        p.add_argument("--json", action="store_true", help="JSON instead of text")


class GatewayError(Exception):
    """The gateway answered with an error (a one-line message)."""


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    url = check_http_url("--gateway", args.gateway).rstrip("/") + path
    try:
        status, answer = request_json(url, args.admin_key, body, timeout=30.0, method=method)
    except OSError as exc:
        raise ValueError(f"cannot reach --gateway {args.gateway}: "
                         f"{getattr(exc, 'reason', exc)}") from None
    if status >= 400:
        hint = " (give --admin-key or set $FAIRGATE_ADMIN_KEY)" if status == 401 else ""
        raise GatewayError(f"{method} {path}: {status} {error_text(answer, status)}{hint}")
    return answer


def run(args: argparse.Namespace) -> int:
    action = chosen_action(args, "jobs", ACTIONS)
    if action is None:
        return 2
    try:
        return int(ACTIONS[action](args))
    except GatewayError as exc:
        print(f"fairgate jobs {action}: {exc}", file=sys.stderr)
        return 1


def _create(args: argparse.Namespace) -> int:
    from tuner.options import read_spec  # the gateway checks the fields, as `fairgate tune`

    job = _call(args, "POST", "/admin/tune-jobs", read_spec(args.spec))
    print(job["id"])
    return 0


def _progress(job: dict[str, Any]) -> str:
    p = job.get("progress") or {}
    done, planned = p.get("trials_done", 0), p.get("trials_planned")
    text = f"{done}/{planned}" if planned else str(done)
    left = p.get("estimate_left_s")
    return text + (f", ~{left:.0f} s left" if left else "")


def _best(job: dict[str, Any]) -> str:
    best = job.get("best")
    if not best:
        return "-"
    knobs = ", ".join(f"{k}={knob_text(v)}" for k, v in sorted(best["params"].items()))
    return f"#{best['number']} {best['value']:.4g} ({knobs})"


def _list(args: argparse.Namespace) -> int:
    jobs = _call(args, "GET", "/admin/tune-jobs")["jobs"]
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no tune jobs")
        return 0
    print(f"{'ID':<17} {'STATE':<12} {'MODE':<7} {'TRIALS':<20} BEST")
    for job in jobs:
        print(f"{job['id']:<17} {job['state']:<12} {job['spec']['mode']:<7} "
              f"{_progress(job):<20} {_best(job)}")
    return 0


def _show(args: argparse.Namespace) -> int:
    job = _call(args, "GET", f"/admin/tune-jobs/{args.job_id}")
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(f"{job['id']}: {job['state']} ({job['spec']['mode']}, {job['spec']['objective']}), "
          f"trials {_progress(job)}, runs {job['runs']}")
    if job.get("error"):
        print(f"  {job['error']}")
    print(f"  best: {_best(job)}")
    for trial in job.get("trials", []):
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(trial["params"].items()))
        value = "-" if trial["value"] is None else f"{trial['value']:.4g}"
        why = f"  ({trial['infeasible']})" if trial.get("infeasible") else ""
        print(f"  #{trial['number']:<4} {trial['state']:<9} {value:>10}  {knobs}{why}")
    for name, link in sorted(job.get("links", {}).items()):
        print(f"  {name}: {args.gateway.rstrip('/')}{link}")
    if job.get("apply"):
        _print_apply(job["apply"])
    return 0


def _print_apply(record: dict[str, Any]) -> None:
    print(f"  apply to {record['backend']}: {record['state']}")
    for step in record.get("steps", []):
        print(f"    {time.strftime('%H:%M:%S', time.localtime(step['at']))} {step['step']}")


def _cancel(args: argparse.Namespace) -> int:
    job = _call(args, "DELETE", f"/admin/tune-jobs/{args.job_id}")
    print(f"{job['id']}: {job['state']}")
    return 0


def _resume(args: argparse.Namespace) -> int:
    job = _call(args, "POST", f"/admin/tune-jobs/{args.job_id}/resume")
    print(f"{job['id']}: {job['state']}")
    return 0


def _apply(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"backend": args.backend}
    if args.canary_window is not None:
        body["canary_window_s"] = args.canary_window
    if args.min_requests is not None:
        body["min_requests"] = args.min_requests
    record = _call(args, "POST", f"/admin/tune-jobs/{args.job_id}/apply", body)
    print(f"{args.job_id}: applying to {record['backend']}")
    if not args.wait:
        return 0
    shown = 0
    while True:
        record = _call(args, "GET", f"/admin/tune-jobs/{args.job_id}")["apply"]
        for step in record["steps"][shown:]:
            print(f"  {step['step']}")
        shown = len(record["steps"])
        last = record["steps"][-1]["step"] if record["steps"] else ""
        if record["state"] in ENDED or (record["state"] == "failed"
                                        and last.startswith("stopped:")):
            return 0 if record["state"] == "promoted" else 1
        time.sleep(0.5)


ACTIONS = {"create": _create, "list": _list, "show": _show, "cancel": _cancel,
           "resume": _resume, "apply": _apply}
