"""docs/metrics.md against what a scrape shows (tests/deploy/exposition.py's sample names, from
the registries the servers' own apps build): every metric name the page mentions is exported by
the server the page puts it under (`fairgate_engine_*`, `vllm:*` with `metrics_compat: vllm`, and
the process metrics: `fairgate engine`; `fairgate_gateway_*`: the gateway with its control plane),
and every family those servers export is named in that server's section of the page.

How the page writes names: a counter as the sample a query selects (`x_total`), any other family
by its own name (a histogram `x`, scraped as `x_bucket`, `x_sum`, `x_count`); `a_b|c` is `a_b`
and `a_c`; a `_name` span that continues a list of names shares the last full name's
`fairgate_<server>_` prefix; a name ending in `*` (or in `_` or `:`) is every name it starts."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry

from control.app import make_app as make_gateway_app
from engine import EngineConfig
from engine.async_engine import AsyncEngine
from engine.server import METRICS_KEY
from engine.server import make_app as make_engine_app
from gateway.config import GatewayConfig
from gateway.state import METRICS
from tests.deploy.exposition import ROOT, exposed_names, recorded_names, rule_files
from tests.test_docs import section

PAGE = ROOT / "docs" / "metrics.md"
ENGINE_SECTION, GATEWAY_SECTION = "Engine metrics", "Gateway metrics (per tenant)"
# a name's server and its configuration, by the name's prefix: the page's grouping
ENGINE, ENGINE_VLLM, GATEWAY = ("fairgate engine", "fairgate engine, metrics_compat: vllm",
                               "fairgate serve")
SERVER_OF = {"fairgate_engine_": ENGINE, "vllm:": ENGINE_VLLM, "process_": ENGINE,
             "python_": ENGINE, "fairgate_gateway_": GATEWAY}
_NAME = re.compile(r"(?<![\w:])(?:fairgate_|vllm:|process_|python_)[\w:]*(?:\|\w+)*\*?")
_CONTINUED = re.compile(r"(?<=`,)\s*`(_\w+)`")  # `x`, `_y`: the list goes on with x's prefix
_SERVER_PREFIX = re.compile(r"fairgate_[a-z]+_|vllm:")
_RECORDED = re.compile(r"(?<![\w:])fairgate:[\w:]+")


class Exposition:
    """One server's /metrics: its families by the name the page writes them with, and every
    sample name a scrape shows."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.families = {family.name + ("_total" if family.type == "counter" else "")
                         for family in registry.collect()}
        self.samples = exposed_names(registry)

    def exports(self, name: str) -> bool:
        if name.endswith("*"):
            return any(sample.startswith(name[:-1]) for sample in self.samples)
        return name in self.families or name in self.samples


def page_names(text: str) -> set[str]:
    """The metric names `text` mentions, shorthands spelled out; a prefix ends in `*`."""
    tokens = sorted([(m.start(), m.group()) for m in _NAME.finditer(text)]
                    + [(m.start(1), m.group(1)) for m in _CONTINUED.finditer(text)])
    names: set[str] = set()
    last = ""
    for _, token in tokens:
        if token.startswith("_"):
            prefix = _SERVER_PREFIX.match(last)
            assert prefix, f"`{token}` continues no list of metric names"
            token = prefix.group() + token[1:]
        else:
            last = token
        first, *others = token.split("|")
        stem = first.rsplit("_", 1)[0]
        for name in (first, *(f"{stem}_{other}" for other in others)):
            names.add(name + "*" if name.endswith(("_", ":")) else name)
    return names


def server_of(name: str) -> str:
    for prefix, server in SERVER_OF.items():
        if name.startswith(prefix):
            return server
    raise AssertionError(f"docs/metrics.md names {name}, under no server")


def sim_engine(metrics_compat: str | None) -> EngineConfig:
    return EngineConfig(executor="sim", max_model_len=512, max_num_seqs=8,
                        max_num_batched_tokens=512, metrics_compat=metrics_compat)


