"""fairgate-package: protocol

The contracts every part of fairgate shares, each defined once: the OpenAI wire protocol
(`protocol.openai`), server-sent events (`protocol.sse`), the latency and SLO measures
(`protocol.measures`), config validators (`protocol.validators`), the fair-share cost
(`protocol.fairness`), the priority classes (`protocol.priority`) and the YAML loader every
file fairgate reads goes through (`protocol.yaml_files`).

The bottom layer: it imports nothing heavy (no torch, no aiohttp, no SQLAlchemy), and every
other package depends downward on it.
"""
