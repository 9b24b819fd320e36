"""Typed application keys: the control plane's state in a gateway app (control.app.make_app)."""

from __future__ import annotations

from aiohttp import web

from control.canary import ServedWindow
from control.capture import TraceCapture
from control.jobs import JobManager
from control.shadow import ShadowSet

JOBS = web.AppKey("tune_jobs", JobManager)
SHADOWS = web.AppKey("shadow_targets", ShadowSet)
SERVED = web.AppKey("served_window", ServedWindow)  # live requests by backend: a canary's judge
CAPTURE: web.AppKey[TraceCapture | None] = web.AppKey("trace_capture")  # None: not configured
