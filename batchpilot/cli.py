"""``batchpilot <command> [Hydra overrides]``: the console entry point of the package.

Each command is one of the Hydra apps in ``scripts/`` (``batchpilot serve ...`` runs what
``python scripts/serve.py ...`` runs, in this interpreter): the arguments after the command go
to it unchanged, so every Hydra override and flag (``-m``, ``--cfg job``, ``--help``,
``--config-name``) works as documented for the scripts. The process is replaced by the app
(``os.execv``), so signals (Ctrl-C, SIGTERM to a gateway), exit codes and Hydra's output
folders are exactly the script's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from batchpilot.config import REPO_ROOT

#: The folder of the Hydra apps (the package is installed in editable mode from the repository,
#: like ``conf/``).
SCRIPTS_DIR = REPO_ROOT / "scripts"


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand: the script it runs and the line ``batchpilot --help`` shows."""

    script: str
    summary: str


#: Subcommand -> Hydra app, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {
    "train": Command("train.py", "train the PPO policy on the simulator, evaluate it against PID, export it"),
    "train-kv": Command("train_kv.py", "train the KV-precision agent (one decision per 60 s epoch)"),
    "evaluate": Command("evaluate.py", "every controller on the same simulated workloads: tables, CIs, plots"),
    "live-evaluate": Command("live_evaluate.py", "vLLM's benchmark client against vLLM direct and through the gateway"),
    "export": Command("export.py", "a trained SB3 model -> the pickle-free artifact the gateway serves"),
    "serve": Command("serve.py", "the gateway in front of vLLM (policy mode when serve.control.policy_dir is set)"),
    "calibrate": Command("calibrate.py", "fit the simulator to the live engine; the sim-to-real report"),
    "bench": Command("bench.py", "speed benchmarks (target=sim|env|policy|gateway|...; last line JSON)"),
}


class UsageError(Exception):
    """A command line the dispatcher cannot run: the message says what and how to fix it."""


def usage() -> str:
    """The text of ``batchpilot --help``: every subcommand with what it does."""
    width = max(map(len, COMMANDS))
    lines = ["usage: batchpilot <command> [Hydra overrides and flags]", "",
             "An RL / PID controller in front of vLLM. Commands (each a Hydra app in scripts/;",
             "`batchpilot <command> --help` shows its configuration groups):", ""]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    lines += ["", "Examples:",
              "  batchpilot train train.total_timesteps=20000 logger=none",
              "  batchpilot serve serve.upstreams=[http://127.0.0.1:8001] serve.control.policy_dir=policies/pretrained",
              "  batchpilot evaluate --config-name evaluate_matrix out_dir=outputs/evaluate/matrix"]
    return "\n".join(lines)


def resolve(argv: Sequence[str], scripts_dir: Path = SCRIPTS_DIR) -> list[str]:
    """The command line that runs ``argv`` (without the program name): this interpreter on the
    command's script, the remaining arguments unchanged. Raises ``UsageError`` for a missing or
    unknown command, or a script that is not where the repository keeps it."""
    if not argv:
        raise UsageError("no command given")
    name, rest = argv[0], list(argv[1:])
    cmd = COMMANDS.get(name) or COMMANDS.get(name.replace("_", "-"))
    if cmd is None:
        raise UsageError(f"unknown command {name!r}; one of: {', '.join(COMMANDS)}")
    script = scripts_dir / cmd.script
    if not script.is_file():
        raise UsageError(f"{name}: {script} not found (batchpilot runs the apps of its repository checkout: "
                         "install it with `pip install -e .` from the clone)")
    return [sys.executable, str(script), *rest]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchpilot`` console script: help, or replace this process by the
    command's Hydra app. Returns an exit status only when it does not exec (help, usage error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    try:
        cmd = resolve(args)
    except UsageError as e:
        print(f"batchpilot: error: {e}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached: execv replaced the process


if __name__ == "__main__":
    sys.exit(main())
