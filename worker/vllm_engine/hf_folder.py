"""`python -m worker.vllm_engine.hf_folder MODEL OUT_DIR`: a GGUF model (`default`: the packaged SmolLM2) as a
plain Hugging Face folder (fp32 safetensors, tokenizer, chat template) that vLLM's engine loads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from worker.text.model_source import resolve


def write_hf_folder(spec: str, out: Path) -> Path:
    """Dequantize `spec`'s GGUF weights through transformers into `out` (replaced); returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve(spec)
    if src.kind != "gguf":
        raise ValueError(f"{spec} is a Hugging Face folder already")
    folder, name = str(src.path.parent), src.path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: plain fp32 tensors
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # without the GGUF quantizer
    _, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected:
        raise ValueError(f"tensors the plain model has no place for: {unexpected[:4]}")
    model.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config_path = tmp / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    config_path.write_text(json.dumps(saved, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a folder with config.json is whole: an interrupted run leaves only *.partial
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.vllm_engine.hf_folder",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("model", help="'default' or a .gguf file")
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    print(write_hf_folder(args.model, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
