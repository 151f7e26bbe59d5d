"""The ``batchpilot`` console entry point dispatches to the Hydra apps of ``scripts/`` with the
arguments unchanged, and the gateway starts in ``policy`` mode when it is given a policy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from batchpilot.cli import COMMANDS, SCRIPTS_DIR, UsageError, main, resolve, usage
from batchpilot.config import load_config
from batchpilot.schemas.serve import ControlConfig, ServeConfig


def test_every_command_names_a_script_of_the_repository() -> None:
    for name, cmd in COMMANDS.items():
        assert (SCRIPTS_DIR / cmd.script).is_file(), name
    # The four the package's users expect are there.
    assert {"train", "evaluate", "serve", "export"} <= set(COMMANDS)


def test_overrides_and_hydra_flags_pass_through_unchanged() -> None:
    args = ["serve.upstreams=[http://127.0.0.1:8001]", "serve.control.policy_dir=policies/pretrained",
            "-m", "--cfg", "job", "hydra.run.dir=/tmp/x y", "+extra='a b'"]
    assert resolve(["serve", *args]) == [sys.executable, str(SCRIPTS_DIR / "serve.py"), *args]
    assert resolve(["train_kv", "logger=none"])[1] == str(SCRIPTS_DIR / "train_kv.py")


@pytest.mark.parametrize("argv, match", [([], "no command"), (["trian"], "unknown command 'trian'.*train")])
def test_a_bad_command_line_says_what_is_wrong(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        resolve(argv)


def test_a_missing_script_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"serve\.py not found.*pip install -e"):
        resolve(["serve"], scripts_dir=tmp_path)


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == usage().strip()
    for name in COMMANDS:
        assert f"  {name} " in out
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_the_installed_script_runs_the_hydra_app() -> None:
    """The console script of ``[project.scripts]`` reaches the app itself: Hydra composes the
    serve config with the overrides given (printed by ``--cfg job``, nothing started)."""
    exe = shutil.which("batchpilot", path=str(Path(sys.executable).parent))
    assert exe is not None, "no batchpilot script beside this Python: run `pip install --no-deps -e .`"
    out = subprocess.run([exe, "serve", "serve.upstreams=[http://127.0.0.1:9]", "serve.port=8123", "--cfg", "job"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "port: 8123" in out and "http://127.0.0.1:9" in out


def _control(*overrides: str) -> ControlConfig:
    cfg = load_config(["serve.upstreams=[http://127.0.0.1:9]", *overrides], config_name="serve_app")
    return ServeConfig.from_cfg(cfg.serve).control


def test_a_policy_given_starts_policy_mode_and_pid_stays_the_default() -> None:
    assert _control().mode == "pid"
    given = _control("serve.control.policy_dir=policies/pretrained")
    assert (given.mode, given.policy_dir) == ("policy", "policies/pretrained")
    # A mode the user names wins over the inference.
    assert _control("serve.control.policy_dir=policies/pretrained", "serve.control.mode=shadow").mode == "shadow"
    assert _control("serve.control.mode=policy").mode == "policy"
    with pytest.raises(ValueError, match="serve.control.mode='polcy'.*policy_dir"):
        ControlConfig(mode="polcy")
