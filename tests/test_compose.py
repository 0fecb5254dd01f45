"""docker-compose.yml and the Dockerfile, checked by reading them (no Docker engine here):
their commands parse with dedup's own CLI, and ports, paths and settings agree."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from dedup.cli import build_parser
from dedup.service.openapi import openapi_document
from dedup.service.settings import ServiceSettings, Settings

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = ServiceSettings()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return document


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = compose["services"]
    return found


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path of the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        out[container] = host
    return out


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    return dict(env) if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


def _default(text: str) -> str:
    """``${VAR:-default}`` as compose expands it with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_the_parts_are_all_there(services: dict[str, Any]) -> None:
    assert set(services) == {
        "redis", "postgres", "migrate", "gateway", "locust-master", "locust-worker"
    }  # fmt: skip


def test_gateway_command_matches_the_cli_and_config(services: dict[str, Any]) -> None:
    gateway = services["gateway"]
    command = gateway["command"]
    assert command[0] == "dedup"
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve" and args.host == "0.0.0.0"  # reachable in the network
    port = args.port if args.port is not None else DEFAULTS.port
    assert port == DEFAULTS.port
    assert [str(p) for p in gateway["expose"]] == [str(port)]
    for mapping in gateway.get("ports", []):
        host, _, container = str(mapping).rpartition(":")
        assert container == str(port)
        assert host.startswith("127.0.0.1:")  # published on loopback only
        assert "-" in host.rsplit(":", 1)[1], "a fixed host port would prevent --scale"
    health = " ".join(gateway["healthcheck"]["test"])
    url = re.search(r"http://[^'\" ]+", health)
    assert url is not None
    parsed = urlsplit(url[0])
    assert parsed.port == port
    paths = openapi_document(max_batch_items=1, max_body_bytes=1, auth=False, version="x")["paths"]
    assert parsed.path == "/readyz" and parsed.path in paths
    # SIGTERM drains for drain_timeout_s; Docker must not SIGKILL before.
    grace = int(gateway["stop_grace_period"].removesuffix("s"))
    drain = float(_env(gateway).get("DEDUP_DRAIN_TIMEOUT_S", DEFAULTS.drain_timeout_s))
    assert grace > drain
    conditions = {name: dep["condition"] for name, dep in gateway["depends_on"].items()}
    assert conditions == {
        "redis": "service_healthy",
        "postgres": "service_healthy",
        "migrate": "service_completed_successfully",
    }


def test_migrate_is_a_one_shot_dedup_migrate(services: dict[str, Any]) -> None:
    migrate = services["migrate"]
    args = build_parser().parse_args(migrate["command"][1:])
    assert migrate["command"][0] == "dedup" and args.command == "migrate"
    assert migrate["restart"] == "no"
    assert _env(migrate)["DEDUP_DATABASE_URL"] == _env(services["gateway"])["DEDUP_DATABASE_URL"]


def test_environment_names_are_settings(services: dict[str, Any]) -> None:
    known = {f"DEDUP_{f.name.upper()}" for cls in (Settings, ServiceSettings) for f in fields(cls)}
    for name in ("migrate", "gateway", "locust-master", "locust-worker"):
        for key in _env(services[name]):
            assert key in known, f"{name}: {key} is not a dedup setting"


def test_urls_point_at_the_servers_as_configured(services: dict[str, Any]) -> None:
    env = _env(services["gateway"])
    redis_url = urlsplit(env["DEDUP_REDIS_URL"])
    redis_conf = (ROOT / "config" / "redis.conf").read_text()
    redis_port = re.search(r"^port (\d+)$", redis_conf, re.M)
    assert redis_port is not None
    assert (redis_url.scheme, redis_url.hostname, redis_url.port) == (
        "redis",
        "redis",
        int(redis_port[1]),
    )
    db = urlsplit(_default(env["DEDUP_DATABASE_URL"]))
    pg_env = {k: _default(v) for k, v in _env(services["postgres"]).items()}
    pg_conf = (ROOT / "config" / "postgresql.conf").read_text()
    pg_port = re.search(r"^port = (\d+)$", pg_conf, re.M)
    assert pg_port is not None
    assert (db.scheme, db.hostname, db.port) == ("postgresql", "postgres", int(pg_port[1]))
    assert (db.username, db.password, db.path) == (
        pg_env["POSTGRES_USER"],
        pg_env["POSTGRES_PASSWORD"],
        "/" + pg_env["POSTGRES_DB"],
    )


def test_servers_run_with_the_shipped_config_files(services: dict[str, Any]) -> None:
    redis = services["redis"]
    mounts = _mounts(redis)
    assert redis["command"][0] == "redis-server"
    conf = redis["command"][1]
    assert mounts[conf] == "./config/redis.conf" and (ROOT / "config" / "redis.conf").is_file()
    postgres = services["postgres"]
    mounts = _mounts(postgres)
    config_file = next(
        a.split("=", 1)[1] for a in postgres["command"] if a.startswith("config_file=")
    )
    assert mounts[config_file] == "./config/postgresql.conf"
    assert (ROOT / "config" / "postgresql.conf").is_file()
    for name in ("redis", "postgres"):
        assert "ports" not in services[name], f"{name} must stay inside the compose network"
        assert services[name]["healthcheck"]["test"]


def test_locust_master_and_workers(services: dict[str, Any]) -> None:
    master, worker = services["locust-master"], services["locust-worker"]
    for service in (master, worker):
        command = service["command"]
        assert command[0] == "locust"
        locustfile = command[command.index("-f") + 1]
        mount = _mounts(service)[str(Path(locustfile).parent)]
        assert mount == "./loadtest" and Path(locustfile).name == "locustfile.py"
    assert "--master" in master["command"]
    host = urlsplit(master["command"][master["command"].index("--host") + 1])
    assert (host.hostname, host.port) == ("gateway", DEFAULTS.port)
    assert worker["command"][worker["command"].index("--master-host") + 1] == "locust-master"
    assert "--worker" in worker["command"]


def test_images_build_from_the_dockerfile(services: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M))
    for name, service in services.items():
        if "build" in service:
            assert service["build"]["context"] == "."
            assert service["build"]["target"] in targets, name
    # The image's own command is the gateway's.
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd is not None and json.loads(cmd[1]) == services["gateway"]["command"]
    expose = re.search(r"^EXPOSE (\d+)$", dockerfile, re.M)
    assert expose is not None and int(expose[1]) == DEFAULTS.port
    # Everything the image copies is in the build context (not excluded by .dockerignore).
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for source in shlex.split(line)[:-1]:
            assert source not in ignored and (ROOT / source).exists(), source
