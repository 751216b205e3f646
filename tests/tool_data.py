"""Shared by the tool-call tests: a tool set (weather, time), its
validators and a user turn asking for them."""

from __future__ import annotations

import jsonschema_rs

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["C", "F"]}},
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
