"""Typed application keys: the control plane's state in a gateway app (control.app.make_app)."""

from __future__ import annotations

from aiohttp import web

from control.capture import TraceCapture
from control.jobs import JobManager
from control.shadow import ShadowSet

JOBS = web.AppKey("tune_jobs", JobManager)
SHADOWS = web.AppKey("shadow_targets", ShadowSet)
CAPTURE: web.AppKey[TraceCapture | None] = web.AppKey("trace_capture")  # None: not configured
