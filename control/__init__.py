"""fairgate-package: control

The control plane, above the serving path (`gateway/`) and the tuner: tune jobs and the canary
that applies their result (jobs.py, canary.py), shadow traffic (shadow.py, shadow_worker.py),
trace capture (capture.py), the SLO dashboard (dashboard.py) and the admin routes for them
(admin.py). `control.app.make_app` is `gateway.app.make_app` with all of this attached.
"""
