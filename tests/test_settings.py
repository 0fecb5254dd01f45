"""Settings of the service and the shipped config files: precedence, checks, secrets, and
config/redis.conf and config/postgresql.conf loaded by the real servers."""

from __future__ import annotations

import argparse
import os
import pwd
import subprocess
import time
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import redis

from dedup import ConfigError, Gateway
from dedup.cli import build_parser
from dedup.service.settings import (
    ServiceSettings,
    Settings,
    load_config,
    load_service_settings,
    load_settings,
)
from tests.servers import PostgresCluster, find_redis_server, free_port

ROOT = Path(__file__).resolve().parent.parent


def test_service_precedence_flag_env_file_default(tmp_path: Path) -> None:
    config = tmp_path / "dedup.toml"
    config.write_text(
        '[gateway]\nlease_ms = 7000\n[service]\nport = 9001\nworkers = 3\nhost = "10.0.0.1"\n'
    )
    env = {"DEDUP_PORT": "9002", "DEDUP_WORKERS": "4", "DEDUP_LEASE_MS": "8000"}
    loaded = load_config(
        config_path=config,
        environ=env,
        gateway_flags={"redis_url": None},
        service_flags={"port": 9003, "workers": None, "host": None},
    )
    assert loaded.path == config
    service = loaded.service
    assert (service.port, service.workers, service.host) == (9003, 4, "10.0.0.1")
    assert service.drain_timeout_s == ServiceSettings().drain_timeout_s  # nobody said
    assert loaded.gateway.lease_ms == 8000
    assert load_service_settings(config_path=config, environ={}, flags={}).port == 9001
    # The gateway loader of earlier commands reads the same file, ignoring [service].
    assert load_settings(config_path=config, environ={}, flags={}).lease_ms == 7000


def test_no_config_file_means_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no config/dedup.toml here
    loaded = load_config(config_path=None, environ={}, gateway_flags={}, service_flags={})
    assert (loaded.gateway, loaded.service, loaded.path) == (Settings(), ServiceSettings(), None)


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[servise]\nport = 1\n", {}, r"unknown table \[servise\]"),
        ("[service]\nprot = 1\n", {}, "unknown setting 'prot' in \\[service\\]"),
        ("service = 1\n", {}, r"\[service\] must be a table"),
        ("[service]\nport = 'eighty'\n", {}, "port .* must be int"),
        ("", {"DEDUP_PORT": "http"}, "DEDUP_PORT must be int"),
        ("", {"DEDUP_PORT": "70000"}, "port must be 0-65535"),
        ("", {"DEDUP_WORKERS": "0"}, "workers must be 1-256"),
        ("", {"DEDUP_WORKERS": "2", "DEDUP_PORT": "0"}, "workers > 1 needs a fixed port"),
        ("", {"DEDUP_MAX_BODY_BYTES": "0"}, "max_body_bytes must be at least 1"),
        ("", {"DEDUP_DRAIN_TIMEOUT_S": "0"}, "drain_timeout_s must be a positive finite number"),
        ("", {"DEDUP_LOG_LEVEL": "loud"}, "log_level must be one of"),
        ("", {"DEDUP_ACCESS_LOG": "sometimes"}, "must be bool"),
        ("", {"DEDUP_HOST": ""}, "host must not be empty"),
        ("", {"DEDUP_AUTH_TOKEN": "two words"}, "printable ASCII without spaces"),
    ],
)
def test_service_settings_errors_are_clear(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    config = tmp_path / "dedup.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(config_path=config, environ=env, gateway_flags={}, service_flags={})


def test_auth_token_stays_out_of_repr_and_errors(tmp_path: Path) -> None:
    secret = "s3cret-token-value"
    settings = ServiceSettings(auth_token=secret)
    assert secret not in repr(settings)
    config = tmp_path / "dedup.toml"
    config.write_text("[service]\nauth_token = 12345678\n")  # a number where text belongs
    with pytest.raises(ConfigError) as raised:
        load_service_settings(config_path=config, environ={}, flags={})
    assert "12345678" not in str(raised.value)


def test_every_setting_has_its_own_environment_name() -> None:
    gateway = {f.name for f in fields(Settings)}
    service = {f.name for f in fields(ServiceSettings)}
    assert not gateway & service  # DEDUP_<NAME> would be ambiguous
    env = {f"DEDUP_{name.upper()}": "1" for name in ("workers", "max_batch_items")}
    loaded = load_config(config_path=None, environ=env, gateway_flags={}, service_flags={})
    assert (loaded.service.workers, loaded.service.max_batch_items) == (1, 1)


def test_shipped_config_lists_every_setting_with_its_default_and_a_comment() -> None:
    path = ROOT / "config" / "dedup.toml"
    document = tomllib.loads(path.read_text())
    assert set(document) == {"gateway", "service"}
    assert set(document["service"]) == {f.name for f in fields(ServiceSettings)}
    shipped = load_config(config_path=path, environ={}, gateway_flags={}, service_flags={})
    assert shipped.service == ServiceSettings() and shipped.gateway == Settings()
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


def test_gateway_kwargs_still_build_a_gateway() -> None:
    kwargs = load_settings(config_path=None, environ={}, flags={}).gateway_kwargs()
    Gateway(**kwargs)  # every key is an option; construction checks the values


def test_cli_takes_config_before_or_after_the_subcommand(tmp_path: Path) -> None:
    parser = build_parser()
    before = parser.parse_args(["--config", "a.toml", "serve", "--port", "1"])
    after = parser.parse_args(["serve", "--config", "b.toml", "--workers", "2"])
    neither = parser.parse_args(["check"])
    assert (before.config, before.port, before.workers) == ("a.toml", 1, None)
    assert (after.config, after.workers) == ("b.toml", 2)
    assert isinstance(neither, argparse.Namespace) and neither.config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--auth-token", "x"])  # secrets never on a command line


# ------------------------------------------------------------------- server config files


def test_redis_conf_is_what_dedup_needs(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "redis.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                find_redis_server(),
                str(ROOT / "config" / "redis.conf"),
                "--port",
                str(port),
                "--dir",
                str(tmp_path),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    client = redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=5)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
        config = {k: str(v) for k, v in client.config_get("*").items()}
        assert config["maxmemory-policy"] == "noeviction"
        assert config["protected-mode"] == "yes"
        assert config["bind"].split()[0] == "127.0.0.1"
        assert config["save"] == "" and config["appendonly"] == "no"
        assert int(config["maxmemory"]) > 0
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
    lines = (ROOT / "config" / "redis.conf").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no reason above {line!r}"


def test_postgresql_conf_is_accepted_and_durable(pg_cluster: PostgresCluster) -> None:
    conf = ROOT / "config" / "postgresql.conf"
    user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None  # postgres refuses root

    def show(name: str) -> str:
        # -C loads the whole file and fails on any unknown or invalid entry.
        result = subprocess.run(
            [
                str(pg_cluster.bin_dir / "postgres"),
                "-D",
                str(pg_cluster.data_dir),
                "-c",
                f"config_file={conf}",
                "-C",
                name,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            user=None if user is None else user.pw_uid,
            group=None if user is None else user.pw_gid,
            extra_groups=None if user is None else [],
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert (show("fsync"), show("synchronous_commit"), show("full_page_writes")) == (
        "on",
        "on",
        "on",
    )
    assert show("listen_addresses") == "localhost"
    assert 100 <= int(show("max_connections")) <= 500
    assert show("jit") == "off"
    lines = conf.read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no reason above {line!r}"
