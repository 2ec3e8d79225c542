"""``agentrt``'s warning for ``AGENTRT_*`` variables that nothing reads (agentrt_cli.unknown_env): a misspelt
variable is named, with the nearest one that is read, instead of being ignored without a word."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrt.config import ServerConfig
from agentrt_cli import OTHER_ENV, unknown_env
from router.config import RouterConfig, WorkerSettings

ROOT = Path(__file__).resolve().parents[1]


def test_a_misspelt_variable_is_named_with_the_nearest_known_one():
    environ = {"AGENTRT_PIN_TTL": "5", "AGENTRT_KV_CACHE_TOKEN": "4096", "AGENTRT_ZZZ": "1",
               "AGENTRT_PIN_TTL_S": "5", "agentrt_port": "8001", "HOME": "/root", "NOT_AGENTRT_X": "1"}
    assert unknown_env(environ) == ["AGENTRT_KV_CACHE_TOKEN (did you mean AGENTRT_KV_CACHE_TOKENS?)",
                                    "AGENTRT_PIN_TTL (did you mean AGENTRT_PIN_TTL_S?)", "AGENTRT_ZZZ"]


def test_every_variable_a_command_or_the_docs_name_is_known():
    names = {cls.env_name(f) for cls in (ServerConfig, RouterConfig, WorkerSettings) for f in cls.model_fields}
    names |= OTHER_ENV
    for path in [ROOT / "README.md", ROOT / "deploy" / "Dockerfile", *(ROOT / "docs").glob("*.md"),
                 *(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "deploy").glob("*.py")]:
        text = re.sub(r"AGENTRT_\w+ \(did you mean", "", path.read_text())   # the warning's own example
        names |= set(re.findall(r"AGENTRT_[A-Z0-9_]*[A-Z0-9]", text))
    assert len(names) > 60
    assert unknown_env(dict.fromkeys(names, "1")) == []


@pytest.mark.slow
def test_the_command_warns_on_stderr():
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("AGENTRT_")}
    run = [sys.executable, "-m", "agentrt_cli", "status", "--help"]
    warned = subprocess.run(run, env={**env, "AGENTRT_PIN_TTL": "5"}, capture_output=True, text=True, cwd=ROOT)
    assert warned.returncode == 0
    assert "agentrt: warning: AGENTRT_PIN_TTL (did you mean AGENTRT_PIN_TTL_S?) is set, but no agentrt setting " \
           "reads it" in warned.stderr
    quiet = subprocess.run(run, env={**env, "AGENTRT_PIN_TTL_S": "5"}, capture_output=True, text=True, cwd=ROOT)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
