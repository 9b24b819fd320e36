"""Typed application keys: the state of one gateway app."""

from __future__ import annotations

from aiohttp import web

from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.service import Gateway
from tenants import TenantStore

SETTINGS = web.AppKey("gateway_settings", GatewayConfig)
GATEWAY = web.AppKey("gateway", Gateway)
AUTH = web.AppKey("gateway_auth", Authenticator)
METRICS = web.AppKey("gateway_metrics", GatewayMetrics)
STORE = web.AppKey("tenant_store", TenantStore)
