"""The fairness key and weight on their way to the worker: tenant `weight` in Redis, the gateway's keyed
digest, the optional `gen` fields (defaults when absent, strict checks when present).
"""

from __future__ import annotations

import msgpack
import pytest

from config.cli import main as cli_main
from router import fairness_key
from tenancy import tenant_admin as store
from tenancy.redis_client import sync_client
from tenancy.schema import config_key, parse_tenant, parse_weight
from tenancy.tenancy_errors import TenancyError
from worker import protocol as p
from worker.server.telemetry.worker_metrics import OTHER, FairLabels

pytestmark = pytest.mark.timeout(30)
SECRET = b"test-secret"


def _gen(**extra) -> bytes:
    obj = {"t": "gen", "rid": "r", "ns": b"n", "tokens": p.pack_tokens([1, 2]), "sampling": {},
           "priority": 0, "deadline": 0.0, **extra}
    return msgpack.packb(obj, use_bin_type=True)


def test_gen_carries_fkey_and_weight_and_defaults_when_absent() -> None:
    frame = p.encode_gen("r", b"n", [1, 2], p.SamplingParams(), fkey=b"k" * 8, weight=2.5)
    req = p.decode_gateway_frame(frame, max_prompt_tokens=8)
    assert (req.fkey, req.weight) == (b"k" * 8, 2.5)
    old = p.decode_gateway_frame(_gen(), max_prompt_tokens=8)  # an older gateway sends neither
    assert (old.fkey, old.weight) == (b"", 1.0)
    assert p.decode_gateway_frame(_gen(weight=3), max_prompt_tokens=8).weight == 3.0


@pytest.mark.parametrize(("extra", "param"), [
    ({"fkey": b"x" * 65}, "fkey"), ({"fkey": "text"}, "fkey"), ({"weight": 0}, "weight"),
    ({"weight": -1.0}, "weight"), ({"weight": float("nan")}, "weight"), ({"weight": float("inf")}, "weight"),
    ({"weight": True}, "weight"), ({"weight": "2"}, "weight"), ({"weight": 1000.5}, "weight"),
])
def test_bad_fairness_fields_name_rid_and_param(extra: dict, param: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_gateway_frame(_gen(**extra), max_prompt_tokens=8)
    assert (info.value.rid, info.value.param) == ("r", param)


def test_fairness_key_is_keyed_stable_and_per_tenant() -> None:
    a = fairness_key("acme", SECRET)
    assert a == fairness_key("acme", SECRET) and len(a) == 8
    assert a != fairness_key("acme2", SECRET) and a != fairness_key("acme", b"other-secret")
    assert b"acme" not in a
    with pytest.raises(ValueError):
        fairness_key("acme", b"")


def test_weight_parse_defaults_and_bounds() -> None:
    assert parse_tenant("t", {}).weight == 1.0
    assert parse_tenant("t", {b"weight": b"2.5"}).weight == 2.5
    for raw in ("0", "-3", "nan", "inf", "abc", "1001"):
        assert parse_weight(raw) == 1.0


def test_weight_is_settable_by_store_cli_and_hset(redis_url, capsys) -> None:
    r = sync_client(redis_url)
    try:
        assert store.create_tenant(r, "acme", weight=2).weight == 2.0
        assert store.update_tenant(r, "acme", weight=0.5).weight == 0.5
        for bad in (0, -1, True, "2", float("nan"), 1001):
            with pytest.raises(TenancyError):
                store.update_tenant(r, "acme", weight=bad)
        assert cli_main(["tenants", "set", "acme", "--weight", "3", "--redis-url", redis_url]) == 0
        assert "weight=3" in capsys.readouterr().out
        r.hset(config_key("acme"), "weight", "4")
        assert store.get_tenant(r, "acme").weight == 4.0
    finally:
        r.close()


def test_metric_labels_are_bounded_hex_prefixes() -> None:
    labels = FairLabels(limit=2)
    assert labels(b"\x01\x02\x03\x04\x05") == "01020304"
    assert labels(b"\xff" * 8) == "ffffffff"
    assert labels(b"third-key") == OTHER
    assert labels(b"\x01\x02\x03\x04\x05") == "01020304"  # known keys keep their label
