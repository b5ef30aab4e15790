"""Checkpoint files that cannot run code: plain data loads as plain data (`load_plain`), and a pickle m2flow must
write (the envs mid-episode) loads only under this machine's seal (`save_sealed` / `load_sealed`)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from m2flow.runtime import files


class Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


@pytest.fixture
def key(tmp_path, monkeypatch):
    path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(files.KEY_ENV, str(path))
    return path


def test_a_sealed_pickle_loads_back_and_its_key_is_made_once_for_the_user_alone(tmp_path, key):
    state = {"obs": np.arange(6.0).reshape(2, 3), "t": torch.ones(2), "note": ("a", 1)}
    files.save_sealed(state, tmp_path / "env_0.pkl")
    made = key.read_bytes()
    assert len(made) == 32 and key.stat().st_mode & 0o777 == 0o600
    files.save_sealed(state, tmp_path / "env_1.pkl")
    assert key.read_bytes() == made  # one key, kept
    got = files.load_sealed(tmp_path / "env_1.pkl")
    assert np.array_equal(got["obs"], state["obs"]) and torch.equal(got["t"], state["t"]) and got["note"] == ("a", 1)
    assert list(tmp_path.joinpath("keys").iterdir()) == [key]  # no temporary file left


def test_a_planted_changed_or_foreign_pickle_is_refused_before_its_code_runs(tmp_path, key, monkeypatch):
    marker = tmp_path / "code_ran"
    planted = tmp_path / "planted.pkl"
    torch.save({"group": Touch(marker)}, planted)  # an unsealed pickle
    files.save_sealed({"group": 1}, tmp_path / "changed.pkl")
    data = bytearray((tmp_path / "changed.pkl").read_bytes())
    data[-3] ^= 1  # one bit of the payload
    (tmp_path / "changed.pkl").write_bytes(bytes(data))
    monkeypatch.setenv(files.KEY_ENV, str(tmp_path / "other.key"))  # another machine's m2flow
    files.save_sealed({"group": Touch(marker)}, tmp_path / "foreign.pkl")
    monkeypatch.setenv(files.KEY_ENV, str(key))
    assert not marker.exists()
    for name in ("planted.pkl", "changed.pkl", "foreign.pkl"):
        with pytest.raises(ValueError, match=rf"{name}: refused to load: it holds pickled objects, which could run code "
                                             rf"when unpickled, and it does not carry the seal of this machine's m2flow "
                                             rf"\(key {key}\)"):
            files.load_sealed(tmp_path / name)
    assert not marker.exists()
