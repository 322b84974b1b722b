"""Reading a checkpoint's files without trusting them: every failure is a CheckpointError
that names the file and says what is wrong with it.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON describing
each tensor (dtype, shape, data_offsets into the data that follows), then the data. The
header is checked against the file's size before MLX reads the file, so a truncated download
or a file that is not safetensors at all gets a sentence instead of a loader's message.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

HEADER_LENGTH_BYTES = 8


class CheckpointError(ValueError):
    """A checkpoint file that is missing or cannot be read: the message names the file."""


def read_json_object(path: Path, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in `path` (config.json, tokenizer_config.json, an index file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected {what}, found a JSON {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), "null")


def check_safetensors(path: Path) -> None:
    """Refuse a file whose header does not describe it: too short, a header length or a
    header that is not JSON, or tensor data that reaches past the end of the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_LENGTH_BYTES)
            (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            fits = header_len is not None and header_len <= size - HEADER_LENGTH_BYTES
            header_bytes = f.read(header_len) if fits else b""
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from None
    if header_len is None:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short)")
    if not fits:
        raise CheckpointError(
            f"{path}: truncated or not a safetensors file (its header length says {header_len} "
            f"bytes, the file has {size})"
        )
    try:
        header = json.loads(header_bytes)
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not valid)") from None
    needed = HEADER_LENGTH_BYTES + header_len + max(ends, default=0)
    if needed > size:
        raise CheckpointError(
            f"{path}: truncated or not a safetensors file (header says {needed} bytes, "
            f"file has {size})"
        )
