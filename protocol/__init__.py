"""fairgate-package: protocol

The contracts every part of fairgate shares, each defined once: the OpenAI wire protocol
(`protocol.openai`), server-sent events (`protocol.sse`), the latency and SLO measures
(`protocol.measures`), config validators (`protocol.validators`), the fair-share cost
(`protocol.fairness`) and the priority classes (`protocol.priority`).

The bottom layer: it imports nothing heavy (no torch, no aiohttp, no SQLAlchemy), and every
other package depends downward on it.
"""
