"""GatewayConfig: the `gateway` section of fairgate.yaml (the whole file is fairgate.config).

Every key has a default; an unknown key or a wrong value is a ValueError naming the key, so
`fairgate serve` fails at start with one line instead of misbehaving under load.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from engine.config import check_header_key, environment_keys
from gateway.auth import DEFAULT_OUTAGE_GRACE_S
from gateway.fairqueue import DISPATCH_POLICIES
from gateway.replicas.redis_limits import split_redis_url
from protocol.openai import MAX_MODEL_NAME, server_root
from protocol.serving import DEFAULT_HEADER_TIMEOUT_S
from protocol.validators import (
    check_bool,
    check_choice,
    check_http_url,
    check_int,
    check_number,
    check_positive_int,
    from_mapping,
)
from tenants.values import check_tenant_name, shown

BACKEND_KINDS = ("fairgate", "openai")
ROUTING_POLICIES = ("least_loaded", "prefix")
# A streamed answer's first token may wait for the engine's queue and a long prompt's prefill
# (a 128k-token prompt on a 70B model: tens of seconds); once tokens flow, a gap of 30 s is
# 100 times a slow decode step. Both end a hung engine's hold on a request long before
# request_timeout_s (600 s).
DEFAULT_FIRST_BYTE_TIMEOUT_S = 60.0
DEFAULT_STALL_TIMEOUT_S = 30.0
# The gateway's admin key from the environment (a Kubernetes Secret, compose's .env): `fairgate
# serve` takes it over gateway.admin_key; `fairgate jobs` and `fairgate tune` send it, and a tune
# job's worker is given it the same way.
ADMIN_KEY_ENV = "FAIRGATE_ADMIN_KEY"


class _Endpoint:
    """What a backend and a shadow target share: a server reached at `url` with its keys."""

    url: str
    api_key: str | None
    admin_key: str | None

    @property
    def base_url(self) -> str:
        return server_root(self.url)

    @property
    def effective_admin_key(self) -> str | None:
        """The key its /admin/* gets: admin_key, else api_key."""
        return self.admin_key if self.admin_key is not None else self.api_key


@dataclass(frozen=True)
class BackendConfig(_Endpoint):
    """A remote engine. `fairgate`: a `fairgate engine` server (has /load, takes tenant and
    priority); `openai`: any OpenAI-compatible server (vLLM, SGLang), held to `max_inflight`."""

    url: str
    kind: str = "fairgate"
    api_key: str | None = None  # sent on every request (/v1/*, /load)
    admin_key: str | None = None  # a fairgate engine's /admin/* (tune jobs, canary); None: api_key
    model: str | None = None  # the model name to send; None: the server's first /v1/models id
    max_inflight: int = 64  # the dispatch bound when the server has no /load
    # None: from /load, else the engine section's value, else 2048
    # (gateway.app.DEFAULT_REMOTE_MAX_MODEL_LEN)
    max_model_len: int | None = None
    # None: the gateway's backend_first_byte_timeout_s / backend_stall_timeout_s
    first_byte_timeout_s: float | None = None
    stall_timeout_s: float | None = None
    # "dns": the url's host names a set of replicas (a Kubernetes headless Service): one
    # backend per address it resolves to, looked up again every discover_interval_s
    discover: str | None = None
    discover_interval_s: float = 5.0
    # the engine's own model folder (or its tokenizer.json, beside tokenizer_config.json): its
    # prompts are counted exactly and sent to a fairgate engine as token ids, tokenized once
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError("gateway.backends[].tokenizer must be a path (the engine's model "
                             f"folder or its tokenizer.json), got {self.tokenizer!r}")
        if self.discover is not None:
            check_choice("gateway.backends[].discover", self.discover, ("dns",))
        check_number("gateway.backends[].discover_interval_s", self.discover_interval_s, low=0,
                     open_low=True)
        check_http_url("gateway.backends[].url", self.url)
        check_choice("gateway.backends[].kind", self.kind, BACKEND_KINDS)
        check_keys("gateway.backends[]", self)
        check_positive_int("gateway.backends[].max_inflight", self.max_inflight)
        if self.max_model_len is not None:
            check_positive_int("gateway.backends[].max_model_len", self.max_model_len)
        for name in ("first_byte_timeout_s", "stall_timeout_s"):
            if getattr(self, name) is not None:
                check_number(f"gateway.backends[].{name}", getattr(self, name), low=0,
                             open_low=True)


_PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
# a shadow target's URL and name, as the config check and the admin API's schema read them
SHADOW_URL_PATTERN = rf"^https?://[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:{_PORT})?(/v1)?$"
SHADOW_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# the model a shadow target is sent: a name an engine can serve, no control character in it
MODEL_NAME_PATTERN = rf"^[^\x00-\x1f\x7f-\x9f]{{1,{MAX_MODEL_NAME}}}$"


@dataclass(frozen=True)
class ShadowConfig(_Endpoint):
    """A shadow target (control/shadow.py): a candidate engine that receives a sample of the
    admitted live requests; its answers are measured and thrown away."""

    name: str
    url: str
    kind: str = "fairgate"
    model: str | None = None  # the model name to send; None: the live request's
    sample: float = 1.0  # the share of admitted requests copied
    tenants: tuple[str, ...] = ("all",)  # whose requests; ("all",): everyone's
    max_inflight: int = 16  # copies in flight at once (its own connection pool)
    max_queue: int = 256  # copies waiting for a slot; a copy finding it full is dropped
    api_key: str | None = None  # sent with every copy
    admin_key: str | None = None  # its /admin/* (shadow-mode tuning); None: api_key
    timeout_s: float = 120.0  # one copy, end to end, and the longest silence in its stream

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(SHADOW_NAME_PATTERN, self.name):
            raise ValueError("gateway.shadow[].name must be 1-64 letters, digits, '.', '_' or "
                             f"'-', got {self.name!r}")
        if not isinstance(self.url, str) or not re.fullmatch(SHADOW_URL_PATTERN, self.url):
            raise ValueError(f"gateway.shadow[{self.name}].url must be http(s)://host[:port] "
                             f"(optionally with /v1), got {self.url!r}")
        check_choice(f"gateway.shadow[{self.name}].kind", self.kind, BACKEND_KINDS)
        check_number(f"gateway.shadow[{self.name}].sample", self.sample, low=0, high=1)
        check_int(f"gateway.shadow[{self.name}].max_inflight", self.max_inflight, low=1,
                  high=1024)
        check_int(f"gateway.shadow[{self.name}].max_queue", self.max_queue, low=1,
                  high=1_000_000)
        check_number(f"gateway.shadow[{self.name}].timeout_s", self.timeout_s, low=0,
                     high=86400, open_low=True)
        check_keys(f"gateway.shadow[{self.name}]", self)
        if self.model is not None and (not isinstance(self.model, str)
                                       or not re.fullmatch(MODEL_NAME_PATTERN, self.model)):
            raise ValueError(f"gateway.shadow[{self.name}].model must be a model name (1-"
                             f"{MAX_MODEL_NAME} characters, no control characters) or null, "
                             f"got {shown(self.model)}")
        if not self.tenants:
            raise ValueError(f"gateway.shadow[{self.name}].tenants must be 'all' or a list of "
                             "tenant names")
        for tenant in self.tenants:
            try:
                check_tenant_name(tenant)
            except ValueError as exc:
                raise ValueError(f"gateway.shadow[{self.name}].tenants must be 'all' or a "
                                 f"list of tenant names: {exc}") from None

    @classmethod
    def from_dict(cls, value: Any) -> ShadowConfig:
        if not isinstance(value, dict):
            raise ValueError(f"gateway.shadow entries must be mappings with a name and a url, "
                             f"got {value!r}")
        value = dict(value)
        for name in ("max_inflight", "max_queue"):  # JSON's 341.0 is the integer 341
            number = value.get(name)
            if isinstance(number, float) and number.is_integer():
                value[name] = int(number)
        tenants = value.get("tenants", "all")
        if tenants == "all":
            value["tenants"] = ("all",)
        elif isinstance(tenants, list):
            value["tenants"] = tuple(tenants)
        else:
            raise ValueError("gateway.shadow[].tenants must be 'all' or a list of tenant names")
        return from_mapping(cls, value, "gateway.shadow")


@dataclass(frozen=True)
class CaptureConfig:
    """Trace capture (control/capture.py): served requests as a fairgate JSONL trace."""

    path: str
    sample: float = 1.0
    rotate_mb: float = 64.0  # past this size the file is renamed with a time stamp
    # the oldest rotated files are deleted past either bound (None: no bound): this many
    # rotated files, this many MB in all (the current file, never deleted, counted at rotate_mb)
    max_files: int | None = 16
    max_total_mb: float | None = 1024.0
    secret: str | None = None  # keys the prefix hashes (else FAIRGATE_CAPTURE_SECRET, else random)
    prompt_text: bool = False  # also write each prompt's text (off: nothing of it is written)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("gateway.capture.path must be a file path")
        check_number("gateway.capture.sample", self.sample, low=0, high=1)
        check_number("gateway.capture.rotate_mb", self.rotate_mb, low=0, open_low=True)
        if self.max_files is not None:
            check_int("gateway.capture.max_files", self.max_files, low=0)
        if self.max_total_mb is not None:
            check_number("gateway.capture.max_total_mb", self.max_total_mb, low=0,
                         open_low=True)
            if self.max_total_mb < self.rotate_mb:
                raise ValueError(f"gateway.capture.max_total_mb ({self.max_total_mb:g}) must be "
                                 f">= rotate_mb ({self.rotate_mb:g}): the current file alone "
                                 "grows to rotate_mb")
        check_bool("gateway.capture.prompt_text", self.prompt_text)
        if self.secret is not None and (not isinstance(self.secret, str) or len(self.secret) < 16):
            raise ValueError("gateway.capture.secret must be a string of at least 16 characters")


@dataclass(frozen=True)
class JobsConfig:
    """Tuning jobs (control/jobs.py): where their outputs go and how many run at once."""

    dir: str = "fairgate-jobs"  # one folder per job: best.yaml, the reports, the worker's log
    max_running: int = 1  # jobs running at once, oldest first; 0: this gateway runs none
    storage: str | None = None  # Optuna's storage; None: the gateway's database

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise ValueError("gateway.jobs.dir must be a directory path")
        check_int("gateway.jobs.max_running", self.max_running, low=0, high=64)
        if self.storage is not None and (not isinstance(self.storage, str) or "://" not in
                                         self.storage):
            raise ValueError("gateway.jobs.storage must be a database URL (sqlite:///jobs.db, "
                             "postgresql://...)")


@dataclass(frozen=True)
class OutlierDetectionConfig:
    """Outlier ejection (gateway/outlier.py), with Envoy's names: a replica whose requests fail
    (5xx other than overload, no connection, a reset, a timeout) leaves dispatch for a while."""

    consecutive_5xx: int = 5  # failures in a row that eject; 0: this rule is off
    interval_s: float = 10.0  # the window the failure percentage is measured over
    failure_percentage_threshold: float = 50.0  # a window with this % failed ejects
    failure_percentage_request_volume: int = 20  # ... once it holds this many requests
    base_ejection_time_s: float = 30.0  # times the number of ejections so far
    max_ejection_time_s: float = 300.0
    max_ejection_percent: float = 50.0  # of a model's replicas out at once; 0: none ever

    def __post_init__(self) -> None:
        name = "gateway.outlier_detection"
        check_int(f"{name}.consecutive_5xx", self.consecutive_5xx, low=0)
        check_positive_int(f"{name}.failure_percentage_request_volume",
                           self.failure_percentage_request_volume)
        check_number(f"{name}.failure_percentage_threshold", self.failure_percentage_threshold,
                     low=0, high=100, open_low=True)
        check_number(f"{name}.max_ejection_percent", self.max_ejection_percent, low=0, high=100)
        for key in ("interval_s", "base_ejection_time_s", "max_ejection_time_s"):
            check_number(f"{name}.{key}", getattr(self, key), low=0, open_low=True)
        if self.max_ejection_time_s < self.base_ejection_time_s:
            raise ValueError(f"{name}.max_ejection_time_s ({self.max_ejection_time_s:g}) must "
                             f"be >= base_ejection_time_s ({self.base_ejection_time_s:g})")


@dataclass(frozen=True)
class RetryBudgetConfig:
    """A request whose replica failed before any byte of an answer is retried once on another
    (Envoy's retry budget): retries under way at most `budget_percent` of the requests active
    (dispatched and queued), and `min_retry_concurrency` whatever that is."""

    budget_percent: float = 20.0
    min_retry_concurrency: int = 3

    def __post_init__(self) -> None:
        check_number("gateway.retry_budget.budget_percent", self.budget_percent, low=0,
                     high=100)
        check_int("gateway.retry_budget.min_retry_concurrency", self.min_retry_concurrency,
                  low=0)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    admin_key: str | None = None  # None: /admin/* is disabled
    backends: tuple[BackendConfig, ...] = ()  # empty: one embedded engine from `engine`
    shadow: tuple[ShadowConfig, ...] = ()  # candidate engines that receive copies of live traffic
    capture: CaptureConfig | None = None  # live traffic written as a fairgate trace
    jobs: JobsConfig = JobsConfig()  # tuning jobs through /admin/tune-jobs
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()  # failing replicas
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()  # retries on another replica
    dispatch: str = "fair"  # fair (priority class, then weighted VTC) | fcfs (the baseline)
    # which replica takes a request: least_loaded (most free room), or prefix: requests sharing
    # their prompt's first characters (and tenant, the cache salt) go to the same replica while
    # its load stays within prefix_load_factor x the average (consistent hashing, bounded loads)
    routing: str = "least_loaded"
    prefix_load_factor: float = 1.25
    prefix_chars: int = 2048  # of the prompt's text keyed for prefix routing (256 a chunk)
    tokenizer: str | None = None  # tokenizer.json for counting prompts sent to remote backends
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 600.0  # one request, end to end, once dispatched
    client_timeout_s: float = 30.0  # a client must finish sending its body within this
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # ... and its request headers (closed)
    queue_timeout_s: float = 30.0  # default for tenants without their own
    max_queued_requests: int = 1024  # per tenant, default for tenants without their own
    max_queued_tokens: int = 4_000_000  # per tenant, estimated tokens
    default_output_tokens: int = 256  # cost estimate without max_tokens or history
    output_estimate_window_s: float = 3600.0  # the history behind the p90 output estimate
    backend_poll_interval_s: float = 0.05  # how often remote /load is read
    backend_retry_after_s: float = 5.0  # Retry-After when no backend is reachable
    backend_waiting_slack: int = 4  # engine-side waiting requests tolerated before holding back
    # a remote backend's limits (its backends[] entry may set its own): request sent to first
    # token (streams; a non-streamed answer waits on while the backend passes its health
    # checks), and the longest silence mid-answer; either is a 504 and marks the backend down
    backend_first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S
    backend_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    # `fair`: the fraction of each backend's seats (max_num_seqs) kept free of tenants over
    # their weighted share, so a light tenant's request starts at once; 0 turns it off
    dispatch_headroom: float = 0.125
    demo_tenant: bool = True  # first start with no tenants: create "demo" and print its key
    log_requests: bool = False  # never logs keys or bodies; this adds tenant/status/latency lines
    # Metrics name every tenant: served on their own listener (loopback by default; null: none)
    # and on the main port only to a bearer of metrics_token (which the listener checks too)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9464
    metrics_token: str | None = None
    # failed key lookups per client address before unseen keys are answered 429 without a
    # database lookup (a bucket refilled at this rate, holding up to the burst); 0: no bound
    auth_failures_per_s: float = 10.0
    auth_failure_burst: int = 20
    # while the tenant database is away, keys that authenticated within this many seconds keep
    # working with their last known limits and weights (unknown keys: 503); 0: none do
    auth_outage_grace_s: float = DEFAULT_OUTAGE_GRACE_S
    # where usage records go when the database is still away at shutdown (written at the next
    # start; one file per database URL)
    usage_spill_dir: str = "."
    # raw usage rows older than this many days are deleted (hourly); the per-minute rollups the
    # dashboard's long views read are kept. None: keep every row.
    usage_retention_days: float | None = None
    # how long a shutdown keeps trying a database that is away before it spills (well inside
    # Kubernetes' default 30 s grace period, beside the streams it drains)
    usage_shutdown_flush_s: float = 10.0
    # redis://host:port/db[?key_prefix=name]: the requests/min and tokens/min windows shared by
    # every replica (gateway/replicas/redis_limits.py); None: each replica keeps its own
    redis: str | None = None

    def __post_init__(self) -> None:
        if self.redis is not None:
            split_redis_url(self.redis)
        check_choice("gateway.dispatch", self.dispatch, DISPATCH_POLICIES)
        check_choice("gateway.routing", self.routing, ROUTING_POLICIES)
        check_number("gateway.prefix_load_factor", self.prefix_load_factor, low=1)
        check_positive_int("gateway.prefix_chars", self.prefix_chars)
        check_int("gateway.port", self.port, low=0, high=65535)
        for name in ("max_body_bytes", "max_queued_requests", "max_queued_tokens",
                     "default_output_tokens"):
            check_positive_int(f"gateway.{name}", getattr(self, name))
        check_int("gateway.backend_waiting_slack", self.backend_waiting_slack, low=0)
        check_number("gateway.dispatch_headroom", self.dispatch_headroom, low=0, high=1,
                     open_high=True)
        for name in ("request_timeout_s", "client_timeout_s", "header_timeout_s",
                     "queue_timeout_s", "output_estimate_window_s", "backend_poll_interval_s",
                     "backend_retry_after_s", "backend_first_byte_timeout_s",
                     "backend_stall_timeout_s"):
            check_number(f"gateway.{name}", getattr(self, name), low=0, open_low=True)
        if self.admin_key is not None:
            check_admin_key("gateway.admin_key", self.admin_key)
        for name in ("demo_tenant", "log_requests"):
            check_bool(f"gateway.{name}", getattr(self, name))
        if self.metrics_port is not None:
            check_int("gateway.metrics_port", self.metrics_port, low=0, high=65535)
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ValueError("gateway.metrics_host must be a host name or address")
        if self.metrics_token is not None and (not isinstance(self.metrics_token, str)
                                               or len(self.metrics_token) < 16):
            raise ValueError("gateway.metrics_token must be a string of at least 16 characters")
        check_number("gateway.auth_failures_per_s", self.auth_failures_per_s, low=0)
        check_number("gateway.auth_outage_grace_s", self.auth_outage_grace_s, low=0)
        if self.usage_retention_days is not None:
            check_number("gateway.usage_retention_days", self.usage_retention_days, low=0,
                         open_low=True)
        if not isinstance(self.usage_spill_dir, str) or not self.usage_spill_dir:
            raise ValueError("gateway.usage_spill_dir must be a directory path")
        check_positive_int("gateway.auth_failure_burst", self.auth_failure_burst)

    def with_environment(self, environ: Mapping[str, str]) -> GatewayConfig:
        """This config with $FAIRGATE_ADMIN_KEY, when set and not empty, as the admin key,
        whatever the file says: the key can then live in a Secret and the file in a ConfigMap.
        Likewise $FAIRGATE_ENGINE_KEY and $FAIRGATE_ENGINE_ADMIN_KEY are the keys of every
        fairgate backend and shadow target that sets none of its own (never sent to an
        `openai` server: that is someone else's)."""
        key = environ.get(ADMIN_KEY_ENV)
        config = self if not key else replace(self, admin_key=check_admin_key(ADMIN_KEY_ENV, key))
        api_key, admin_key = environment_keys(environ)
        if api_key is None and admin_key is None:
            return config
        return replace(config,
                       backends=tuple(engine_keys(b, api_key, admin_key) for b in config.backends),
                       shadow=tuple(engine_keys(s, api_key, admin_key) for s in config.shadow))

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> GatewayConfig:
        values = dict(values or {})
        backends = values.get("backends") or []
        if not isinstance(backends, list):
            raise ValueError("gateway.backends must be a list of {url: ...} mappings")
        values["backends"] = tuple(_backend(b) for b in backends)
        shadow = values.get("shadow") or []
        if not isinstance(shadow, list):
            raise ValueError("gateway.shadow must be a list of {name, url, ...} mappings")
        values["shadow"] = tuple(ShadowConfig.from_dict(s) for s in shadow)
        capture = values.get("capture")
        if capture is not None:
            if not isinstance(capture, dict):
                raise ValueError("gateway.capture must be a mapping {path, sample, rotate_mb}")
            values["capture"] = from_mapping(CaptureConfig, capture, "gateway.capture")
        jobs = values.get("jobs")
        if jobs is not None:
            if not isinstance(jobs, dict):
                raise ValueError("gateway.jobs must be a mapping {dir, max_running, storage}")
            values["jobs"] = from_mapping(JobsConfig, jobs, "gateway.jobs")
        for key, section in (("outlier_detection", OutlierDetectionConfig),
                             ("retry_budget", RetryBudgetConfig)):
            if key in values:  # null: the defaults
                values[key] = from_mapping(section, values[key], f"gateway.{key}")
        names = [s.name for s in values["shadow"]]
        if len(set(names)) != len(names):
            raise ValueError(f"gateway.shadow names must be unique, got {names}")
        return from_mapping(cls, values, "gateway")


def check_admin_key(name: str, value: object) -> str:
    """The admin key, from the file (`gateway.admin_key`) or the environment (`ADMIN_KEY_ENV`)."""
    if not isinstance(value, str) or len(value) < 16:
        raise ValueError(f"{name} must be a string of at least 16 characters")
    return value


def check_keys(name: str, config: BackendConfig | ShadowConfig) -> None:
    """A backend's or shadow target's api_key and admin_key, when given."""
    for field in ("api_key", "admin_key"):
        if getattr(config, field) is not None:
            check_header_key(f"{name}.{field}", getattr(config, field))


Keyed = TypeVar("Keyed", BackendConfig, ShadowConfig)


def engine_keys(config: Keyed, api_key: str | None, admin_key: str | None) -> Keyed:
    """`config` with these keys when it is a fairgate engine that has no key of its own (one
    that has is another engine than the environment's)."""
    if config.kind != "fairgate" or config.api_key is not None or config.admin_key is not None:
        return config
    return replace(config, api_key=api_key, admin_key=admin_key)


def _backend(value: Any) -> BackendConfig:
    if isinstance(value, str):
        return BackendConfig(url=value)
    if not isinstance(value, dict):
        raise ValueError(f"gateway.backends entries must be mappings with a url, got {value!r}")
    return from_mapping(BackendConfig, value, "gateway.backends")
