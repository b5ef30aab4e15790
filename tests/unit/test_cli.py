"""The command line: config overrides are taken before or after options, in the order given; anything else that is
not an option of the command is refused with argparse's message."""

import pytest

from m2flow import cli


@pytest.fixture
def seen(monkeypatch):
    got = {}
    for name in ("eval", "train", "demos"):
        monkeypatch.setitem(cli.COMMANDS, name, lambda args: got.update(vars(args)) or 0)
    return got


def test_overrides_before_or_after_options(seen):
    assert cli.main(["eval", "runs/x/checkpoints/step_3", "--k", "1", "data.eval_size=50"]) == 0
    assert seen["model"] == "runs/x/checkpoints/step_3" and seen["k"] == 1 and seen["overrides"] == ["data.eval_size=50"]
    assert cli.main(["train", "grpo_arithmetic", "run.steps=5", "--help-config", "run.name=a", "actor.lr=1e-4"]) == 0
    assert seen["help_config"] is True and seen["overrides"] == ["run.steps=5", "run.name=a", "actor.lr=1e-4"]


def test_unknown_arguments_are_refused(seen, capsys):
    for argv in (["eval", "ckpt", "--bogus", "1"], ["eval", "ckpt", "--k", "1", "stray"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_demos_render_triangles_default_is_the_configs(seen):
    """The CLI keeps its imports light, so `--render-triangles`' default is written out: it must stay the config's
    env.render_triangles and maniskill.RENDER_TRIANGLES, or recorded demos would not match the default config."""
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.envs.maniskill import RENDER_TRIANGLES

    assert cli.main(["demos", "PickCube-v1", "--pixels"]) == 0
    assert seen["render_triangles"] == RENDER_TRIANGLES == EmbodiedConfig().env.render_triangles


def test_pixel_demos_default_to_a_directory_of_their_own(monkeypatch, tmp_path, capsys):
    """`m2flow demos TASK` writes runs/demos/TASK; with --pixels (another dataset of the same seeds) it must not land
    there too: runs/demos/TASK-pixelsSIZE (-wrist with the hand camera's frames)."""
    from m2flow.embodied.envs import experts, maniskill

    written = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(maniskill, "check_available", lambda: None)
    monkeypatch.setattr(experts, "write_demos", lambda task, n, out, **kw: written.append(out) or {
        "episodes": [{"length": 1, "success": True}], "success_rate": 1.0})
    assert cli.main(["demos", "PickCube-v1", "-n", "1"]) == 0
    assert cli.main(["demos", "PickCube-v1", "-n", "1", "--pixels", "--image-size", "128"]) == 0
    assert cli.main(["demos", "PickCube-v1", "-n", "1", "--pixels", "--out", "mine"]) == 0
    assert cli.main(["demos", "PickCube-v1", "-n", "1", "--pixels", "--wrist-camera"]) == 0
    assert written == ["runs/demos/PickCube-v1", "runs/demos/PickCube-v1-pixels128", "mine",
                       "runs/demos/PickCube-v1-pixels64-wrist"]
    assert cli.main(["demos", "PickCube-v1", "-n", "1", "--wrist-camera"]) == 2
    assert "demos: --wrist-camera records the hand camera's frames: it needs --pixels" in capsys.readouterr().err
