"""The model's tokenizer and chat template, loadable without torch (built on `tokenizers`).

A GGUF vocabulary is converted once and cached by file digest; `version` hashes all that decides token ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import tokenizers

from worker.text.chat_template import PLACEHOLDER_CHARS as PLACEHOLDER_CHARS
from worker.text.chat_template import ChatIds, SegmentEncoder, segments
from worker.text.chat_template import (
    hermes_messages as hermes_messages,  # tools rendering: the gateway's face
)
from worker.text.chat_template import native_messages as native_messages
from worker.text.chat_template import special_texts as special_texts
from worker.text.gguf_index import read_index
from worker.text.model_source import ModelSource, cache_base, file_digest, hf_config, resolve

_CACHE_FORMAT = 1


def _cache_root() -> Path:
    return cache_base() / "tokenizers"


class Tokenizer:
    """encode/decode/apply_chat_template over a `tokenizers.Tokenizer` (exposed as `.hf`)."""

    def __init__(self, hf: tokenizers.Tokenizer, meta: dict, *, model_id: str, max_context: int) -> None:
        self.hf = hf
        self.chat_template: str | None = meta.get("chat_template")
        self.bos_token: str | None = meta.get("bos_token")
        self.eos_token: str | None = meta.get("eos_token")
        self.eos_token_id: int = int(meta["eos_token_id"])
        self.bos_token_id: int | None = meta.get("bos_token_id")
        self.vocab_size: int = max(int(meta.get("vocab_size") or 0),
                                   hf.get_vocab_size(with_added_tokens=True))
        self.model_id = model_id
        self.max_context = max_context
        self.version: str = hashlib.sha256(
            hf.to_str().encode() + json.dumps(meta, sort_keys=True).encode()
        ).hexdigest()
        self._template = None
        self._segment_encoder: SegmentEncoder | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.hf.id_to_token(i) for i in ids]

    @property
    def renders_tools(self) -> bool:
        """The chat template has its own tools section (it reads a `tools` variable)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError(f"model {self.model_id} has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        extra = {} if tools is None else {"tools": tools}
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> ChatIds:
        """The template writes the special tokens; message content never yields special-token ids."""
        runs = segments(lambda ms: self.render_chat(ms, add_generation_prompt, tools), messages)
        if self._segment_encoder is None:
            self._segment_encoder = SegmentEncoder(self.hf)
        return self._segment_encoder.encode(runs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode_chat(messages, add_generation_prompt).ids


def load_tokenizer(spec: str | Path | ModelSource = "default") -> Tokenizer:
    src = spec if isinstance(spec, ModelSource) else resolve(spec)
    if src.kind == "gguf":
        return _load_gguf_tokenizer(src)
    return _load_hf_tokenizer(src)


def _load_hf_tokenizer(src: ModelSource) -> Tokenizer:
    hf = tokenizers.Tokenizer.from_file(str(src.path / "tokenizer.json"))
    cfg_path = src.path / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    mcfg = hf_config(src.path)
    template = tcfg.get("chat_template")
    tmpl_file = src.path / "chat_template.jinja"
    if template is None and tmpl_file.is_file():
        template = tmpl_file.read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"),
                        template[0]["template"])
    bos, eos = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
    eos_id = mcfg.get("eos_token_id")
    if isinstance(eos_id, list):
        eos_id = eos_id[0]
    if eos_id is None and eos is not None:
        eos_id = hf.token_to_id(eos)
    meta = {
        "chat_template": template, "bos_token": bos, "eos_token": eos, "eos_token_id": eos_id,
        "bos_token_id": mcfg.get("bos_token_id"), "vocab_size": mcfg.get("vocab_size"),
    }
    max_ctx = int(mcfg.get("max_position_embeddings", 2048))
    return Tokenizer(hf, meta, model_id=src.model_id, max_context=max_ctx)


def _token_text(tok: object) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _load_gguf_tokenizer(src: ModelSource) -> Tokenizer:
    digest = file_digest(src.path)
    cache = _cache_root() / f"{digest[:32]}-v{_CACHE_FORMAT}"
    tok_file, meta_file = cache / "tokenizer.json", cache / "meta.json"
    if not (tok_file.is_file() and meta_file.is_file()):
        _convert_gguf_tokenizer(src.path, cache)
    meta = json.loads(meta_file.read_text())
    hf = tokenizers.Tokenizer.from_file(str(tok_file))
    max_ctx = int(meta.pop("max_context"))
    return Tokenizer(hf, meta, model_id=src.model_id, max_context=max_ctx)


def _convert_gguf_tokenizer(path: Path, cache: Path) -> None:
    """One-time conversion through transformers (slow: imports transformers), written atomically."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    md = read_index(path).meta  # the model load's parse of the file, or one it then reuses
    arch = md.get("general.architecture", "llama")
    meta = {
        "chat_template": md.get("tokenizer.chat_template") or getattr(hf_tok, "chat_template", None),
        "bos_token": hf_tok.bos_token, "eos_token": hf_tok.eos_token,
        "eos_token_id": int(md.get("tokenizer.ggml.eos_token_id", hf_tok.eos_token_id)),
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "vocab_size": int(md.get(f"{arch}.vocab_size") or len(hf_tok)),
        "max_context": int(md.get(f"{arch}.context_length", 2048)),
    }
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    hf_tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "meta.json").write_text(json.dumps(meta))
    for name in ("tokenizer.json", "meta.json"):
        os.replace(tmp / name, cache / name)
    tmp.rmdir()
