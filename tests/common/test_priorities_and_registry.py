"""The shared floor's vocabulary: priority names and the worker registration record."""

from __future__ import annotations

import pytest

from common.priorities import PRIORITY_NAMES, Priority
from common.worker_registry import (
    REGISTRY_KEY_PREFIX,
    Registration,
    encode_registration,
    parse_registration,
    registration_key,
)
from worker.protocol import PROTOCOL_VERSION


def test_priority_names_parse_exactly() -> None:
    assert [Priority.parse(n) for n in PRIORITY_NAMES] == [Priority.INTERACTIVE, Priority.BATCH]
    assert Priority.BATCH.label == "batch"
    for bad in ("Batch", "urgent", ""):
        with pytest.raises(ValueError):
            Priority.parse(bad)


def test_registration_round_trip_and_rejects_bad_records() -> None:
    reg = Registration("w1", "tcp://h:1", "m", PROTOCOL_VERSION, 12.5)
    assert parse_registration(encode_registration(reg)) == reg
    assert registration_key("w1") == REGISTRY_KEY_PREFIX + "w1" == "{sy:workers}:worker:w1"
    for bad in ("{", "[]", '{"worker_id": "w"}', encode_registration(reg).replace('"m"', "3")):
        with pytest.raises(ValueError):
            parse_registration(bad)
    with pytest.raises(ValueError):
        parse_registration(encode_registration(Registration("w1", "tcp://h:1", "m", 1, 1.0, role="mystery")))
    assert reg.engine == "switchyard"  # older records, without the field, are Switchyard's engine
    vllm = Registration("w2", "tcp://h:2", "m", PROTOCOL_VERSION, 1.0, engine="vllm")
    assert parse_registration(encode_registration(vllm)).engine == "vllm"
    with pytest.raises(ValueError):
        parse_registration(encode_registration(Registration("w1", "tcp://h:1", "m", 1, 1.0, engine="trt")))
