"""Endpoint: a listen address parsed once by the config, then taken as it is by the
gateway, the units and the exporter (issue 24, §2)."""

from __future__ import annotations

import pytest

from configtext import MINIMAL
from sglang_farm.config import load_spec, parse_endpoint
from sglang_farm.errors import ConfigError
from sglang_farm.gateway.managed import from_spec
from sglang_farm.spec import Endpoint, GatewaySpec, MetricsSpec


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:9840", Endpoint("127.0.0.1", 9840)),
        ("[::1]:9840", Endpoint("::1", 9840)),
        ("0.0.0.0:0", Endpoint("0.0.0.0", 0)),
        ("gw.internal:65535", Endpoint("gw.internal", 65535)),
        ("[fd00::9]:8000", Endpoint("fd00::9", 8000)),
    ],
)
def test_parse_endpoint_splits_host_and_port_once(text: str, want: Endpoint) -> None:
    got = parse_endpoint(text)
    assert got == want
    assert str(got) == text  # the text back, IPv6 brackets included


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("9840", ", got '9840'"),
        (9840, ", got 9840"),
        (":9840", " with a port in 0..65535, got ':9840'"),
        ("host:", " with a port in 0..65535, got 'host:'"),
        ("host:http", " with a port in 0..65535, got 'host:http'"),
        ("h:65536", " with a port in 0..65535, got 'h:65536'"),
        ("[::1:9840", ", got '[::1:9840'"),
        ("::1]:9840", ", got '::1]:9840'"),
    ],
)
def test_parse_endpoint_refuses_what_is_not_host_port_saying_what_is(
    text: object, why: str
) -> None:
    with pytest.raises(ValueError) as err:
        parse_endpoint(text)
    assert str(err.value) == "expected 'host:port' (e.g. '127.0.0.1:9840', '[::1]:9840')" + why


def test_str_brackets_an_ipv6_host_only() -> None:
    assert str(Endpoint("::", 0)) == "[::]:0"
    assert str(Endpoint("localhost", 80)) == "localhost:80"


def test_the_spec_holds_endpoints_parsed_from_the_file() -> None:
    spec = load_spec(
        MINIMAL
        + '[metrics]\nlisten = "[::1]:9841"\n'
        + '[gateway]\nmode = "managed"\nlisten = "0.0.0.0:8001"\n'
        + 'metrics_listen = "127.0.0.1:29001"\napi_key_file = "/etc/k"\n',
        source="farm.toml",
    )
    assert spec.metrics.listen == Endpoint("::1", 9841)
    assert spec.gateway.listen == Endpoint("0.0.0.0", 8001)
    assert spec.gateway.metrics_listen == Endpoint("127.0.0.1", 29001)


def test_the_defaults_are_endpoints() -> None:
    assert MetricsSpec().listen == Endpoint("127.0.0.1", 9840)
    assert GatewaySpec().listen == Endpoint("127.0.0.1", 8000)
    assert GatewaySpec().metrics_listen == Endpoint("127.0.0.1", 29000)


def test_a_bad_listen_in_the_file_is_one_problem_on_its_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_spec(MINIMAL + '[metrics]\nlisten = "[::1]9840"\n', source="farm.toml")
    assert err.value.problems == (
        "farm.toml:7: metrics.listen: expected 'host:port' (e.g. '127.0.0.1:9840', "
        "'[::1]:9840') with a port in 0..65535, got '[::1]9840'",
    )


def test_the_managed_gateway_takes_the_endpoints_as_they_are() -> None:
    gw = from_spec(
        GatewaySpec(
            mode="managed",
            listen=Endpoint("::1", 8000),
            metrics_listen=Endpoint("127.0.0.2", 29000),
            policy="random",
        )
    )
    assert (gw.host, gw.port) == ("::1", 8000)
    assert (gw.metrics_host, gw.metrics_port) == ("127.0.0.2", 29000)
