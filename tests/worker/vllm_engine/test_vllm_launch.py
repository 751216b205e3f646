"""A vLLM-engine worker's start-up checks and request mapping, without vLLM: Switchyard-engine settings and
GGUF models are refused by name before vLLM loads, and sampling maps field for field or is
refused with its param."""

from __future__ import annotations

import subprocess
import sys

import pytest

from config.settings import WorkerSettings
from worker.protocol import RequestError, SamplingParams, json_schema_spec
from worker.vllm_engine.launch import VllmStartError, build_engine, engine_argv, refused_settings
from worker.vllm_engine.sampling import vllm_sampling_kwargs

VOCAB = 49152


def test_defaults_refuse_nothing_and_each_engine_only_setting_is_named():
    assert refused_settings(WorkerSettings(engine="vllm")) == []
    refused = refused_settings(WorkerSettings(engine="vllm", kv_dtype="int8", block_size=32,
                                              enable_prefix_cache=False))
    assert any(line.startswith("--kv-dtype ") and "--kv-cache-dtype" in line for line in refused)
    assert any(line.startswith("--block-size ") for line in refused)
    assert any(line.startswith("--enable-prefix-cache ") for line in refused)
    assert len(refused) == 3


def test_engine_flags_follow_switchyards_defaults_and_the_model_is_not_theirs():
    argv = engine_argv("/m", "bfloat16", "--tensor-parallel-size 2 --scheduling-policy fcfs")
    assert argv[:2] == ["--model", "/m"]
    assert argv[-4:] == ["--tensor-parallel-size", "2", "--scheduling-policy", "fcfs"]  # last: they win
    with pytest.raises(VllmStartError, match="--model"):
        engine_argv("/m", "auto", "--model=/other")


def test_a_gguf_model_is_refused_with_the_conversion_command():
    with pytest.raises(VllmStartError, match="worker.vllm_engine.hf_folder"):
        build_engine(WorkerSettings(engine="vllm", model="default"))


def test_the_worker_command_exits_2_naming_the_setting():
    argv = [sys.executable, "-m", "config.cli", "worker", "--engine", "vllm", "--kv-dtype", "int8", "--bind",
            "tcp://127.0.0.1:0"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--kv-dtype is a Switchyard-engine setting" in proc.stderr


def test_sampling_maps_field_for_field():
    s = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=5, seed=7, stop_token_ids=(3, 4),
                       logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
                       repetition_penalty=1.1, min_tokens=6, logit_bias=((10, 5.0),))
    kw = vllm_sampling_kwargs(s, VOCAB, resumed=4)
    assert kw["max_tokens"] == 16 and kw["min_tokens"] == 2  # the resumed tokens were streamed already
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"]) == (0.7, 0.9, 5, 7)
    assert kw["stop_token_ids"] == [3, 4] and kw["logit_bias"] == {10: 5.0} and kw["logprobs"] == 2
    assert (kw["presence_penalty"], kw["frequency_penalty"], kw["repetition_penalty"]) == (0.5, -0.5, 1.1)
    plain = vllm_sampling_kwargs(SamplingParams(max_tokens=3), VOCAB)
    assert plain["top_k"] == -1 and "logprobs" not in plain and plain["logit_bias"] is None


def test_grammar_maps_to_llguidance_and_refuses_resume():
    spec = json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    s = SamplingParams(max_tokens=20, grammar=spec.to_dict())
    lark = vllm_sampling_kwargs(s, VOCAB)["grammar"]  # Lark text: vLLM's guidance backend takes no other form
    assert lark.startswith("start: %json ") and '"x-guidance"' in lark  # Switchyard's JSON layout
    with pytest.raises(RequestError) as err:
        vllm_sampling_kwargs(s, VOCAB, resumed=2)
    assert err.value.param == "resumed"


def test_invalid_sampling_names_its_field():
    with pytest.raises(RequestError) as err:
        vllm_sampling_kwargs(SamplingParams(max_tokens=4, top_p=0.0), VOCAB)
    assert err.value.param == "top_p"
