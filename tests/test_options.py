"""GatewayOptions: the documented option table, the checks, and settings from every source."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedup import ConfigError, Gateway
from dedup.options import GatewayOptions, GatewayOptionsKwargs
from dedup.service.settings import Settings, load_settings

# The page whose "Gateway options" section holds the option table.
CONFIGURATION = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

# Defaults the table states in words rather than as a literal.
_WORDED = {
    "redis_url": "embedded",
    "database_url": "embedded SQLite",
    "sink": "`dedup_items`",
    "write_timeout_ms": "`lease_ms // 2`",
    "migrate": "embedded only",
    "cluster_shards": "0 (64 on a cluster)",
}


def _option_table() -> dict[str, str]:
    """option name -> the default cell of the option table of docs/configuration.md."""
    text = CONFIGURATION.read_text()
    section = text.split("\n## Gateway options\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(", ")] if len(names) > 1 else [cells[1]]
        assert len(defaults) == len(names), line
        table.update(zip(names, defaults, strict=True))
    return table


def _literal(cell: str) -> Any:
    cell = cell.strip("`")
    if cell in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[cell]
    if cell.startswith(("'", '"')):
        return cell.strip("'\"")
    number = cell.replace(",", "")
    try:
        return float(number) if "." in number else int(number)
    except ValueError:
        return cell  # a path or a word, as written


def test_documented_option_table_matches_the_dataclass() -> None:
    table = _option_table()
    assert set(table) == set(GatewayOptions.names())
    for f in fields(GatewayOptions):
        cell = table[f.name]
        if f.name in _WORDED:
            assert cell == _WORDED[f.name], f.name
        else:
            assert _literal(cell) == f.default, (f.name, cell, f.default)


def test_gateway_keywords_are_the_options() -> None:
    import inspect

    # The signature help() shows is spelled out from GatewayOptions, defaults included.
    params = inspect.signature(Gateway).parameters
    assert list(params) == list(GatewayOptions.names())
    for name, param in params.items():
        assert param.default == getattr(GatewayOptions(), name), name
    # The keywords' TypedDict names every option but the two URLs, with the same type.
    hints = get_type_hints(GatewayOptionsKwargs)
    option_types = get_type_hints(GatewayOptions)
    assert list(hints) == list(GatewayOptions.names())[2:]
    assert {**hints, "redis_url": str | None, "database_url": str | None} == option_types
    assert GatewayOptionsKwargs.__optional_keys__ == frozenset(hints)


def test_gateway_refuses_an_unknown_keyword() -> None:
    with pytest.raises(TypeError, match="Gateway\\(\\) got an unexpected keyword argument 'lease'"):
        Gateway(lease=5000)  # type: ignore[call-arg]


def test_derived_values() -> None:
    o = GatewayOptions(lease_ms=4000, max_batch=256, max_claim_batches=2, max_write_batches=3)
    assert o.write_timeout_s == 2.0 and o.write_timeout_ms_effective == 2000
    assert o.write_budget_s == pytest.approx(2.25)
    assert o.min_fill == 32
    assert o.max_backoff_s == 0.1 and o.min_backoff_s == 0.002
    assert o.redis_connections == 2 + 3 + 2 + 7  # claims, writes, probe and commit, shared
    assert (
        GatewayOptions(
            max_claim_batches=2, max_write_batches=3, shared_writes="off"
        ).redis_connections
        == 7
    )
    assert o.retention_ms == 0 and GatewayOptions(retention_s=1.5).retention_ms == 1500
    assert GatewayOptions(redis_url="redis+cluster://h:1").shards == 64
    assert GatewayOptions(redis_url="redis://h:1").shards == 0
    assert GatewayOptions().migrate_at_open
    assert not GatewayOptions(database_url="postgresql://h/db").migrate_at_open
    # The longest statement bounds that still leave a tenth of the lease to write in.
    assert GatewayOptions(lease_ms=1000, write_timeout_ms=800).write_budget_s == 0.9
    assert GatewayOptions(lease_ms=100, write_timeout_ms=80).write_timeout_s == 0.08


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lease_ms": 50}, "lease_ms must be at least 100"),
        ({"lease_ms": 1000, "write_timeout_ms": 1000}, "below lease_ms"),
        # 950 ms of 1,000 would leave no winner time to write: every one renews for ever.
        ({"lease_ms": 1000, "write_timeout_ms": 801}, "at most 800"),
        ({"lease_ms": 100, "write_timeout_ms": 81}, "at most 80"),
        ({"max_batch": 0}, "max_batch must be at least 1"),
        ({"max_batch": 600, "max_pending": 500}, "must not exceed max_pending"),
        ({"wait_timeout_s": 0}, "wait_timeout_s must be a finite number above 0"),
        ({"retention_s": -1.0}, "retention_s"),
        ({"max_batch": 2.0}, "whole number"),
        ({"max_batch": True}, "whole number"),
        ({"allow_eviction": "yes"}, "allow_eviction must be True or False"),
        ({"redis_url": "http://x"}, "redis_url must start with"),
        ({"database_url": "mysql://x"}, "database_url must start with"),
        ({"database_url": "sqlite:///x", "sink": print}, "either database_url or sink"),
    ],
)
def test_bad_options_raise_config_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GatewayOptions(**kwargs)
    with pytest.raises(ValueError, match=match):  # ConfigError is also a ValueError
        Gateway(**kwargs)


FLOAT_OPTIONS = [f.name for f in fields(GatewayOptions) if "float" in str(f.type)]
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


@settings(deadline=None, max_examples=60)
@given(name=st.sampled_from(FLOAT_OPTIONS), bad=NON_FINITE)
def test_non_finite_numbers_refused_by_the_gateway(name: str, bad: float) -> None:
    kwargs: dict[str, Any] = {name: bad}
    with pytest.raises(ConfigError, match=name):
        Gateway(**kwargs)


SETTING_FLOATS = [f.name for f in fields(Settings) if f.type == "float"]


@settings(deadline=None, max_examples=120)
@given(
    name=st.sampled_from(SETTING_FLOATS),
    text=st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "-Infinity"]),
    source=st.sampled_from(["env", "file", "flag"]),
)
def test_non_finite_settings_refused_from_every_source(
    tmp_path_factory: pytest.TempPathFactory, name: str, text: str, source: str
) -> None:
    config = tmp_path_factory.mktemp("cfg") / "dedup.toml"
    environ: dict[str, str] = {}
    flags: dict[str, Any] = {}
    if source == "env":
        environ[f"DEDUP_{name.upper()}"] = text
        where = f"DEDUP_{name.upper()}"
    elif source == "file":
        # TOML spells them nan / inf / -inf; other spellings are strings, refused as well.
        toml = text.lower().replace("infinity", "inf")
        config.write_text(f"[gateway]\n{name} = {toml}\n")
        where = str(config)
    else:
        flags[name] = text
        where = f"--{name.replace('_', '-')}"
    if source != "file":
        config.write_text("")
    with pytest.raises(ConfigError) as caught:
        load_settings(config_path=config, environ=environ, flags=flags).options()
    assert name in str(caught.value) and where in str(caught.value)


def test_settings_cover_every_option() -> None:
    names = {f.name for f in fields(Settings)}
    assert names == set(GatewayOptions.names()) - {"sink"}
    assert Settings().options() == GatewayOptions()
    # The settings' defaults are the options', None spelled as the file spells it.
    defaults = {name: GatewayOptions.default(name) for name in names}
    assert Settings().gateway_kwargs() == defaults
    spelled = {"redis_url": "", "write_timeout_ms": 0, "retention_s": 0.0, "migrate": "auto"}
    for name, word in spelled.items():
        assert defaults[name] is None and getattr(Settings(), name) == word
    assert Settings(migrate="true").options().migrate is True
    custom = Settings(write_timeout_ms=700, migrate="false", retention_s=5.0, require_redis=True)
    options = custom.options()
    assert options.write_timeout_ms == 700 and options.migrate is False
    assert options.retention_s == 5.0 and options.require_redis
    with pytest.raises(ConfigError, match="migrate"):
        Settings(migrate="sometimes")
