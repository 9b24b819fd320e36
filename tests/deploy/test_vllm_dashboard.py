"""vLLM's own Grafana dashboard against a real `fairgate serve` (embedded engine) and a real
`fairgate engine`, both with `metrics_compat: vllm`: after a few requests, every metric each of
its panels' PromQL reads (vllm_dashboard.py: two versions of the dashboard) is in the
/metrics a Prometheus scrapes, of the type its sample name implies, with a sample for the served
model (the dashboard filters on `model_name="$model_name"`), and counted requests where it
counts them; its model_name variable finds the model. A panel whose series is missing shows "No
data", which is what a vLLM user moving to fairgate would see.

Also the `_created` series prometheus_client adds to each counter and histogram: exported by
default, and none with PROMETHEUS_DISABLE_CREATED_SERIES=true (as the README says to set)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.exposition import SAMPLE_SUFFIXES
from tests.deploy.vllm_dashboard import DASHBOARDS, dashboard_samples
from tests.support.processes import fairgate_process, free_port

# served under a Hugging Face style name, as vLLM users' engines are: the dashboard's model_name
ENGINE = {"executor": "sim", "sim_model": "tiny", "sim_clock": "realtime", "sim_hardware": "cpu",
          "max_model_len": 1024, "served_model_name": "acme/tiny-chat", "metrics_compat": "vllm"}
# (prompt, max_tokens, stream): one answer of a single token (no gap between tokens)
REQUESTS = (("hello there", 6, False), ("a longer prompt than the first", 3, True), ("x", 1, False))
# which samples of a family say it saw the requests: a panel of them is not a flat zero
COUNTED = {"counter": "_total", "histogram": "_count"}
LABEL_VALUES = re.compile(r'label_values\((?:\{__name__=~"(?P<names>[^"]*)"\},\s*)?(?P<label>\w+)\)')
CREATED_OFF = {"PROMETHEUS_DISABLE_CREATED_SERIES": "true"}


@dataclass(frozen=True)
class Scrape:
    """One /metrics answer: family name -> type, and sample name -> its samples' labels and
    values."""

    types: dict[str, str]
    samples: dict[str, list[tuple[dict[str, str], float]]]

    @classmethod
    def of(cls, text: str) -> Scrape:
        types: dict[str, str] = {}
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
        return cls(types, samples)

    def family(self, sample_name: str) -> tuple[str, str] | None:
        """The family `sample_name` belongs to and its type, by the exposition's suffixes
        (a counter's _total, a histogram's _bucket, _sum and _count); None if none."""
        for name, kind in self.types.items():
            if any(name + suffix == sample_name for suffix in SAMPLE_SUFFIXES[kind]):
                return name, kind
        return None

    def of_model(self, sample_name: str, model: str) -> list[float]:
        return [value for labels, value in self.samples.get(sample_name, ())
                if labels.get("model_name") == model]


def get(url: str, key: str | None = None) -> bytes:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
        assert resp.status == 200, url
        return bytes(resp.read())


def send_requests(base_url: str, key: str | None) -> str:
    """REQUESTS, each answered in full; the model /v1/models names."""
    [model] = [m["id"] for m in json.loads(get(f"{base_url}/v1/models", key))["data"]]
    headers = {"Content-Type": "application/json",
               **({} if key is None else {"Authorization": f"Bearer {key}"})}
    for prompt, max_tokens, stream in REQUESTS:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "stream": stream}).encode()
        request = urllib.request.Request(f"{base_url}/v1/completions", body, headers)
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = resp.read().decode()
            assert resp.status == 200, answer
        assert ("data: [DONE]" in answer) if stream else json.loads(answer)["usage"][
            "completion_tokens"] == max_tokens
    return model


def check_dashboard(name: str, scrape: Scrape, model: str) -> None:
    dashboard = DASHBOARDS[name]
    read = dashboard_samples(dashboard)
    assert len(read) >= 15, sorted(read)  # the expressions were read
    missing = []
    for sample_name, panels in sorted(read.items()):
        where = f"{sample_name} (panels {', '.join(sorted(panels))})"
        if (exported := scrape.family(sample_name)) is None:
            missing.append(f"{where}: not exported")
            continue
        family, kind = exported
        found = scrape.of_model(sample_name, model)
        counted = kind not in COUNTED or sum(scrape.of_model(family + COUNTED[kind], model)) > 0
        if not found or not counted:
            missing.append(f"{where}: a {kind}, samples for {model}: {found}")
    assert not missing, f"{name}: panels without data:\n" + "\n".join(missing)
    for variable, query in dashboard["variables"].items():
        match = LABEL_VALUES.fullmatch(query)
        assert match, query
        names = re.compile(match["names"] or ".*")
        values = {labels.get(match["label"]) for sample_name, samples in scrape.samples.items()
                  if names.fullmatch(sample_name) for labels, _ in samples}
        assert model in values, f"{name}: ${variable} ({query}) finds {values}"


def created_series(text: str) -> list[str]:
    return sorted({line.split("{")[0].split(" ")[0] for line in text.splitlines()
                   if line and not line.startswith("#")
                   and line.split("{")[0].split(" ")[0].endswith("_created")})


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    port = free_port()
    sets = [a for knob, value in ENGINE.items() if knob != "metrics_compat"
            for a in ("--set", f"{knob}={value}")]
    with fairgate_process("engine", "--port", str(port), *sets, "--metrics-compat", "vllm",
                          ready=b"serving ", timeout=120):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """A `fairgate serve` with its embedded engine set by fairgate.yaml's `engine` section:
    its URL, its demo key and its metrics listener's URL."""
    folder = tmp_path_factory.mktemp("serve")
    port = free_port()
    config = folder / "fairgate.yaml"
    config.write_text(yaml.safe_dump({
        "database": f"sqlite:///{folder / 'fg.db'}", "engine": ENGINE,
        "gateway": {"port": port, "metrics_port": 0}}))
    with fairgate_process("serve", "-c", str(config), ready=b"metrics on http://",
                          timeout=120) as (_, printed):
        lines = printed.decode().splitlines()
        [key] = [line.strip() for line in lines if line.strip().startswith("fg-")]
        [metrics] = re.findall(r"metrics on (http://\S+)/metrics", lines[-1])
        yield f"http://127.0.0.1:{port}", key, metrics


