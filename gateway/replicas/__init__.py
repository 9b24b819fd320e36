"""State shared by gateway replicas through Redis: the rate windows and revoked keys
(redis_limits.py), the queue bounds and fair share (redis_fair_share.py)."""
