"""Loading checkpoint state without running code: tensors and plain data (numbers, strings, lists, tuples, dicts)
only, never arbitrary pickled objects, so a checkpoint someone shared cannot execute anything when loaded."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


def load_plain(path: str | Path) -> Any:
    """`torch.load(path, weights_only=True)`, with an error that says what was refused and why."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: refused to load: it holds Python objects beyond tensors and plain data, which "
                         f"could run code when unpickled ({first[:200]}); only load checkpoints you trust the origin "
                         f"of, re-saved by m2flow") from None


# ------------------------------------------------------------------------------------------ sealed pickles
# State that only a pickle can hold (an env mid-episode: its simulator, wrappers and RNG) is written sealed: an
# HMAC-SHA256 of the bytes under a key of this user's, kept outside every run directory, leads the file. A file that
# does not carry this machine's seal (written elsewhere, crafted, or changed) is refused before anything unpickles.

SEAL_HEADER = b"m2flow-sealed-v1\n"
KEY_ENV = "M2FLOW_CHECKPOINT_KEY"  # the key file's path (default ~/.m2flow/checkpoint.key)


def checkpoint_key() -> tuple[bytes, Path]:
    """This user's sealing key and its file, created on first use (32 random bytes, readable by the user alone);
    processes that race to create it all end up with the one that won."""
    import os
    import secrets

    path = Path(os.environ.get(KEY_ENV) or Path.home() / ".m2flow" / "checkpoint.key").expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)  # atomic: the first process to link wins, the others read its key
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_bytes(), path


def _seal(payload: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(checkpoint_key()[0], payload, hashlib.sha256).digest()


def save_sealed(obj: Any, path: str | Path) -> None:
    """`torch.save(obj)` to `path`, led by the seal of its bytes."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    Path(path).write_bytes(SEAL_HEADER + _seal(payload) + payload)


def load_sealed(path: str | Path) -> Any:
    """What `save_sealed` wrote, unpickled only once its seal is this user's on this machine; anything else is refused
    with the file named, before a byte of it is unpickled."""
    import hmac
    import io

    data = Path(path).read_bytes()
    mac, payload = data[len(SEAL_HEADER):len(SEAL_HEADER) + 32], data[len(SEAL_HEADER) + 32:]
    if not data.startswith(SEAL_HEADER) or not hmac.compare_digest(mac, _seal(payload)):
        raise ValueError(f"{path}: refused to load: it holds pickled objects, which could run code when unpickled, "
                         f"and it does not carry the seal of this machine's m2flow (key {checkpoint_key()[1]}): it "
                         f"was written elsewhere or changed since; remove it to resume with every env starting a new "
                         f"episode")
    return torch.load(io.BytesIO(payload), weights_only=False)