def engine_registry(metrics_compat: str | None) -> CollectorRegistry:
    """What `fairgate engine`'s /metrics serves (its app, not started)."""
    return make_engine_app(AsyncEngine(sim_engine(metrics_compat)))[METRICS_KEY].registry


def gateway_registry(database: str) -> CollectorRegistry:
    """What `fairgate serve`'s metrics listener serves (its app, not started): the gateway, its
    control plane's shadow series, its embedded engine with vLLM's names, and with
    `gateway.redis` set the shared state's series (registered when the app is built; nothing
    connects)."""
    app = make_gateway_app(GatewayConfig(redis="redis://127.0.0.1:6379/0"),
                           engine=sim_engine("vllm"), database=database)
    return app[METRICS].registry


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Exposition]:
    database = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('metrics') / 'gateway.db'}"
    return {ENGINE: Exposition(engine_registry(None)),
            ENGINE_VLLM: Exposition(engine_registry("vllm")),
            GATEWAY: Exposition(gateway_registry(database))}


def page() -> str:
    return PAGE.read_text()


def test_the_page_shorthands_read_as_names() -> None:
    text = ("`fairgate_engine_requests_running|waiting|swapped`, histograms "
            "`fairgate_gateway_queue_time_seconds`,\n`_ttft_seconds`, `_itl_seconds`, "
            "`fairgate_gateway_slo_requests_total{tenant,slo=\"ttft\"|\"tpot\"}`, `python_gc_*`,"
            " its `vllm:` series.\n## The `_created` series")
    assert page_names(text) == {
        "fairgate_engine_requests_running", "fairgate_engine_requests_waiting",
        "fairgate_engine_requests_swapped", "fairgate_gateway_queue_time_seconds",
        "fairgate_gateway_ttft_seconds", "fairgate_gateway_itl_seconds",
        "fairgate_gateway_slo_requests_total", "python_gc_*", "vllm:*"}


def test_each_name_the_page_mentions_is_exported_by_its_server(
        servers: dict[str, Exposition]) -> None:
    names = page_names(page())
    assert len(names) > 50, "the page's names were not found: has its notation changed?"
    stale = sorted(f"{name} ({server_of(name)})" for name in names
                   if not servers[server_of(name)].exports(name))
    assert not stale, f"docs/metrics.md names series its server does not export: {stale}"


@pytest.mark.parametrize(("server", "prefixes", "heading"), [
    (ENGINE, ("fairgate_engine_",), ENGINE_SECTION),
    (ENGINE_VLLM, ("fairgate_engine_", "vllm:"), ENGINE_SECTION),
    (GATEWAY, ("fairgate_gateway_",), GATEWAY_SECTION),
])
def test_each_family_a_server_exports_is_named_in_its_section(
        servers: dict[str, Exposition], server: str, prefixes: tuple[str, ...],
        heading: str) -> None:
    """The process metrics are left out: the page names a few and says there are more."""
    documented = page_names(section(page(), heading))
    missing = sorted(name for name in servers[server].families
                     if name.startswith(prefixes) and name not in documented)
    assert not missing, f"{server} exports families the page's {heading!r} omits: {missing}"


def test_the_embedded_engine_exports_what_fairgate_engine_does(
        servers: dict[str, Exposition]) -> None:
    """The page: the gateway's /metrics carries its embedded engine's series "with the names
    ... `fairgate engine` serves", and vLLM's with `engine.metrics_compat: vllm`."""
    engine_own = ("fairgate_engine_", "vllm:")
    gateway = servers[GATEWAY].families
    assert {n for n in gateway if n.startswith(engine_own)} == {
        n for n in servers[ENGINE_VLLM].families if n.startswith(engine_own)}
    assert all(n.startswith((*engine_own, "fairgate_gateway_")) for n in gateway)


def test_the_recording_rules_the_page_names_are_defined() -> None:
    named = set(_RECORDED.findall(page()))
    assert named, "the page names the SLO recording rules"
    assert named <= recorded_names(rule_files()), named - recorded_names(rule_files())

