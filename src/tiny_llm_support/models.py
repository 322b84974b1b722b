"""Model names: the offline "tiny" checkpoints, shortcuts for Qwen3 on the Hub, local paths.

"tiny" is the small chat model trained in the project and shipped in this package
(train_tiny.py); "tiny-random" is the synthetic random-weight checkpoint the tests use,
made on first use by make_tiny_checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from .tiny import make_tiny_checkpoint

SHORTCUTS: dict[str, str] = {
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-0.6b-4bit": "mlx-community/Qwen3-0.6B-4bit",  # MLX's affine format (Week 4 Day 1)
    "qwen3-0.6b-8bit": "mlx-community/Qwen3-0.6B-8bit",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
}
TINY = "tiny"
TINY_RANDOM = "tiny-random"
TINY_CHAT_DIR = Path(__file__).resolve().parent / "tiny_chat"  # written by `pdm run train-tiny`
HUB_FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
]


class ModelNotAvailableError(RuntimeError):
    """The weights are neither cached locally nor downloadable right now."""


def default_cache_dir() -> Path:
    return Path("~/.cache/tiny-llm").expanduser()


def resolve_model(
    name_or_path: str | Path, cache_dir: str | Path | None = None, offline: bool | None = None
) -> Path:
    """Turn "tiny", "tiny-random", a local directory, a shortcut or an "org/name" repo id into
    a directory.

    `cache_dir` is where "tiny-random" is made. `offline=True` only looks in the Hugging Face
    cache; None follows HF_HUB_OFFLINE.
    """
    name = str(name_or_path)
    if name == TINY:
        return tiny_chat_dir()
    if name == TINY_RANDOM:
        return tiny_checkpoint_dir(cache_dir)
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    repo_id = SHORTCUTS.get(name.lower())
    if repo_id is None and _looks_like_repo_id(name):
        repo_id = name
    if repo_id is None:
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise FileNotFoundError(f"model directory not found: {local}")
        choices = ", ".join([TINY, TINY_RANDOM, *SHORTCUTS])
        raise ValueError(
            f"unknown model {name!r}: use one of {choices}, a Hugging Face repo id "
            "(org/name) or a local checkpoint directory"
        )
    return download(repo_id, offline=offline)


def tiny_chat_dir() -> Path:
    """The trained tiny chat model shipped in the package."""
    if not (TINY_CHAT_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the tiny chat model is missing from {TINY_CHAT_DIR}; "
            "`pdm run train-tiny` trains it again (about 10 minutes)"
        )
    return TINY_CHAT_DIR


def tiny_checkpoint_dir(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """The tiny checkpoint for `seed`, created under the cache directory on first use."""
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = path / f"tiny-seed{seed}"
    if not (path / "config.json").is_file():
        make_tiny_checkpoint(path, seed=seed)
    return path


def download(repo_id: str, offline: bool | None = None) -> Path:
    """Fetch (or find in the Hugging Face cache) the files a checkpoint needs."""
    try:
        import huggingface_hub

        kwargs = {"local_files_only": True} if offline else {}
        path = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_FILES, **kwargs))
    except Exception as e:  # any hub, network or cache error means the same thing here
        raise ModelNotAvailableError(_not_available_message(repo_id, e)) from e
    if not (path / "config.json").is_file():
        raise ModelNotAvailableError(_not_available_message(repo_id, "config.json is missing"))
    return path


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _not_available_message(repo_id: str, cause: object) -> str:
    if isinstance(cause, BaseException):
        detail = str(cause).strip().splitlines()
        cause = f"{type(cause).__name__}: {detail[0] if detail else ''}"
    return (
        f"Model {repo_id} is not in the local Hugging Face cache and could not be downloaded "
        f"({str(cause)[:300]}). Fetch it while online with `pdm run hf download {repo_id}` "
        "or use `--model tiny`, which works offline."
    )