@pytest.mark.parametrize("dashboard", sorted(DASHBOARDS))
def test_vllms_dashboard_has_data_on_every_panel_against_fairgate_engine(
        engine: str, dashboard: str) -> None:
    model = send_requests(engine, None)
    assert model == ENGINE["served_model_name"]
    check_dashboard(dashboard, Scrape.of(get(f"{engine}/metrics").decode()), model)


@pytest.mark.parametrize("dashboard", sorted(DASHBOARDS))
def test_vllms_dashboard_has_data_on_every_panel_against_fairgate_serve(
        serve: tuple[str, str, str], dashboard: str) -> None:
    url, key, metrics = serve
    model = send_requests(url, key)
    assert model == ENGINE["served_model_name"]
    check_dashboard(dashboard, Scrape.of(get(f"{metrics}/metrics").decode()), model)


def test_the_created_series_go_with_prometheus_disable_created_series(engine: str) -> None:
    send_requests(engine, None)
    on = created_series(get(f"{engine}/metrics").decode())
    assert "vllm:request_success_created" in on and "fairgate_engine_prompt_tokens_created" in on
    port = free_port()
    with fairgate_process("engine", "--port", str(port), "--set", "executor=sim",
                          "--set", "sim_model=tiny", "--metrics-compat", "vllm",
                          ready=b"serving ", timeout=120, env=CREATED_OFF):
        url = f"http://127.0.0.1:{port}"
        send_requests(url, None)
        text = get(f"{url}/metrics").decode()
    assert "vllm:request_success_total" in text  # the series themselves stay
    assert created_series(text) == []
